"""What ToMe knows about each kind of transformer block and of denoiser, as data.

A new block kind is one entry of BLOCK_KINDS: which of its sub-layers see the image tokens (and so merge around
them), where their image output sits, and how its self-attention can take downsampled keys and values. The runtime
(runtime.py, sites.py) reads these entries and nothing else about the host's block classes; what it knows of root
models is in roots.py.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from .frameworks import class_names
from .kind_types import ROTATIONS, BlockKind, Downsample, Span, Sublayer
from .kinds_comfy import COMFY_KINDS
from .kinds_image_first import IMAGE_FIRST_KINDS
from .kinds_unified import UNIFIED_KINDS
from .kinds_diffusers_0_42 import DIFFUSERS_0_42_KINDS
from .kinds_video import VIDEO_KINDS

__all__ = ["BLOCK_KINDS", "KNOWN_BLOCKS", "ROTATIONS", "BlockKind", "Downsample", "Span", "Sublayer", "block_kind",
           "in_temporal_container", "sublayer"]


def _flux_double(name: str, mask: str = "") -> BlockKind:
    """A Flux-derived double-stream block: its `attn` joint attention over [text, image], given the image as
    hidden_states and the per-token rows [text + image, D], returns (image, text); its processor rotates with
    diffusers' apply_rotary_emb and calls the dispatch (so mode='downsample' and per-sample rows work there)."""
    return BlockKind(
        name,
        sublayers=(Sublayer("attn", "merge_attn", tokens=("hidden_states",), outputs=(0,), rotary="image_rotary_emb",
                            rotates="cos_sin"),
                   Sublayer("ff", "merge_mlp")),
        downsample=(Downsample("attn", "dispatch"),), mask=mask,
    )


def _flux_single(name: str, mask: str = "") -> BlockKind:
    """A Flux-derived single-stream block over [text, image] joined: norm -> (attn, proj_mlp) -> proj_out, as
    FluxSingleTransformerBlock (the MLP's gate and activation in between act on each token alone)."""
    return BlockKind(
        name,
        sublayers=(),
        downsample=(Downsample("attn", "dispatch"),),
        spans=(Span("norm", 0, ("proj_out",), "merge_attn", attention="attn", rotary_at="attn", rotates="cos_sin",
                    attention_call="attn"),), mask=mask,
    )


# Keyed by class name, or "name (module...)" for a kind kept to a module (kind_types.BlockKind.module).
BLOCK_KINDS: Dict[str, BlockKind] = {
    kind.class_name + (f" ({kind.module}*)" if kind.module else ""): kind
    for kind in (
        # UNets (diffusers, ppdiffusers, LDM), PixArt and DiT.
        BlockKind(
            "BasicTransformerBlock",
            sublayers=(Sublayer("attn1", "merge_attn"), Sublayer("attn2", "merge_crossattn"), Sublayer("ff", "merge_mlp")),
            downsample=(Downsample("attn1", "context"),),
        ),
        # SD3 / SD3.5: `attn` is joint attention over [image, text], given the image as `hidden_states`
        # and the text as `encoder_hidden_states`; it returns (image, text). SD3.5's `attn2` is
        # image-only self-attention. Text tokens never pass through a hooked input.
        BlockKind(
            "JointTransformerBlock",
            sublayers=(Sublayer("attn", "merge_attn", tokens=("hidden_states",), outputs=(0,), image_keys_first=True),
                       Sublayer("attn2", "merge_attn", tokens=("hidden_states",)),
                       Sublayer("ff", "merge_mlp")),
            downsample=(Downsample("attn", "projections"), Downsample("attn2", "projections")),
        ),
        # SD3.5 ControlNets' image-only blocks (SD3ControlNetModel without joint_attention_dim): SD3's joint
        # processor with no text, so `attn` is plain self-attention returning the image alone.
        BlockKind(
            "SD3SingleTransformerBlock",
            sublayers=(Sublayer("attn", "merge_attn", tokens=("hidden_states",)), Sublayer("ff", "merge_mlp")),
            downsample=(Downsample("attn", "projections"),),
        ),
        # Flux double-stream blocks: as SD3's, and the rotary rows (cos, sin) [text + image, D] that the
        # processor applies to queries and keys follow the merged image tokens. Outputs (image, text) or,
        # with an IP-Adapter, (image, text, image-length IP output).
        BlockKind(
            "FluxTransformerBlock",
            sublayers=(Sublayer("attn", "merge_attn", tokens=("hidden_states",), outputs=(0, 2),
                                rotary="image_rotary_emb", rotates="cos_sin", rows_optional=True),
                       Sublayer("ff", "merge_mlp")),
            downsample=(Downsample("attn", "dispatch"),),
        ),
        # Flux single-stream blocks join [text, image] inside; norm's output merges (image part), the
        # attention and the MLP run on the merged sequence, proj_out's output unmerges.
        BlockKind(
            "FluxSingleTransformerBlock",
            sublayers=(),
            downsample=(Downsample("attn", "dispatch"),),
            spans=(Span("norm", 0, ("proj_out",), "merge_attn", attention="attn", rotary_at="attn", rotates="cos_sin",
                        attention_call="attn", rows_optional=True),),
        ),
        # Wan 2.1 / 2.2: self-attention over every frame's image tokens, its rotary rows [1, S, 1, D] (frame,
        # row and column positions) applied inside the processor; cross-attention to the text (and, for
        # image-to-video, the image embedding); the feed-forward. The block calls them positionally.
        BlockKind(
            "WanTransformerBlock",
            sublayers=(Sublayer("attn1", "merge_attn", tokens=("hidden_states",), rotary="rotary_emb", rotary_axis=1),
                       Sublayer("attn2", "merge_crossattn", tokens=("hidden_states",)),
                       Sublayer("ffn", "merge_mlp")),
            downsample=(Downsample("attn1", "dispatch"),),
        ),
        # CogVideoX: `attn1` is joint attention over [text, image] given the image as `hidden_states` and the
        # text as `encoder_hidden_states`, returning (image, text); CogVideoX 1.5 / 5B rotate the image
        # queries and keys by rows [image, D]. The feed-forward sees [text, image] joined (its last N tokens
        # merge).
        BlockKind(  # SkyReels-V2: Wan's block; its self-attention takes the mask and rotary rows by position
            "SkyReelsV2TransformerBlock",
            sublayers=(Sublayer("attn1", "merge_attn", tokens=("hidden_states",), rotary="rotary_emb", rotary_axis=1),
                       Sublayer("attn2", "merge_crossattn", tokens=("hidden_states",)),
                       Sublayer("ffn", "merge_mlp")),
            downsample=(Downsample("attn1", "dispatch"),),
        ),
        BlockKind(
            "CogVideoXBlock",
            sublayers=(Sublayer("attn1", "merge_attn", tokens=("hidden_states",), outputs=(0,),
                                rotary="image_rotary_emb"),
                       Sublayer("ff", "merge_mlp")),
            downsample=(),
            no_downsample=(
                "CogVideoX's attention processor joins text and image tokens before projecting keys and values "
                "(and rotates the image keys after), so no seam takes image keys alone; use mode='merge'"),
        ),
        # Chroma: Flux's blocks under other class names (its norms are pruned: modulation comes from the root).
        # ChromaPipeline's text mask, [text mask, ones for the image], is squared by each block into (query, key)
        # pairs [B, 1, S, S] for its attention: sliced there, both axes, to the first text + M (kind_types.py).
        BlockKind(
            "ChromaTransformerBlock",
            sublayers=(Sublayer("attn", "merge_attn", tokens=("hidden_states",), outputs=(0, 2),
                                rotary="image_rotary_emb", rotates="cos_sin"),
                       Sublayer("ff", "merge_mlp")),
            downsample=(Downsample("attn", "dispatch"),),
            mask="pairs_image_ones_last",
        ),
        BlockKind(
            "ChromaSingleTransformerBlock",
            sublayers=(),
            downsample=(Downsample("attn", "dispatch"),),
            spans=(Span("norm", 0, ("proj_out",), "merge_attn", attention="attn", rotary_at="attn", rotates="cos_sin",
                        attention_call="attn"),),
            mask="pairs_image_ones_last",
        ),
        # Bria, Bria FIBO, LongCat-Image, Ovis-Image (diffusers): Flux's blocks and processors under their own names.
        # Bria FIBO's single blocks get [text, image] joined by the root; its pipeline's text mask reaches every `attn`
        # as [B, 1, 1, text + image], ones over the image (sliced: "image_ones_last"); Ovis-Image's MLPs are gated.
        _flux_double("BriaTransformerBlock"), _flux_single("BriaSingleTransformerBlock"),
        _flux_double("BriaFiboTransformerBlock", "image_ones_last"),
        _flux_single("BriaFiboSingleTransformerBlock", "image_ones_last"),
        _flux_double("LongCatImageTransformerBlock"), _flux_single("LongCatImageSingleTransformerBlock"),
        _flux_double("OvisImageTransformerBlock"), _flux_single("OvisImageSingleTransformerBlock"),
        # Flux.2 double-stream blocks: as Flux's (joint attention over [text, image], rows [text + image, D]).
        BlockKind(
            "Flux2TransformerBlock",
            sublayers=(Sublayer("attn", "merge_attn", tokens=("hidden_states",), outputs=(0,),
                                rotary="image_rotary_emb", rotates="cos_sin", rows_optional=True),
                       Sublayer("ff", "merge_mlp")),
            downsample=(Downsample("attn", "dispatch"),),
        ),
        # Flux.2 single-stream blocks see [text, image] joined; a "parallel" block: one attention module projects
        # q, k, v and the MLP's input together and projects both out together, so norm's output merges (the
        # modulation after it is per sample) and the attention module's output unmerges, inside its forward chain:
        # a step cache on `attn` keeps full tokens as it is. (attention="": no cache seat inside the span, which
        # would unmerge that output a second time; attention_call names the module whose keys are weighed.)
        BlockKind(
            "Flux2SingleTransformerBlock",
            sublayers=(),
            downsample=(Downsample("attn", "dispatch"),),
            spans=(Span("norm", None, ("attn",), "merge_attn", attention="", rotary_at="attn", rotates="cos_sin",
                        attention_call="attn", rows_optional=True),),
        ),
        # CogView4: joint attention over [text, image] given the image as hidden_states, returning (image, text),
        # its image queries and keys rotated by rows [image, D] inside the processor (no dispatch). The block's
        # one feed-forward module runs on the image and then on the text, so it is not a merge site.
        BlockKind(
            "CogView4TransformerBlock",
            sublayers=(Sublayer("attn1", "merge_attn", tokens=("hidden_states",), outputs=(0,),
                                rotary="image_rotary_emb"),),
            downsample=(),
            no_downsample=(
                "CogView4's attention processor joins text and image tokens before projecting keys and values "
                "and calls torch's attention itself, so no seam takes image keys alone; use mode='merge'"),
        ),
        # GLM-Image: CogView4's block (rows [image, D] rotated inside the processor with the halves layout, which
        # the dispatch cannot redo per sample; the one feed-forward module runs on the image, then on the text,
        # so it is not a merge site), whose processor calls diffusers' dispatch: keys shrink there, after the
        # rotation, the image's rows last (after the text's, and after any condition images' cached keys).
        BlockKind(
            "GlmImageTransformerBlock",
            sublayers=(Sublayer("attn1", "merge_attn", tokens=("hidden_states",), outputs=(0,),
                                rotary="image_rotary_emb"),),
            downsample=(Downsample("attn1", "dispatch"),),
        ),
        # CogView3-Plus: CogVideoX's joint processor (no rotary rows) given the image as hidden_states, returning
        # (image, text); the feed-forward sees [text, image] joined (its last N tokens merge).
        BlockKind(
            "CogView3PlusTransformerBlock",
            sublayers=(Sublayer("attn1", "merge_attn", tokens=("hidden_states",), outputs=(0,)),
                       Sublayer("ff", "merge_mlp")),
            downsample=(),
            no_downsample=(
                "CogView3-Plus's attention processor (CogVideoX's) joins text and image tokens before projecting "
                "keys and values and calls torch's attention itself, so no seam takes image keys alone; use "
                "mode='merge'"),
        ),
        # Sana: linear self-attention over the image, cross-attention to the text; its feed-forward (GLUMBConv)
        # is a convolution over the (height, width) token grid, so it is not a merge site.
        BlockKind(
            "SanaTransformerBlock",
            sublayers=(Sublayer("attn1", "merge_attn"), Sublayer("attn2", "merge_crossattn")),
            downsample=(Downsample("attn1", "context"),),
            no_weights=("Sana's self-attention is linear attention (ReLU kernels, no softmax), so there are no scores "
                        "for a merged key's weight; apply_patch with proportional_attention=False"),
        ),
        # HunyuanDiT: self-attention and cross-attention over the image, both rotating its queries (the
        # self-attention its keys too) by rows [image, D]; the feed-forward. Skip connections join at the block's
        # input, whole.
        BlockKind(
            "HunyuanDiTBlock",
            sublayers=(Sublayer("attn1", "merge_attn", rotary="image_rotary_emb"),
                       Sublayer("attn2", "merge_crossattn", rotary="image_rotary_emb"),
                       Sublayer("ff", "merge_mlp")),
            downsample=(),
            no_downsample=(
                "HunyuanDiT's processor rotates keys after projecting them and calls torch's attention itself, so "
                "no seam takes the rotated keys; use mode='merge'"),
        ),
        # AuraFlow's MMDiT blocks: joint attention over [text, image] given the image as hidden_states, returning
        # (image, text); image keys and values come from to_k / to_v alone (text's from add_k_proj / add_v_proj).
        BlockKind(
            "AuraFlowJointTransformerBlock",
            sublayers=(Sublayer("attn", "merge_attn", tokens=("hidden_states",), outputs=(0,)),
                       Sublayer("ff", "merge_mlp")),
            downsample=(Downsample("attn", "projections"),),
        ),
        # AuraFlow's single blocks see [text, image] joined: attention and feed-forward merge its last N tokens.
        BlockKind(
            "AuraFlowSingleTransformerBlock",
            sublayers=(Sublayer("attn", "merge_attn", tokens=("hidden_states",)), Sublayer("ff", "merge_mlp")),
            downsample=(),
            no_downsample=(
                "AuraFlow's single blocks project keys and values of [text, image] joined with one to_k / to_v and "
                "call torch's attention itself, so no seam takes image keys alone; use mode='merge'"),
        ),
        # PRX: the block's attention takes the image's queries and [text, image] keys (text by its own projection),
        # rotates the image's by rows [B, 1, image, D/2, 2, 2], and builds its mask as [text mask, ones(image)] from
        # the queries it is given: the mask is the text's, so it fits merged image tokens. Its MLP is inline.
        BlockKind(
            "PRXBlock",
            sublayers=(Sublayer("attention", "merge_attn", tokens=("hidden_states",), rotary="image_rotary_emb",
                                rotary_axis=2),),
            downsample=(),
            no_downsample="PRX's processor projects the image's keys and values together with its queries "
                          "(img_qkv_proj), so no seam takes image keys alone; use mode='merge'",
            mask="text",
        ),
    ) + VIDEO_KINDS + COMFY_KINDS + IMAGE_FIRST_KINDS + UNIFIED_KINDS + DIFFUSERS_0_42_KINDS
}


def sublayer(block: Any, path: str) -> Any:
    """The sub-layer at an attribute path of a block ("" is the block itself), or None."""
    for name in path.split(".") if path else ():
        block = getattr(block, name, None)
        if block is None:
            return None
    return block


def block_kind(module: Any) -> Optional[BlockKind]:
    for cls in type(module).__mro__:
        for kind in _BY_CLASS.get(cls.__name__, ()):
            if cls.__module__.startswith(kind.module) and kind.fits(module):
                return kind
    return None


def foreign_to_unets(blocks: Any) -> List[str]:
    """The kinds among `blocks` that a UNet does not have (a UNet's are BasicTransformerBlocks): under a root in no
    family of roots.py, read as a UNet, blocks of these kinds would merge tokens by the wrong rule."""
    return sorted({block_kind(block).class_name for block in blocks} - {"BasicTransformerBlock"})


_BY_CLASS: Dict[str, Tuple[BlockKind, ...]] = {}
for _kind in BLOCK_KINDS.values():  # of kinds sharing a class name, one kept to a module is tried first
    _BY_CLASS[_kind.class_name] = tuple(sorted(_BY_CLASS.get(_kind.class_name, ()) + (_kind,), key=lambda k: -len(k.module)))

KNOWN_BLOCKS = ", ".join(_BY_CLASS)


# Modules whose transformer blocks attend over frames, not over a frame's grid: AnimateDiff's motion
# modules, the temporal attentions of UNet3DConditionModel and I2VGenXLUNet (and their `transformer_in`).
# Their blocks are BasicTransformerBlocks like the spatial ones, so they are told apart by where they sit,
# never by class; ToMe leaves them untouched. (SVD's temporal blocks are a class of their own.)
TEMPORAL_CONTAINERS = ("TransformerTemporalModel", "AnimateDiffTransformer3D")


def in_temporal_container(module: Any) -> bool:
    return any(name in TEMPORAL_CONTAINERS for name in class_names(module))
