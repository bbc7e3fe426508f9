"""The entries a family module declares (tomesd/families/): its block kinds (which sub-layers of a transformer block
see the image tokens, the spans between sub-layers, how its self-attention takes downsampled keys and values, what it
refuses) and its root kinds (which token layout a denoiser's blocks see, where its frames are, which input gives the
grid, or why it is refused). The runtime reads these entries and nothing else about a host's classes."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple


@dataclass(frozen=True)
class Sublayer:
    """A sub-layer of a block whose input tokens `tokens` are the block's image tokens [B, N, C]
    (or, with tail=True, a sequence whose last N tokens are)."""

    name: str  # attribute of the block
    flag: str  # the ToMeArgs flag that merges around it
    tokens: Tuple[str, ...] = ("hidden_states", "x")  # input names (else its first positional input)
    outputs: Tuple[int, ...] = ()  # where image tokens sit in a tuple output (those present); (): the output itself
    rotary: Optional[str] = None  # input of per-token (cos, sin) rows that follow the tokens
    # The token axis of those rows (Flux: [S, D]; Wan: [1, S, 1, D]); negative: from the last axis, for rows whose
    # leading axes vary with the host's config (LTX-2: [B, S, D] or, split, [B, heads, S, D/2]: -2, a batch axis).
    rotary_axis: int = 0
    # Rows given as a tuple of tables of which only this item is the image's (diffusers' Qwen-Image: (image rows,
    # text rows)): it follows the merged tokens, the others stay. None: every table of the input is per token.
    rotary_item: Optional[int] = None
    rotates: str = ""  # how its processor applies rows with no batch axis, where the dispatch can do it (ROTATIONS)
    # Its diffusers processor skips the rotation when given no rows (Flux's, Flux.2's): rows rotating at the dispatch
    # give it None rather than identity rows, which it would apply to every query and key for nothing.
    rows_optional: bool = False
    # Where its attention's keys hold the merged image keys: at the end of the key sequence (alone, or after text:
    # Flux's [text, image]), or at its start (True: SD3's [image, text]). Read for proportional attention, and for
    # rotary rows over image and text (True: HiDream's [image, text] rows, the image's first).
    image_keys_first: bool = False
    # Its tokens are [image, text] joined with the image first (HiDream's single blocks): the first N merge, the rest
    # pass whole.
    image_first: bool = False
    # Other inputs given the same tokens, which merge alike (Lumina 2's attention takes them as its context too).
    also: Tuple[str, ...] = ()


@dataclass(frozen=True)
class Span:
    """Tokens merged from the output of one sub-layer to the outputs of others: for blocks whose sub-layers
    are not called on the image tokens alone, or whose attention is a function rather than a module. The
    image (the last N tokens) of `start`'s output `start_output` merges, each of `ends`' outputs unmerges.
    Flux's single blocks (diffusers): norm -> (attn, proj_mlp) -> proj_out. Sub-layers are attribute paths
    ("x_block.attn.proj"). Between them the host may only apply per-sample affine maps to the tokens (the
    modulation of DiT blocks), which commute with averaging tokens."""

    start: str
    start_output: Optional[int]  # index in a tuple output; None: the output itself
    ends: Tuple[str, ...]
    flag: str
    attention: str  # the attention inside (a module, or the block itself where attention is a function)
    rotary_at: Optional[str] = None  # what takes per-token rotary rows inside the span ("": the block itself)
    rotary: str = "image_rotary_emb"
    rotary_axis: int = 0  # the token axis of those rows
    rotates: str = ""  # as Sublayer.rotates
    rows_optional: bool = False  # as Sublayer.rows_optional
    # The module whose own forward calls the attention (proportional attention weighs its keys there); None: the
    # attention is a function called between the span's start and its first end (Black Forest Labs' layout).
    attention_call: Optional[str] = None
    # The image is the first N tokens of the span's sequence, the text after it (HunyuanVideo's single blocks join
    # [image, text]); False: the last N, any text in front (Flux's [text, image]).
    image_first: bool = False
    # A function the block calls by its module-level name, "module:name", whose output's image (its first tokens)
    # unmerges instead of the ends' outputs (backends/torch_function_seam.py): ComfyUI's HunyuanVideo double blocks
    # split their attention's output at the block input's image length, so the image must be whole before the split.
    unmerge_at: str = ""


# Rotary rows with a batch axis (rotary_axis > 0: Wan's [1, S, 1, D], ComfyUI's [B, 1, S, ...]) follow a matching
# per sample as they are. Rows with none ([S, D], Flux in diffusers) cannot; where the processor hands its rotated
# queries and keys to diffusers' attention dispatch, the processor gets identity rows and each sample's rows are
# applied at the dispatch instead (backends/torch_dispatch.py), in the host's own arithmetic. The ways known:
# "cos_sin": diffusers' apply_rotary_emb with real (cos, sin) rows, interleaved pairs, on [B, S, heads, dim].
ROTATIONS = ("cos_sin",)


# The axes of a self-attention's mask that follow the merged tokens, by BlockKind.mask (none: a mask is refused).
MASK_AXES = {"tokens": (-1,), "pairs": (-2, -1)}
# The BlockKind.mask values whose merge site sees the mask: refused ("") or followed; "text" and "image_ones_first"
# masks fit the merged tokens as they come or are sliced by their own site (key_masks.MaskSlice).
MASK_AXES_OR_REFUSED = ("",) + tuple(MASK_AXES)
# The BlockKind.mask values of masks over a joined [image, text] / [text, image] whose image part is all True,
# sliced to the merged image (key_masks.MaskSlice): whether the image leads, and how many trailing axes are keys
# (1) or (query, key) pairs (2: Chroma's blocks square its key-padding mask into [B, 1, S, S] themselves).
SLICED_MASKS = {"image_ones_first": (True, 1), "image_ones_last": (False, 1), "pairs_image_ones_last": (False, 2)}


@dataclass(frozen=True)
class Downsample:
    """How one self-attention of a block takes keys and values from the downsampled grid.

    "context": its context argument (`encoder_hidden_states` / `context`) gets the downsampled tokens,
      so the host's processor projects keys and values from them (the attention is otherwise self-attention);
    "projections": pre-hooks on its `to_k` / `to_v` give them the downsampled tokens, for attentions
      whose context argument carries text (SD3's joint attention): image keys shrink, text keys stay.
    "dispatch": the processor's call of diffusers' attention dispatch gets the rotated keys and values with
      their image rows (the last N) downsampled (backends/torch_dispatch.py), for processors that rotate keys
      after projecting them (Flux, Wan): text keys stay whole, queries stay full.
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
    token_position: Optional[int] = None  # where the image tokens arrive when forward takes *args only
    # Why mode="downsample" is refused on this kind, when it is.
    no_downsample: str = ""
    # Why proportional_attention is refused on this kind, when it is (an attention with no softmax scores).
    no_weights: str = ""
    # What its self-attention's attention_mask addresses. "": every token (merging is refused while one is given);
    # "text": the text only, the processor padding it with True to the query's length itself (HunyuanVideo 1.5),
    # so merged image tokens leave it as it is; "image_ones_first": a key-padding mask [B, 1, 1, image + text] over
    # the joined [image, text] keys whose image part is all True (HunyuanVideo's, built by the root), so merging N
    # image tokens into M keeps its last M + text entries (a view; key_masks.MaskSlice), exactly; "image_ones_last":
    # the same over [text, image] keys, the image's last (Krea 2's [B, 1, 1, text + image]): its first text + M
    # entries are kept; "pairs_image_ones_last": a mask [B, 1, S, S] over the (query, key) pairs of [text, image],
    # the outer product of a key-padding mask whose image part is all True (Chroma's blocks build it), so its image
    # rows are alike and its image columns alike: its first text + M rows and columns are kept; "tokens": a
    # key-padding mask [B, S] over every token of a unified sequence (layouts/unified.py), whose merged rows keep
    # their representative's entry; "pairs": a mask [B, 1, S, S] over every (query, key) pair whose image rows are
    # alike and image columns alike (OmniGen's), both axes so.
    mask: str = ""
    # Where the block's class is defined (a module prefix; "": anywhere): ComfyUI's QwenImageTransformerBlock shares
    # diffusers' name and takes other rotary rows.
    module: str = ""
    # Attributes the block must hold with these values for this kind to be its, (name, value) pairs: ComfyUI's
    # DoubleStreamBlock built with flipped_img_txt=True (HunyuanVideo's) puts the image first, Flux's the text.
    when: Tuple[Tuple[str, Any], ...] = ()

    def fits(self, module: Any) -> bool:
        return all(getattr(module, name, None) == value for name, value in self.when)

    @property
    def self_attention(self) -> str:
        """The sub-layer whose keys are the image tokens (the first one listed, or a span's attention)."""
        return self.sublayers[0].name if self.sublayers else self.spans[0].attention


def sublayer(block: Any, path: str) -> Any:
    """The sub-layer at an attribute path of a block ("" is the block itself), or None."""
    for name in path.split(".") if path else ():
        block = getattr(block, name, None)
        if block is None:
            return None
    return block


@dataclass(frozen=True)
class UnifiedSequence:
    """Where the image sits in a unified sequence (layout "unified", layouts/unified.py), by block container."""

    # "list": the latent is a list of per-sample [C, F, H, W] patchified by the forward's patch_size and
    # f_patch_size arguments (Z-Image); "latent": [B, C, H, W] patchified by the config's patch_size (Lumina 2).
    latent: str
    # Where the image sits in the input of the blocks of each container: "first" (at every sample's start, the
    # tokens after it pass whole), "after_text" (after each sample's text, of the text mask's sum), "before_pad"
    # (ComfyUI's NextDiT: before the pad tokens that end the sequence), "" (not there: a text refiner's blocks never
    # merge).
    sections: Dict[str, str] = field(default_factory=dict)
    text_mask: str = ""  # the root's input whose sum per sample is the text's length ("after_text")


@dataclass(frozen=True)
class RootKind:
    family: str  # what users call it
    classes: Tuple[str, ...]  # class names in the root's ancestry
    # A layout strategy's name: "levels" | "patches" | "patchgrid" | "ids" | "spacetime" | "packed" | "unified"
    # (tomesd/layouts/), or one a family module adds (its LAYOUTS)
    layout: str
    suffix: bool = False  # also match classes whose names end with one of `classes`
    video: bool = False  # "levels": a 5-D latent whose frames ride in the spatial blocks' batch
    frame_axis: Optional[int] = None  # "spacetime": the latent's frame axis
    ids: Optional[str] = None  # "ids": the input with each image token's (0, row, col)
    # "packed": the root forward's arguments that give a packed latent's token grid, plain ints or lists (never
    # tensors): three, (frames, rows, cols); or one, a list per sample of (frames, rows, cols) per image, the
    # target's first (any after it are reference images, which pass whole).
    grid_args: Tuple[str, ...] = ()
    # Pipelines that join reference-image tokens after the target's in one sequence, the target's latents
    # returned first by their prepare_latents (hosts/references.py): ToMe merges the target's only.
    joined_references: Tuple[str, ...] = ()
    # Where the root's class is defined (a module prefix; "": anywhere): ComfyUI's own classes may share a name with
    # diffusers' (QwenImageTransformer2DModel) and take another latent.
    module: str = ""
    # Attribute paths of the root's modules whose blocks see no image tokens though their class is an image block's
    # (Flux.3's text-mode and reference-mode blocks): ToMe leaves every block inside them alone.
    skip_blocks: Tuple[str, ...] = ()
    sequence: Optional[UnifiedSequence] = None  # "unified": where each container's blocks see the image
    supported: str = ""  # how the supported-model list names it ("": not listed)
    refused: str = ""  # why ToMe cannot patch it ("": it can)

    def matches(self, names: set, modules: set = frozenset()) -> bool:
        if self.module and not any(m.startswith(self.module) for m in modules):
            return False
        return any(n in self.classes or (self.suffix and n.endswith(self.classes)) for n in names)


# The wording of a family refused by name because its layout is one the runtime lacks (docs/limits.md).
NOT_YET = "a layout ToMe does not merge yet"
RUN_WITHOUT = "run it without ToMe"


def comfy_rotates_inside(model: str) -> str:
    """Why mode='downsample' is refused on a block in Black Forest Labs' layout (ComfyUI's Flux, Wan)."""
    return (
        f"{model} here (ComfyUI's layout) rotates keys after projecting them and calls attention as a plain "
        f"function, so no seam takes the rotated keys before attention; use mode='merge', which merges image "
        f"tokens with their rotary positions (diffusers' {model} takes mode='downsample' at its attention dispatch)"
    )
