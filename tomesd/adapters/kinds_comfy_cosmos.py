"""The block kind of ComfyUI's Cosmos Predict2 (comfy.ldm.cosmos.predict2.MiniTrainDIT), whose class is named
`Block`: kept to its module (BlockKind.module). Its blocks take and return the grid [B, T, H, W, D], flattened to
[B, T*H*W, D] only around each attention (layouts_comfy_cosmos.py reads the block input as that sequence)."""
from __future__ import annotations

from typing import Tuple

from .kind_types import BlockKind, Sublayer

COMFY_COSMOS_KINDS: Tuple[BlockKind, ...] = (
    # Block(x [B, T, H, W, D], emb, crossattn_emb, rope_emb_L_1_1_D, ...): `self_attn` is given the modulated grid
    # flattened to tokens in (t, h, w) order and the rows `rope_emb` [1, L, 1, 1, 1, D] (a batch axis of one: they
    # follow each sample's merged tokens), which it applies to its own queries and keys only; `cross_attn` takes the
    # text as keys (it is given the rows too and leaves them unused). The MLP runs on the grid [B, T, H, W, D], so it is
    # no merge site. The modulation (per sample, or per frame) is applied to the grid outside these sub-layers.
    BlockKind(
        "Block",
        sublayers=(Sublayer("self_attn", "merge_attn", tokens=("x",), rotary="rope_emb", rotary_axis=1),
                   Sublayer("cross_attn", "merge_crossattn", tokens=("x",))),
        downsample=(),
        tokens=("x_B_T_H_W_D",),
        no_downsample=(
            "Cosmos Predict2 here (ComfyUI's MiniTrainDIT) rotates self-attention's keys by rows for every token "
            "inside its attention module, so keys from a downsampled grid would not meet their rows; use mode='merge'"),
        module="comfy.ldm.cosmos.predict2",
    ),
)
