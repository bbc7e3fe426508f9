"""What ToMe knows about each kind of transformer block and of denoiser, as data.

A new block kind is one entry of BLOCK_KINDS: which of its sub-layers see the image tokens (and so
merge around them), where their image output sits, and how its self-attention can take downsampled
keys and values. The runtime (runtime.py, sites.py) reads these entries and nothing else about the host's
block classes; what it knows of root models is in roots.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from .frameworks import class_names

def _rotates_inside(model: str) -> str:
    return (
        f"{model} rotates keys inside its attention processor after projecting them, so there is no seam between "
        f"projection and rotation where keys could be downsampled with their own positions; use mode='merge', "
        f"which merges image tokens with their rotary positions"
    )


_FLUX_DOWNSAMPLE = _rotates_inside("Flux")


@dataclass(frozen=True)
class Sublayer:
    """A sub-layer of a block whose input tokens `tokens` are the block's image tokens [B, N, C]
    (or, with tail=True, a sequence whose last N tokens are)."""

    name: str  # attribute of the block
    flag: str  # the ToMeArgs flag that merges around it
    tokens: Tuple[str, ...] = ("hidden_states", "x")  # input names (else its first positional input)
    outputs: Tuple[int, ...] = ()  # where image tokens sit in a tuple output (those present); (): the output itself
    rotary: Optional[str] = None  # input of per-token (cos, sin) rows that follow the tokens
    rotary_axis: int = 0  # the token axis of those rows (Flux: [S, D]; Wan: [1, S, 1, D])


@dataclass(frozen=True)
class Span:
    """Tokens merged from the output of one sub-layer to the output of another: for blocks that join
    text and image before their sub-layers (Flux's single blocks: norm -> (attn, proj_mlp) -> proj_out),
    the image (the last N tokens) of `start`'s output `start_output` merges, `end`'s output unmerges."""

    start: str
    start_output: Optional[int]  # index in a tuple output; None: the output itself
    end: str
    flag: str
    rotary_at: Optional[str] = None  # a sub-layer inside the span that takes per-token rotary rows
    rotary: str = "image_rotary_emb"


@dataclass(frozen=True)
class Downsample:
    """How one self-attention of a block takes keys and values from the downsampled grid.

    "context": its context argument (`encoder_hidden_states` / `context`) gets the downsampled tokens,
      so the host's processor projects keys and values from them (the attention is otherwise self-attention);
    "projections": pre-hooks on its `to_k` / `to_v` give them the downsampled tokens, for attentions
      whose context argument carries text (SD3's joint attention): image keys shrink, text keys stay.
    """

    attention: str
    via: str


@dataclass(frozen=True)
class BlockKind:
    class_name: str
    sublayers: Tuple[Sublayer, ...]
    downsample: Tuple[Downsample, ...]
    tokens: Tuple[str, ...] = ("hidden_states", "x")  # the block's image-token input (the last N tokens of it)
    spans: Tuple[Span, ...] = ()
    # Why mode="downsample" is refused on this kind, when it is.
    no_downsample: str = ""

    @property
    def self_attention(self) -> str:
        """The sub-layer whose keys are the image tokens (the first one listed, or a span's attention)."""
        return self.sublayers[0].name if self.sublayers else self.spans[0].rotary_at


BLOCK_KINDS: Dict[str, BlockKind] = {
    kind.class_name: kind
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
            sublayers=(Sublayer("attn", "merge_attn", tokens=("hidden_states",), outputs=(0,)),
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
                                rotary="image_rotary_emb"),
                       Sublayer("ff", "merge_mlp")),
            downsample=(),
            no_downsample=_FLUX_DOWNSAMPLE,
        ),
        # Flux single-stream blocks join [text, image] inside; norm's output merges (image part), the
        # attention and the MLP run on the merged sequence, proj_out's output unmerges.
        BlockKind(
            "FluxSingleTransformerBlock",
            sublayers=(),
            downsample=(),
            spans=(Span("norm", 0, "proj_out", "merge_attn", rotary_at="attn"),),
            no_downsample=_FLUX_DOWNSAMPLE,
        ),
        # Wan 2.1 / 2.2: self-attention over every frame's image tokens, its rotary rows [1, S, 1, D] (frame,
        # row and column positions) applied inside the processor; cross-attention to the text (and, for
        # image-to-video, the image embedding); the feed-forward. The block calls them positionally.
        BlockKind(
            "WanTransformerBlock",
            sublayers=(Sublayer("attn1", "merge_attn", tokens=("hidden_states",), rotary="rotary_emb", rotary_axis=1),
                       Sublayer("attn2", "merge_crossattn", tokens=("hidden_states",)),
                       Sublayer("ffn", "merge_mlp")),
            downsample=(),
            no_downsample=_rotates_inside("Wan"),
        ),
        # CogVideoX: `attn1` is joint attention over [text, image] given the image as `hidden_states` and the
        # text as `encoder_hidden_states`, returning (image, text); CogVideoX 1.5 / 5B rotate the image
        # queries and keys by rows [image, D]. The feed-forward sees [text, image] joined (its last N tokens
        # merge).
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
    )
}


def block_kind(module: Any) -> Optional[BlockKind]:
    for name in class_names(module):
        kind = BLOCK_KINDS.get(name)
        if kind is not None:
            return kind
    return None


KNOWN_BLOCKS = ", ".join(BLOCK_KINDS)


# Modules whose transformer blocks attend over frames, not over a frame's grid: AnimateDiff's motion
# modules, the temporal attentions of UNet3DConditionModel and I2VGenXLUNet (and their `transformer_in`).
# Their blocks are BasicTransformerBlocks like the spatial ones, so they are told apart by where they sit,
# never by class; ToMe leaves them untouched. (SVD's temporal blocks are a class of their own.)
TEMPORAL_CONTAINERS = ("TransformerTemporalModel", "AnimateDiffTransformer3D")


def in_temporal_container(module: Any) -> bool:
    return any(name in TEMPORAL_CONTAINERS for name in class_names(module))
