"""Mochi: image and text enter the block apart, the text's mask its own (BlockKind.mask "text"); [B, C, F, H, W]
patchified frame by frame in Wan's token order (layout "spacetime")."""
from __future__ import annotations

from typing import Tuple

from ...layouts.entries import BlockKind, RootKind, Sublayer


BLOCK_KINDS: Tuple[BlockKind, ...] = (
    # Mochi: image and text enter the block apart; the joint attention rotates the image's queries and keys by rows
    # (cos, sin) [image, heads, D/2] with its own function (no dispatch: one matching serves the batch), then per
    # sample joins [image, the text its mask keeps]; the image's length comes from the queries it is given.
    BlockKind(
        "MochiTransformerBlock",
        sublayers=(Sublayer("attn1", "merge_attn", tokens=("hidden_states",), outputs=(0,), rotary="image_rotary_emb"),
                   Sublayer("ff", "merge_mlp")),
        downsample=(),
        no_downsample="Mochi's processor projects the image's keys with its queries and joins the text per sample "
                      "inside, so no seam takes image keys alone; use mode='merge'",
        no_weights="Mochi's processor calls torch's attention once per sample on a joined sequence it cuts by the "
                   "mask; use proportional_attention=False",
        mask="text",
    ),
)


ROOT_KINDS: Tuple[RootKind, ...] = (
    # Mochi: [B, C, F, H, W] patchified frame by frame (patch 2, one frame each) in Wan's token order.
    RootKind("Mochi", ("MochiTransformer3DModel",), "spacetime", frame_axis=2,
             supported="the Mochi video transformer (torch; merge mode)"),
)
