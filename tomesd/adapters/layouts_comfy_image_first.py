"""The layout of ComfyUI's HiDream-I1 (comfy.ldm.hidream.model.HiDreamImageTransformer2DModel), registered in
layouts.STRATEGIES as "comfy_hidream" as this module is imported: diffusers' "image_first" grid (a latent [B, C, H, W]
patchified row by row inside, its tokens first in every block's input, the text after them passing whole), with the
patch size ComfyUI keeps as an attribute and its latent padded to whole patches.

HiDream-E1 (the edit model) joins its condition image along the width (`image_cond`, concatenated to the latent
before patchifying), so each row of tokens holds target and condition tokens side by side: refused at the call that
gives one (the argument's presence is read, never a tensor value)."""
from __future__ import annotations

from typing import Any, Tuple

from .layouts import STRATEGIES, Layout, Levels, _patch_size
from .layouts_image_first import ImageFirstGrid
from .roots import RootKind
from .signatures import InputSpec


class ComfyHiDreamGrid(ImageFirstGrid):
    def __init__(self, root: Any, kind: RootKind, xp: Any, patch_size: int) -> None:
        super().__init__(root, kind, xp, patch_size)
        self.condition = InputSpec.find(root, ("image_cond",), first_positional=False)

    def read(self, call: Any, module: Any, args: tuple, kwargs: dict, shape: Tuple[int, ...], name: str) -> None:
        if self.condition is not None and self.condition.get(args, kwargs) is not None:
            raise ValueError(
                f"ToMe cannot merge {self.model} given a condition image (image_cond: HiDream-E1's edit): ComfyUI joins "
                f"it to the latent along the width, so each row of tokens holds the target's and the condition's side "
                f"by side and the condition's would merge with the target's. Bypass the ToMe node for this model (the "
                f"text-to-image model HiDream-I1 merges)")
        super().read(call, module, args, kwargs, shape, name)


def _comfy_hidream(root: Any, kind: RootKind, xp: Any) -> Layout:
    patch = _patch_size(root)  # ComfyUI's root keeps it as an attribute (an int)
    return Levels(root, kind, xp) if patch is None else ComfyHiDreamGrid(root, kind, xp, patch)


STRATEGIES["comfy_hidream"] = _comfy_hidream
