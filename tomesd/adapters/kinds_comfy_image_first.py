"""Block kinds of ComfyUI's transformers whose blocks put the image first, [image, text] (registered through
kinds_comfy.COMFY_KINDS, ahead of Flux's kinds of the same classes): HunyuanVideo's double blocks and HiDream-I1's.
HunyuanVideo's single blocks are Flux's SingleStreamBlock class and kind: its layout
(layouts_comfy_image_first.py) passes the text after the image whole as the sequence's tail."""
from __future__ import annotations

from typing import Tuple

from .kind_types import BlockKind, Span, Sublayer

# HunyuanVideo's double blocks: ComfyUI's (Black Forest Labs') DoubleStreamBlock built with flipped_img_txt=True,
# which joins queries, keys and values as [image, text], rotates them by the rows `pe` [B, 1, image + text, ...]
# (image first) inside the attention function, and splits the output at the block input's image length. The image
# merges after img_norm1 (the modulation after it is per sample, or by frame with guiding_frame_index: refused by
# the layout), its rows follow as the block is entered, and its attention output unmerges at the attention
# function's output, before that split (Span.unmerge_at), rather than after img_attn.proj: proj is a per-token
# linear layer, so this gives what unmerging after it gives, and the split meets the image's whole length.
_FLIPPED_DOUBLE = BlockKind(
    "DoubleStreamBlock",
    sublayers=(),
    downsample=(),
    tokens=("img",),
    spans=(Span("img_norm1", None, ("img_attn.proj",), "merge_attn", attention="img_attn", rotary_at="", rotary="pe",
                rotary_axis=2, image_first=True, unmerge_at="comfy.ldm.flux.layers:attention"),
           Span("img_norm2", None, ("img_mlp",), "merge_mlp", attention="img_attn", image_first=True)),
    no_downsample="HunyuanVideo here (ComfyUI's layout) rotates keys after projecting them and calls attention as a "
                  "plain function, so no seam takes the rotated keys before attention; use mode='merge'",
    module="comfy.",
    when=(("flipped_img_txt", True),),  # Flux's (flipped_img_txt=False): kinds_comfy.py
)


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
    _FLIPPED_DOUBLE,
    _hidream("HiDreamImageTransformerBlock", single=False),
    _hidream("HiDreamImageSingleTransformerBlock", single=True),
)
