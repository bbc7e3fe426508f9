"""HiDream-I1, on diffusers and on ComfyUI: a latent [B, C, H, W] patchified inside whose tokens come first in every
block's input ([image, padding, text]: layout "image_first"; ComfyUI's "comfy_hidream", its patch an attribute and
HiDream-E1's condition image refused at the call).

The layout of ComfyUI's HiDream-I1 (comfy.ldm.hidream.model.HiDreamImageTransformer2DModel) ("comfy_hidream"):
diffusers' "image_first" grid (a latent [B, C, H, W] patchified row by row inside, its tokens first in every block's
input, the text after them passing whole), with the patch size ComfyUI keeps as an attribute and its latent padded to
whole patches.

HiDream-E1 (the edit model) joins its condition image along the width (`image_cond`, concatenated to the latent
before patchifying), so each row of tokens holds target and condition tokens side by side: refused at the call that
gives one (the argument's presence is read, never a tensor value)."""
from __future__ import annotations

from typing import Any, Tuple

from ...layouts.entries import BlockKind, RootKind, Sublayer
from ...layouts.grids import Layout, Levels, config_value, int_patch
from ...layouts.image_first import ImageFirstGrid
from ...layouts.signatures import InputSpec


def _hidream(name: str, single: bool) -> BlockKind:
    """HiDream-I1's blocks: `attn1` (HiDreamAttention) takes the image first, [image, any padding], then (double) the
    text apart or (single) the text joined after them by the root, and rotates [image, text] by rows
    [B, image + text, 1, D/2, 2, 2] (a batch axis: they follow each sample) with its own function before torch's
    attention; `ff_i` (a mixture of experts routing each token alone) sees the same tokens. A non-square latent's image
    is padded to max_seq tokens under `hidden_states_masks` [B, max_seq (+ text)], ones over the image."""
    return BlockKind(
        name,
        sublayers=(Sublayer("attn1", "merge_attn", tokens=("norm_hidden_states",), outputs=() if single else (0,),
                            rotary="image_rotary_emb", rotary_axis=1, image_keys_first=True, image_first=True),
                   Sublayer("ff_i", "merge_mlp", tokens=("x",), image_first=True)),
        downsample=(),
        no_downsample="HiDream's processor projects keys from the tokens it is given and calls torch's attention "
                      "itself, so no seam takes the image's keys alone; use mode='merge'",
        mask="image_ones_first",
        module="diffusers.",  # ComfyUI's HiDream blocks share these names and take other inputs
    )


def _comfy_hidream_block(name: str, single: bool) -> BlockKind:
    """ComfyUI's HiDream-I1 blocks (comfy.ldm.hidream.model; each inside a HiDreamImageBlock, which has no kind):
    `attn1` (HiDreamAttention) takes the image's tokens first, as `norm_image_tokens` by position, and (double) the
    text apart or (single) the text joined after the image by the root; it rotates [image, text] by rows `rope`
    [B, image + text, 1, D/2, 2, 2], image first, with a batch axis (they follow each sample), and calls ComfyUI's
    attention function. `ff_i` (a mixture of experts routing each token alone, or one SwiGLU) sees the same tokens.
    ComfyUI's root never builds `image_tokens_masks` for a latent tensor (its patchify gives None), so no mask
    reaches the attention. The modulation around both is per sample (adaLN over the pooled input)."""
    return BlockKind(
        name,
        sublayers=(Sublayer("attn1", "merge_attn", tokens=("norm_image_tokens",), outputs=() if single else (0,),
                            rotary="rope", rotary_axis=1, image_keys_first=True, image_first=True),
                   Sublayer("ff_i", "merge_mlp", tokens=("x",), image_first=True)),
        downsample=(),
        tokens=("image_tokens",),
        no_downsample="HiDream here (ComfyUI's layout) projects keys from the tokens it is given and calls ComfyUI's "
                      "attention as a plain function, so no seam takes the image's keys alone; use mode='merge'",
        module="comfy.",  # diffusers' classes of these names take hidden_states: _hidream
    )


BLOCK_KINDS: Tuple[BlockKind, ...] = (
    _hidream("HiDreamImageTransformerBlock", single=False), _hidream("HiDreamImageSingleTransformerBlock", single=True),
    _comfy_hidream_block("HiDreamImageTransformerBlock", single=False),
    _comfy_hidream_block("HiDreamImageSingleTransformerBlock", single=True),
)


ROOT_KINDS: Tuple[RootKind, ...] = (
    # HiDream-I1: a latent [B, C, H, W] patchified inside (a non-square one padded to max_seq tokens under a mask);
    # every block's input starts with the image (_hidream), as layout "image_first" reads it.
    RootKind("HiDream-I1", ("HiDreamImageTransformer2DModel",), "image_first", module="diffusers.",
             supported="the HiDream-I1 transformer (torch; merge mode)"),  # (ComfyUI's class of this name: above)
    # ComfyUI's HiDream-I1: diffusers' layout (image tokens first in every block's input, the text after them) with
    # its own block classes (_comfy_hidream_block) and its patch size as an attribute; HiDream-E1's condition
    # image, joined along the width, is refused at the call (ComfyHiDreamGrid).
    RootKind("HiDream (ComfyUI)", ("HiDreamImageTransformer2DModel",), "comfy_hidream", module="comfy.",
             supported="ComfyUI's HiDream-I1 (comfy.ldm.hidream.model.HiDreamImageTransformer2DModel; merge mode; "
                       "not HiDream-E1's edit)"),
)


def _image_first_grid(root: Any, kind: RootKind, xp: Any) -> Layout:
    patch = config_value(root, "patch_size")
    return ImageFirstGrid(root, kind, xp, patch) if isinstance(patch, int) and patch > 0 else Levels(root, kind, xp)


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
    patch = int_patch(root)  # ComfyUI's root keeps it as an attribute (an int)
    return Levels(root, kind, xp) if patch is None else ComfyHiDreamGrid(root, kind, xp, patch)


LAYOUTS = {"image_first": _image_first_grid, "comfy_hidream": _comfy_hidream}
