"""The "comfy_ltxv" layout: ComfyUI's LTX-Video (comfy.ldm.lightricks.model.LTXVModel). Its latent [B, C, F, H, W] is
patchified inside by a SymmetricPatchifier whose patch (1, 1, 1) the root names nowhere else (no patch_size
attribute or config), so the patch is read from the patchifier; tokens are in (frame, row, col) order, Wan's
space-time grid. Guide frames (LTXVAddGuide: keyframes, or a video to extend) are appended to the latent along its
frames, their tokens last, with their own coordinates in `keyframe_idxs` [B, 3, guide tokens]: they are condition
tokens and pass whole (call.tail, TokenMerge.with_passing_tail); the target's frames before them merge. Only shapes
are read.
"""
from __future__ import annotations

from numbers import Integral
from typing import Any, Optional, Tuple

from .layouts import STRATEGIES, SpaceTime
from .roots import RootKind
from .signatures import InputSpec


def _patchifier_patch(root: Any) -> Optional[Tuple[int, int, int]]:
    size = getattr(getattr(root, "patchifier", None), "patch_size", None)
    if isinstance(size, (tuple, list)) and len(size) == 3 and all(isinstance(p, Integral) and p > 0 for p in size):
        return tuple(int(p) for p in size)
    return None


class ComfyLTXV(SpaceTime):
    """SpaceTime's grid and matching, the patch from the root's patchifier; guide frames' tokens pass whole."""

    def __init__(self, root: Any, kind: RootKind, xp: Any) -> None:
        self.found_patch = _patchifier_patch(root)
        super().__init__(root, kind, xp, kind.frame_axis or 2, self.found_patch or (1, 1, 1))
        self.guides = InputSpec.find(root, ("keyframe_idxs",), False)

    def validate(self, patch: Any) -> None:
        if self.found_patch is None:
            raise ValueError(f"ToMe reads {self.model}'s patch size from its patchifier's patch_size, (frames, rows, "
                             f"cols) ints, and this model has none: apply it to the LTXVModel ComfyUI builds")

    def read(self, call: Any, module: Any, args: tuple, kwargs: dict, shape: Tuple[int, ...], name: str) -> None:
        super().read(call, module, args, kwargs, shape, name)
        guides = None if self.guides is None else self.guides.get(args, kwargs)
        if guides is None:
            return
        f, h, w = call.grid
        given = self.xp.shape(guides)
        tokens = given[-1] if len(given) == 3 else -1
        if tokens < 0 or tokens % (h * w) or tokens >= f * h * w:
            raise ValueError(f"{self.model} was given keyframe_idxs of shape {list(given)} for a latent of {f} frames "
                             f"of {h}x{w} tokens: ToMe passes guide frames' tokens whole, as whole frames after the "
                             f"target's, and these are not; bypass the ToMe node for this model")
        call.grid = (f - tokens // (h * w), h, w)  # the target's frames; the guides' tokens follow them
        call.tail = tokens


STRATEGIES["comfy_ltxv"] = ComfyLTXV
