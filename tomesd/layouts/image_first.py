"""Grids whose image tokens share each block's input with tokens that pass whole, the image's matched on its grid:
- HeadGrid: a space-time grid whose target tokens are the last N, the tokens before them passing whole (HunyuanVideo's
  token_replace condition frame, Framepack's history, Motif-Video: families/video/hunyuan_video.py);
- PatchAxes: a latent [B, C, H, W] patchified by a (rows, cols) patch given as a tuple (HunyuanImage 2.1), matched on
  grid coordinates as "patchgrid";
- ImageFirstGrid: a patch grid whose tokens come first in every block's input (HiDream-I1), what follows passing
  whole; image_count: how many tokens that image holds."""
from __future__ import annotations

from typing import Any, Tuple

from .coordinates import PatchGrid, SpaceTime
from .entries import RootKind


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


class PatchAxes(PatchGrid):
    """A latent [B, C, H, W] patchified by (ph, pw): a space-time grid of one frame."""

    def __init__(self, root: Any, kind: RootKind, xp: Any, rows: int, cols: int) -> None:
        SpaceTime.__init__(self, root, kind, xp, 0, (1, rows, cols))


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
