"""The "comfy_cosmos" layout: ComfyUI's Cosmos Predict2 (comfy.ldm.cosmos.predict2.MiniTrainDIT). Its latent
[B, C, T, H, W] is patchified by (patch_temporal, patch_spatial, patch_spatial), attributes of the root (it names
no patch_size), into a grid [B, T', H', W', D] that its blocks take and return whole; each attention is given the grid
flattened in (t, h, w) order, Wan's space-time order. So the matching is SpaceTime's, computed from the block's
input read as [B, T'*H'*W', D] (a view); the attentions' flattened tokens merge and unmerge around them.
"""
from __future__ import annotations

from numbers import Integral
from typing import Any, Optional, Tuple

from .layouts import STRATEGIES, SpaceTime
from .roots import RootKind


def _cosmos_patch(root: Any) -> Optional[Tuple[int, int, int]]:
    pt, ps = getattr(root, "patch_temporal", None), getattr(root, "patch_spatial", None)
    if all(isinstance(p, Integral) and not isinstance(p, bool) and p > 0 for p in (pt, ps)):
        return int(pt), int(ps), int(ps)
    return None


class ComfyCosmos(SpaceTime):
    """SpaceTime's grid and matching, the patch from the root's patch_temporal / patch_spatial; a block input given
    as the grid [B, T, H, W, D] is read as its tokens [B, T*H*W, D]."""

    def __init__(self, root: Any, kind: RootKind, xp: Any) -> None:
        self.found_patch = _cosmos_patch(root)
        super().__init__(root, kind, xp, kind.frame_axis or 2, self.found_patch or (1, 1, 1))

    def validate(self, patch: Any) -> None:
        if self.found_patch is None:
            raise ValueError(f"ToMe reads {self.model}'s patch from its patch_temporal and patch_spatial (ints), and "
                             f"this model has none: apply it to the MiniTrainDIT ComfyUI builds")

    def image_tokens(self, call: Any, x: Any, index: int = 0) -> Any:
        shape = self.xp.shape(x)
        if len(shape) == 5:  # the grid [B, T, H, W, D]: its tokens in (t, h, w) order
            x = self.xp.reshape(x, [shape[0], shape[1] * shape[2] * shape[3], shape[4]])
        return super().image_tokens(call, x, index)


STRATEGIES["comfy_cosmos"] = ComfyCosmos
