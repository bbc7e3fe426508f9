"""The layout of ComfyUI's HiDream-I1 (comfy.ldm.hidream.model.HiDreamImageTransformer2DModel), registered in
layouts.STRATEGIES as "comfy_hidream" as this module is imported: diffusers' "image_first" grid (a latent [B, C, H, W]
patchified row by row inside, its tokens first in every block's input, the text after them passing whole), with the
patch size ComfyUI keeps as an attribute and its latent padded to whole patches.

HiDream-E1 (the edit model) joins its condition image along the width (`image_cond`, concatenated to the latent
before patchifying), so each row of tokens holds target and condition tokens side by side: refused at the call that
gives one (the argument's presence is read, never a tensor value).

"comfy_hunyuan_video": ComfyUI's HunyuanVideo class (comfy.ldm.hunyuan_video.model.HunyuanVideo), which runs
HunyuanVideo, its image-to-video models, HunyuanVideo 1.5 and HunyuanImage 2.1: a latent [B, C, F, H, W] on Wan's
space-time grid (patch_size a list of 3), or [B, C, H, W] patchified by a list of 2 (HunyuanImage 2.1). Its double
blocks take the image alone, its single blocks [image, text] joined by the root: the image is each block input's first
N tokens and whatever follows passes whole (call.tail, set per block). Refused at the call: guiding_frame_index
(HunyuanVideo-I2V's token_replace model, whose first frame is modulated apart by token position) and ref_latent (a
reference latent's tokens joined before the image's)."""
from __future__ import annotations

from typing import Any, Tuple

from .guards import split_sequence
from .layouts import STRATEGIES, Layout, Levels, SpaceTime, _config, _patch_size, _spacetime_patch
from .layouts_image_first import ImageFirstGrid, PatchAxes, image_count
from .roots import RootKind
from .signatures import InputSpec


class ComfyHiDreamGrid(ImageFirstGrid):
    def __init__(self, root: Any, kind: RootKind, xp: Any, patch_size: int) -> None:
        super().__init__(root, kind, xp, patch_size)
        self.condition = InputSpec.find(root, ("image_cond",), first_positional=False)

    def read(self, call: Any, module: Any, args: tuple, kwargs: dict, shape: Tuple[int, ...], name: str) -> None:
        if self.condition is not None and self.condition.get(args, kwargs) is not None:
            raise ValueError(
                f"ToMe cannot merge {self.model} given a condition image (image_cond: HiDream-E1's edit): ComfyUI "
                f"joins it to the latent along the width, so each row of tokens holds the target's and the "
                f"condition's side by side and the condition's would merge with the target's. Bypass the ToMe node "
                f"for this model (the text-to-image model HiDream-I1 merges)")
        super().read(call, module, args, kwargs, shape, name)


def _comfy_hidream(root: Any, kind: RootKind, xp: Any) -> Layout:
    patch = _patch_size(root)  # ComfyUI's root keeps it as an attribute (an int)
    return Levels(root, kind, xp) if patch is None else ComfyHiDreamGrid(root, kind, xp, patch)


class _ImageFirst:
    """Mixin over a coordinate layout: the image is the first N tokens of each block's input; the tokens after it
    (the text, in single blocks) pass whole as the merge's tail."""

    refused_inputs = (
        ("guiding_frame_index", "its first frame's tokens are modulated apart by position (guiding_frame_index: "
                                "HunyuanVideo-I2V's token_replace model), so that frame must stay whole"),
        ("ref_latent", "a reference latent's tokens join before the image's in every block (ref_latent)"),
    )

    def _find_refused(self, root: Any) -> None:
        self.refused = [(InputSpec.find(root, (name,), first_positional=False), why)
                        for name, why in self.refused_inputs]

    def read(self, call: Any, module: Any, args: tuple, kwargs: dict, shape: Tuple[int, ...], name: str) -> None:
        for spec, why in self.refused:
            if spec is not None and spec.get(args, kwargs) is not None:
                raise ValueError(f"ToMe cannot merge {self.model} here: {why}, and ToMe would merge its tokens with "
                                 f"the target's. Bypass the ToMe node for this model (text-to-video merges)")
        super().read(call, module, args, kwargs, shape, name)

    def image_tokens(self, call: Any, x: Any, index: int = 0) -> Any:
        n, s = image_count(self, call, x), self.xp.shape(x)[1]
        if s < n:
            raise split_sequence(self.model, s, n)
        call.tail = s - n  # this block's text, after the image: each its own row of the merge
        return x[:, :n]


class ComfyHunyuanVideoGrid(_ImageFirst, SpaceTime):
    def __init__(self, root: Any, kind: RootKind, xp: Any, patch: Tuple[int, int, int]) -> None:
        super().__init__(root, kind, xp, 2, patch)
        self._find_refused(root)


class ComfyHunyuanImageGrid(_ImageFirst, PatchAxes):
    def __init__(self, root: Any, kind: RootKind, xp: Any, rows: int, cols: int) -> None:
        super().__init__(root, kind, xp, rows, cols)
        self._find_refused(root)


def _comfy_hunyuan_video(root: Any, kind: RootKind, xp: Any) -> Layout:
    patch = _spacetime_patch(root)  # ComfyUI's root keeps patch_size as an attribute (a list)
    if patch is not None:
        return ComfyHunyuanVideoGrid(root, kind, xp, patch)
    size = getattr(root, "patch_size", None) if _config(root, "patch_size") is None else _config(root, "patch_size")
    if isinstance(size, (tuple, list)) and len(size) == 2 and all(isinstance(p, int) and p > 0 for p in size):
        return ComfyHunyuanImageGrid(root, kind, xp, size[0], size[1])  # HunyuanImage 2.1: [B, C, H, W]
    return Levels(root, kind, xp)


STRATEGIES["comfy_hidream"] = _comfy_hidream
STRATEGIES["comfy_hunyuan_video"] = _comfy_hunyuan_video
