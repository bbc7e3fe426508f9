"""Sana-Video: linear self-attention over every frame's tokens (layout "spacetime"); SANA-WM, refused by name. (Sana's
image transformer: image/dit.py.)"""
from __future__ import annotations

from typing import Tuple

from ...layouts.entries import NOT_YET, RUN_WITHOUT, BlockKind, RootKind, Sublayer


BLOCK_KINDS: Tuple[BlockKind, ...] = (
    # Sana-Video: linear self-attention over every frame's image tokens, rotated by Wan's rows [1, S, 1, D];
    # cross-attention to the text. Its feed-forward (GLUMBTempConv) convolves the (frames, rows, columns) grid,
    # so it is not a merge site.
    BlockKind(
        "SanaVideoTransformerBlock",
        sublayers=(Sublayer("attn1", "merge_attn", tokens=("hidden_states",), rotary="rotary_emb", rotary_axis=1),
                   Sublayer("attn2", "merge_crossattn", tokens=("hidden_states",))),
        downsample=(),
        no_downsample=(
            "Sana-Video's linear self-attention rotates its keys by every image token's rotary row, so keys "
            "cannot come from the downsampled grid; use mode='merge'"),
        no_weights=("Sana-Video's self-attention is linear attention (ReLU kernels, no softmax), so there are no "
                    "scores for a merged key's weight; apply_patch with proportional_attention=False"),
    ),
)


ROOT_KINDS: Tuple[RootKind, ...] = (
    RootKind("Sana-Video", ("SanaVideoTransformer3DModel",), "spacetime", frame_axis=2,
             supported="the Sana-Video transformer (torch)"),
    RootKind(family="SANA-WM", classes=("SanaWMTransformer3DModel", "SanaWMLTX2RefinerTransformer3DModel"),
             layout="levels",
             refused=f"a world-model transformer (gated delta-net attention; its refiner: audio and video streams "
                     f"under a key/value cache), {NOT_YET}; {RUN_WITHOUT}"),
)
