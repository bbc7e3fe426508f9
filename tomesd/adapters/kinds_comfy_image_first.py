"""Block kinds of ComfyUI's transformers whose blocks put the image first, [image, text] (registered through
kinds_comfy.COMFY_KINDS): HiDream-I1's. ComfyUI's HunyuanVideo (comfy.ldm.hunyuan_video.model) has none here: its
blocks are Flux's DoubleStreamBlock / SingleStreamBlock classes, and the root is refused by name (roots.py)."""
from __future__ import annotations

from typing import Tuple

from .kind_types import BlockKind, Sublayer


def _hidream(name: str, single: bool) -> BlockKind:
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
        module="comfy.",  # diffusers' classes of these names take hidden_states: kinds_image_first.py
    )


COMFY_IMAGE_FIRST_KINDS: Tuple[BlockKind, ...] = (
    _hidream("HiDreamImageTransformerBlock", single=False),
    _hidream("HiDreamImageSingleTransformerBlock", single=True),
)
