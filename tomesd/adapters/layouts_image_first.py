"""Layouts of the transformers whose blocks join [image, text] with the image first (kinds_image_first.py), registered
in layouts.STRATEGIES as this module is imported:

- "hunyuan_video": HunyuanVideo's latent [B, C, F, H, W] on Wan's space-time grid (patch_size, patch_size_t). Its
  image-to-video model built with image_condition_type="token_replace" runs other blocks, which give the first
  frame's tokens (the clean condition image) their own modulation by `num_tokens`: that frame passes whole (a head,
  as below) and the frames after it merge.
- "motif_video": Motif-Video's: HunyuanVideo's grid, no condition frame (its image-to-video pipeline joins the image
  embedding to the text, and the condition latent along the channels). Refused at apply time when its single blocks
  have a text cross-attention, which rotates the span's merged queries by the unmerged rows.
- "framepack": HunyuanVideo Framepack's: the target's latent gives the grid, and the history's tokens, joined before
  the target's in each block's input, pass whole (TokenMerge.with_passing_head).
- "image_first": HiDream-I1's latent [B, C, H, W], patchified row by row inside, whose tokens come first in every
  block's input (a non-square latent's padding and the text after them pass whole).
- "patch_axes": HunyuanImage 2.1's latent [B, C, H, W] patchified by a (rows, cols) patch given as a tuple, matched on
  grid coordinates as "patchgrid" (its rotary rows follow each sample at the attention dispatch).
"""
from __future__ import annotations

from typing import Any, Tuple

from .layouts import STRATEGIES, Layout, Levels, PatchGrid, SpaceTime, _config, _spacetime_patch
from .roots import RootKind


class HeadGrid(SpaceTime):
    """A space-time grid [B, C, F, H, W] whose target tokens are the last N of each block's input; the tokens before
    them pass whole, each its own row of every merge (call.head, TokenMerge.with_passing_head): Framepack's history
    (4x, 2x and clean latents, joined before the target's by the root), or HunyuanVideo-I2V's first frame
    (`condition_frames`=1: the clean condition image, which its token_replace blocks modulate apart by num_tokens)."""

    def __init__(self, root: Any, kind: RootKind, xp: Any, patch: Tuple[int, int, int], condition_frames: int) -> None:
        super().__init__(root, kind, xp, 2, patch)
        self.condition_frames = condition_frames

    def _grid(self, shape: Tuple[int, ...]) -> Any:
        frames, rows, cols = super()._grid(shape)
        return frames - self.condition_frames, rows, cols

    def read(self, call: Any, module: Any, args: tuple, kwargs: dict, shape: Tuple[int, ...], name: str) -> None:
        super().read(call, module, args, kwargs, shape, name)
        if call.grid[0] < 1:
            raise ValueError(f"{self.model}'s first latent frame is the condition image (image_condition_type="
                             f"'token_replace'), which never merges, and this call has no other frame: generate more "
                             f"frames, or run this call without ToMe (remove_patch)")

    def image_tokens(self, call: Any, x: Any, index: int = 0) -> Any:
        tokens = super().image_tokens(call, x)
        call.head = self.xp.shape(x)[1] - self.xp.shape(tokens)[1] - call.tail
        return tokens


def _hunyuan_video(root: Any, kind: RootKind, xp: Any) -> Layout:
    patch = _spacetime_patch(root)
    first = 1 if _config(root, "image_condition_type") == "token_replace" else 0
    return Levels(root, kind, xp) if patch is None else HeadGrid(root, kind, xp, patch, first)


class MotifGrid(HeadGrid):
    def __init__(self, root: Any, kind: RootKind, xp: Any, patch: Tuple[int, int, int]) -> None:
        super().__init__(root, kind, xp, patch, 0)
        self.single_cross = bool(_config(root, "enable_text_cross_attention_single"))

    def validate(self, patch: Any) -> None:
        if self.single_cross and patch.args.merge_attn:
            raise ValueError(
                f"ToMe cannot merge the single blocks of {self.model} built with enable_text_cross_attention_single="
                f"True: their text cross-attention takes the merged joint attention's output with the unmerged rotary "
                f"rows; call apply_patch with merge_attn=False (the double blocks' feed-forward merges)")


def _motif_video(root: Any, kind: RootKind, xp: Any) -> Layout:
    patch = _spacetime_patch(root)
    return Levels(root, kind, xp) if patch is None else MotifGrid(root, kind, xp, patch)


def _framepack(root: Any, kind: RootKind, xp: Any) -> Layout:
    patch = _spacetime_patch(root)
    return Levels(root, kind, xp) if patch is None else HeadGrid(root, kind, xp, patch, 0)


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


class ImageFirstGrid(PatchGrid):
    """HiDream-I1: a latent [B, C, H, W] patchified row by row inside; every block's input starts with the image's
    tokens (then a non-square latent's padding up to max_seq, then, in single blocks, the text)."""

    def image_tokens(self, call: Any, x: Any, index: int = 0) -> Any:
        return x[:, : image_count(self, call, x)]


def image_count(layout: Any, call: Any, x: Any) -> int:
    """How many tokens the image holds at the start of a block's input `x`, from the call's coordinates (settled
    here at the first block); an image-first sequence is refused under context parallelism, which bands it."""
    if call.coords is None:
        call.coords = layout._coords(call, x)
    if call.band is not None and call.band.index is not None:
        raise ValueError(f"{layout.model} under context parallelism cannot be merged: its image tokens come first in "
                         f"a sequence ToMe cannot band; run it on one process, or without ToMe")
    return layout.xp.shape(call.coords[0])[0]


def _image_first_grid(root: Any, kind: RootKind, xp: Any) -> Layout:
    patch = _config(root, "patch_size")
    return ImageFirstGrid(root, kind, xp, patch) if isinstance(patch, int) and patch > 0 else Levels(root, kind, xp)


STRATEGIES["hunyuan_video"] = _hunyuan_video
STRATEGIES["image_first"] = _image_first_grid
STRATEGIES["patch_axes"] = _patch_axes
STRATEGIES["framepack"] = _framepack
STRATEGIES["motif_video"] = _motif_video
