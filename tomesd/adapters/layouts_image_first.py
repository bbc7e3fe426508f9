"""Layouts of the transformers whose blocks join [image, text] with the image first (kinds_image_first.py), registered
in layouts.STRATEGIES as this module is imported:

- "hunyuan_video": HunyuanVideo's latent [B, C, F, H, W] on Wan's space-time grid (patch_size, patch_size_t). Its
  image-to-video model built with image_condition_type="token_replace" runs other blocks, which give the first
  frame's tokens (the clean condition image) their own modulation by `num_tokens`: refused at apply time, since
  those tokens must never merge with the frames being generated.
- "framepack": HunyuanVideo Framepack's: the target's latent gives the grid, and the history's tokens, joined before
  the target's in each block's input, pass whole (TokenMerge.with_passing_head).
- "patch_axes": HunyuanImage 2.1's latent [B, C, H, W] patchified by a (rows, cols) patch given as a tuple, matched on
  grid coordinates as "patchgrid" (its rotary rows follow each sample at the attention dispatch).
"""
from __future__ import annotations

from typing import Any

from .layouts import STRATEGIES, Layout, Levels, PatchGrid, SpaceTime, _config, _spacetime_patch
from .roots import RootKind


class HunyuanVideoGrid(SpaceTime):
    def validate(self, patch: Any) -> None:
        if _config(patch.root, "image_condition_type") == "token_replace":
            raise ValueError(
                f"ToMe cannot merge {self.model} built with image_condition_type='token_replace' (HunyuanVideo-I2V): "
                f"its blocks (HunyuanVideoTokenReplace*) keep the first frame's tokens, the condition image, apart by "
                f"num_tokens, and ToMe would merge them with the generated frames' tokens. Run this model without ToMe "
                f"(remove_patch); text-to-video and image_condition_type='latent_concat' merge")


def _hunyuan_video(root: Any, kind: RootKind, xp: Any) -> Layout:
    patch = _spacetime_patch(root)
    return Levels(root, kind, xp) if patch is None else HunyuanVideoGrid(root, kind, xp, 2, patch)


class FramepackGrid(SpaceTime):
    """Framepack: the target's latent [B, C, F, H, W] (its `hidden_states`) gives the grid; the root joins the
    history's tokens (4x, 2x, clean latents) before the target's in every block's input, so the target is the input's
    last N tokens and whatever precedes them passes whole (call.head: each its own row of every merge)."""

    def image_tokens(self, call: Any, x: Any) -> Any:
        tokens = super().image_tokens(call, x)
        call.head = self.xp.shape(x)[1] - self.xp.shape(tokens)[1] - call.tail
        return tokens


def _framepack(root: Any, kind: RootKind, xp: Any) -> Layout:
    patch = _spacetime_patch(root)
    return Levels(root, kind, xp) if patch is None else FramepackGrid(root, kind, xp, 2, patch)


class PatchAxes(PatchGrid):
    """A latent [B, C, H, W] patchified by (ph, pw): a space-time grid of one frame."""

    def __init__(self, root: Any, kind: RootKind, xp: Any, rows: int, cols: int) -> None:
        SpaceTime.__init__(self, root, kind, xp, 0, (1, rows, cols))


def _patch_axes(root: Any, kind: RootKind, xp: Any) -> Layout:
    size = _config(root, "patch_size")
    if isinstance(size, (tuple, list)) and len(size) == 2 and all(isinstance(p, int) and p > 0 for p in size):
        return PatchAxes(root, kind, xp, size[0], size[1])
    # A 3-D patch (frames, rows, cols) takes a video latent [B, C, F, H, W], frames on axis 2.
    patch = _spacetime_patch(root)
    return Levels(root, kind, xp) if patch is None else SpaceTime(root, kind, xp, 2, patch)


STRATEGIES["hunyuan_video"] = _hunyuan_video
STRATEGIES["patch_axes"] = _patch_axes
STRATEGIES["framepack"] = _framepack
