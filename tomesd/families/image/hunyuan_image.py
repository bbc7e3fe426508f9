"""HunyuanImage 2.1 (HunyuanVideo's blocks under its own classes, over a latent patchified by a (rows, cols) tuple:
layout "patch_axes") and HunyuanDiT (self- and cross-attention rotating the image's queries by rows [image, D]). Its
block factories are HunyuanVideo's (video/hunyuan_video.py); ComfyUI runs HunyuanImage 2.1 with its HunyuanVideo class
(there too)."""
from __future__ import annotations

from typing import Any, Tuple

from ...layouts.coordinates import SpaceTime
from ...layouts.entries import BlockKind, RootKind, Sublayer
from ...layouts.grids import Layout, Levels, config_value, spacetime_patch
from ...layouts.image_first import PatchAxes
from ..video.hunyuan_video import double_stream, single_stream


BLOCK_KINDS: Tuple[BlockKind, ...] = (
    double_stream("HunyuanImageTransformerBlock"), single_stream("HunyuanImageSingleTransformerBlock"),
    # HunyuanDiT: self-attention and cross-attention over the image, both rotating its queries (the
    # self-attention its keys too) by rows [image, D]; the feed-forward. Skip connections join at the block's
    # input, whole.
    BlockKind(
        "HunyuanDiTBlock",
        sublayers=(Sublayer("attn1", "merge_attn", rotary="image_rotary_emb"),
                   Sublayer("attn2", "merge_crossattn", rotary="image_rotary_emb"),
                   Sublayer("ff", "merge_mlp")),
        downsample=(),
        no_downsample=(
            "HunyuanDiT's processor rotates keys after projecting them and calls torch's attention itself, so "
            "no seam takes the rotated keys; use mode='merge'"),
    ),
)


ROOT_KINDS: Tuple[RootKind, ...] = (
    # HunyuanImage 2.1: HunyuanVideo's blocks under its own classes over a latent [B, C, H, W] patchified by a tuple
    # (rows, cols); before the suffix rule below, which would read it as a patchified latent of an int patch.
    RootKind("HunyuanImage 2.1", ("HunyuanImageTransformer2DModel",), "patch_axes",
             supported="the HunyuanImage 2.1 transformer (torch; merge mode)"),
    RootKind("HunyuanDiT", ("HunyuanDiT2DModel",), "patchgrid", supported="the HunyuanDiT transformer (torch)"),
)


def _patch_axes(root: Any, kind: RootKind, xp: Any) -> Layout:
    size = config_value(root, "patch_size")
    if isinstance(size, (tuple, list)) and len(size) == 2 and all(isinstance(p, int) and p > 0 for p in size):
        return PatchAxes(root, kind, xp, size[0], size[1])
    # A 3-D patch (frames, rows, cols) takes a video latent [B, C, F, H, W], frames on axis 2.
    patch = spacetime_patch(root)
    return Levels(root, kind, xp) if patch is None else SpaceTime(root, kind, xp, 2, patch)


LAYOUTS = {"patch_axes": _patch_axes}
