"""The "packed" layout: a packed latent [B, N, C] whose token grid is not in its shape but in arguments of the
root's forward, read on the host as the plain values they are (ints, Python lists; never a tensor's values):
LTX-Video's `num_frames`, `height`, `width`; Qwen-Image's `img_shapes`, a list per sample of (frames, rows, cols)
per image. Tokens are in (frame, row, col) order, as Wan's space-time grid, so the matching is SpaceTime's.

Qwen-Image-Edit (and Edit Plus) joins reference images' tokens after the target's, each image an entry of the
sample's list after the target's (Qwen-Image-Layered its other layers and its condition image, likewise): the
first entry is the target, whose tokens merge; the others' tokens pass whole (call.tail,
TokenMerge.with_passing_tail), so no merged row mixes a target token with a reference token. The arguments say it
on the host, so no pipeline hook (hosts/references.py) is needed.
"""
from __future__ import annotations

from numbers import Integral
from typing import Any, List, Optional, Tuple

from .coordinates import SpaceTime
from .entries import RootKind
from .signatures import InputSpec

Grid = Tuple[int, int, int]


class Packed(SpaceTime):
    """SpaceTime's grid and matching over a packed latent, the grid read from `RootKind.grid_args`."""

    latent_dims = 3

    def __init__(self, root: Any, kind: RootKind, xp: Any) -> None:
        super().__init__(root, kind, xp, 0, (1, 1, 1))
        self.names = kind.grid_args
        self.specs: List[Optional[InputSpec]] = [InputSpec.find(root, (name,), False) for name in self.names]
        # Strides along time apply to LTX's frames; Qwen-Image's images are one frame each.
        self.frames_in_sequence = len(self.names) == 3

    def validate(self, patch: Any) -> None:
        missing = [name for name, spec in zip(self.names, self.specs) if spec is None]
        if missing:
            raise ValueError(f"{self.model}.forward takes no {', '.join(map(repr, missing))}: ToMe reads its packed "
                             f"latent's token grid from {', '.join(self.names)}")

    def read(self, call: Any, module: Any, args: tuple, kwargs: dict, shape: Tuple[int, ...], name: str) -> None:
        if len(shape) != 3:
            raise ValueError(f"ToMe needs {self.model}'s '{name}' input to be a packed latent [B, N, C], got shape "
                             f"{list(shape)}")
        values = [spec.get(args, kwargs) for spec in self.specs]
        grid, images = self._frames(values) if len(values) == 3 else self._shapes(values[0])
        total = sum(f * h * w for f, h, w in images)
        if total != shape[1]:
            raise ValueError(
                f"{self.model}'s {', '.join(self.names)} give {total} tokens ({images}) for a latent of {shape[1]}: "
                f"ToMe merges the target's tokens on the grid they give, so they must count the latent's tokens (a "
                f"pipeline that joins condition tokens after the grid's, as LTX2ConditionPipeline's keyframes and "
                f"LTX2InContextPipeline's references: run it without ToMe)")
        call.grid = grid
        call.tail = total - grid[0] * grid[1] * grid[2]  # reference images' tokens, after the target's

    def _frames(self, values: List[Any]) -> Tuple[Grid, List[Grid]]:
        """LTX-Video: (num_frames, height, width), in tokens."""
        if not all(isinstance(v, Integral) and not isinstance(v, bool) for v in values):
            raise ValueError(
                f"ToMe reads {self.model}'s token grid from its {', '.join(self.names)} arguments as ints, got "
                f"{[type(v).__name__ for v in values]}. A call given video_coords instead (LTXConditionPipeline, whose "
                f"condition tokens join the sequence) has no grid ToMe can read without reading tensors: use "
                f"LTXPipeline or LTXImageToVideoPipeline, or run this one without ToMe")
        grid = (int(values[0]), int(values[1]), int(values[2]))
        return grid, [grid]

    def _shapes(self, shapes: Any) -> Tuple[Grid, List[Grid]]:
        """Qwen-Image: per sample, one (frames, rows, cols) or a list of them (target first, then references)."""
        if not isinstance(shapes, (list, tuple)) or not shapes:
            raise ValueError(f"ToMe reads {self.model}'s token grid from its {self.names[0]} argument (a list per "
                             f"sample of (frames, height, width)), got {type(shapes).__name__}")
        samples = [[entry] if _is_grid(entry) else list(entry) for entry in shapes]
        if any(not images or not all(_is_grid(g) for g in images) for images in samples):
            raise ValueError(f"ToMe needs {self.model}'s {self.names[0]} to hold (frames, height, width) ints for each "
                             f"image of each sample, got {shapes!r}")
        images = [tuple(int(v) for v in g) for g in samples[0]]
        # The host's rotary table is built from the first sample's entry for the whole batch (a warning otherwise):
        # so is ToMe's grid, and the latent's tokens are counted by it.
        if any([tuple(int(v) for v in g) for g in sample] != images for sample in samples[1:]):
            raise ValueError(f"{self.model} was given {self.names[0]} that differ by sample ({shapes!r}); its rotary "
                             f"rows follow the first sample's for all, and so would ToMe's grid: call it with one "
                             f"image size per batch")
        return images[0], images


def _is_grid(entry: Any) -> bool:
    return (isinstance(entry, (tuple, list)) and len(entry) == 3
            and all(isinstance(v, Integral) and not isinstance(v, bool) for v in entry))

