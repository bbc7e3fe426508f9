"""Block kinds of model code written as its authors wrote it, rather than as diffusers re-wrote it: ComfyUI's
(and Forge's, InvokeAI's: Black Forest Labs' Flux layout), Stability's MMDiT, Wan's own. Their attention is often a
function over fused projections, so they merge by spans (kind_types.Span) more than by sub-layers."""
from __future__ import annotations

from typing import Tuple

from .kind_types import BlockKind, Span, Sublayer
from .kinds_comfy_cosmos import COMFY_COSMOS_KINDS
from .kinds_comfy_nextdit import COMFY_NEXTDIT_KINDS
from .kinds_comfy_image_first import COMFY_IMAGE_FIRST_KINDS


def _rotates_inside(model: str) -> str:
    return (
        f"{model} here (ComfyUI's layout) rotates keys after projecting them and calls attention as a plain "
        f"function, so no seam takes the rotated keys before attention; use mode='merge', which merges image "
        f"tokens with their rotary positions (diffusers' {model} takes mode='downsample' at its attention dispatch)"
    )


# HunyuanVideo's and HiDream's (kinds_comfy_image_first.py) first: a class with several kinds takes the first that
# fits (BlockKind.when), and HunyuanVideo's DoubleStreamBlock is Flux's class built flipped.
COMFY_KINDS: Tuple[BlockKind, ...] = COMFY_IMAGE_FIRST_KINDS + (
    # Black Forest Labs' layout (ComfyUI, Forge, InvokeAI): Flux's blocks build q, k, v themselves and call
    # attention as a function, with the rotary rows `pe` [B, 1, text + image, ...] as the block's own input.
    # The image stream merges after its norm (the modulation after it is per sample), the attention's output
    # projection and the MLP unmerge; `pe` follows the merged tokens as the block is entered.
    BlockKind(
        "DoubleStreamBlock",
        sublayers=(),
        downsample=(),
        tokens=("img",),
        spans=(Span("img_norm1", None, ("img_attn.proj",), "merge_attn", attention="img_attn", rotary_at="",
                    rotary="pe", rotary_axis=2),
               Span("img_norm2", None, ("img_mlp",), "merge_mlp", attention="img_attn")),
        no_downsample=_rotates_inside("Flux"),
    ),
    # Its single blocks see [text, image] joined: the image part of pre_norm's output merges, linear1 (q, k,
    # v and the MLP's input) and attention run on the merged sequence, linear2's output unmerges.
    BlockKind(
        "SingleStreamBlock",
        sublayers=(),
        downsample=(),
        spans=(Span("pre_norm", None, ("linear2",), "merge_attn", attention="linear1", rotary_at="",
                    rotary="pe", rotary_axis=2),),
        no_downsample=_rotates_inside("Flux"),
    ),
    # SD3's MMDiT in ComfyUI (and Stability's reference code): a JointBlock(context, x) pairs a text and an
    # image DismantledBlock whose q, k, v come from one fused `qkv` and meet in a function. The image's
    # norm1 output merges (SD3.5's second self-attention `attn2` takes it too), both attentions' `proj` and
    # the MLP unmerge. The text block is never hooked.
    BlockKind(
        "JointBlock",
        sublayers=(),
        downsample=(),
        tokens=("x",),
        token_position=1,
        spans=(Span("x_block.norm1", None, ("x_block.attn.proj", "x_block.attn2.proj"), "merge_attn",
                    attention="x_block.attn"),
               Span("x_block.norm2", None, ("x_block.mlp",), "merge_mlp", attention="x_block.attn")),
        no_downsample=(
            "SD3's MMDiT (ComfyUI) projects queries, keys and values with one fused layer (qkv), so keys and "
            "values cannot take other tokens than queries; use mode='merge'"),
    ),
    # Wan in ComfyUI (and Wan's own code): as diffusers' Wan block, its rotary rows `freqs` [B, image, 1, ...]
    # passed to the self-attention by position.
    BlockKind(
        "WanAttentionBlock",
        sublayers=(Sublayer("self_attn", "merge_attn", tokens=("x",), rotary="freqs", rotary_axis=1),
                   Sublayer("cross_attn", "merge_crossattn", tokens=("x",)),
                   Sublayer("ffn", "merge_mlp")),
        downsample=(),
        tokens=("x",),
        no_downsample=_rotates_inside("Wan"),
    ),
    # Qwen-Image in ComfyUI: a double-stream block whose image stream is its own input (hidden_states). Its `attn`
    # projects the image and the text apart, joins them as [text, image], rotates both by the rows
    # `image_rotary_emb` [B, 1, text + image, ...] (text rows first, as Flux's `pe`) and splits the output at the
    # text's length, returning (image, text): the image merges around it, its rows follow. `img_mlp` sees the
    # image alone; the text's modules are never hooked.
    BlockKind(
        "QwenImageTransformerBlock",
        sublayers=(Sublayer("attn", "merge_attn", tokens=("hidden_states",), outputs=(0,),
                            rotary="image_rotary_emb", rotary_axis=2),
                   Sublayer("img_mlp", "merge_mlp", tokens=("hidden_states",))),
        downsample=(),
        no_downsample=(
            "Qwen-Image here (ComfyUI's layout) rotates the joined text and image keys inside its attention module "
            "and calls attention as a plain function, so no seam takes the rotated image keys alone; use "
            "mode='merge'"),
        module="comfy.",  # diffusers' class of this name takes rows (image, text) [S, D]: kinds_video.py
    ),
) + COMFY_NEXTDIT_KINDS + COMFY_COSMOS_KINDS  # ComfyUI's NextDiT (Lumina 2, Z-Image), LTX-Video, Cosmos Predict2
