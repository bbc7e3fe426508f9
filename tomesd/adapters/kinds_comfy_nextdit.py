"""Block kinds of ComfyUI's NextDiT (Lumina 2 and Z-Image: comfy.ldm.lumina.model) and LTX-Video
(comfy.ldm.lightricks.model). Both share a class name with another library's block (diffusers' SD3
`JointTransformerBlock`; the UNets' `BasicTransformerBlock`), so each is kept to its module (BlockKind.module).
Which NextDiT blocks see the image, and where, is the layout's (layouts_comfy_nextdit.py); its text-only
context refiner is left out by its root kind (RootKind.skip_blocks)."""
from __future__ import annotations

from typing import Tuple

from .kind_types import BlockKind, Sublayer

NEXTDIT_MODULE = "comfy.ldm.lumina."
LTXV_MODULE = "comfy.ldm.lightricks."

COMFY_NEXTDIT_KINDS: Tuple[BlockKind, ...] = (
    # NextDiT's JointTransformerBlock(x, x_mask, freqs_cis, adaln_input): its attention takes the normed, per-sample
    # modulated tokens, the mask and the rotary rows [B, S, 1, D/2, 2, 2] (a batch axis: they follow each sample)
    # by position, projects q, k, v with one fused `qkv` and rotates them inside; the feed-forward sees every token.
    # In the main layers and the noise refiner the mask `x_mask` is None (ComfyUI 0.3.75 masks the context refiner
    # only, which is left out).
    BlockKind(
        "JointTransformerBlock",
        sublayers=(Sublayer("attention", "merge_attn", tokens=("x",), rotary="freqs_cis", rotary_axis=1),
                   Sublayer("feed_forward", "merge_mlp", tokens=("x",))),
        downsample=(),
        tokens=("x",),
        no_downsample=(
            "NextDiT here (ComfyUI's Lumina 2 / Z-Image) projects queries, keys and values with one fused layer (qkv) "
            "and rotates them inside its attention, so no seam takes the image's keys alone; use mode='merge'"),
        module=NEXTDIT_MODULE,
    ),
    # LTX-Video's BasicTransformerBlock(x, context, attention_mask, timestep, pe): self-attention `attn1` given the
    # modulated tokens and the rotary rows `pe` [B, 1, N, D/2, 2, 2] by keyword (they follow each sample's merged
    # tokens), the text cross-attention `attn2` (its mask addresses the text keys only) and `ff`. Its modulation,
    # per sample or per token (a timestep per token: image-to-video), is applied outside these sub-layers. Unlike
    # the UNets' block of this name, attn1's keys are rotated by rows for every token inside it: no ToDo.
    BlockKind(
        "BasicTransformerBlock",
        sublayers=(Sublayer("attn1", "merge_attn", tokens=("x",), rotary="pe", rotary_axis=2),
                   Sublayer("attn2", "merge_crossattn", tokens=("x",)),
                   Sublayer("ff", "merge_mlp", tokens=("x",))),
        downsample=(),
        tokens=("x",),
        no_downsample=(
            "LTX-Video here (ComfyUI's LTXVModel) rotates self-attention's keys by rows for every token inside its "
            "attention module, so keys from a downsampled grid would not meet their rows; use mode='merge'"),
        module=LTXV_MODULE,
    ),
)
