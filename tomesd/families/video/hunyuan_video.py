"""HunyuanVideo (text-to-video; its token_replace image-to-video model; Framepack), HunyuanVideo 1.5 and Motif-Video
(HunyuanVideo's blocks under its own names), on diffusers; and ComfyUI's HunyuanVideo class, which runs HunyuanVideo,
its image-to-video models, HunyuanVideo 1.5 and HunyuanImage 2.1.

diffusers' HunyuanVideo joins [image, text] with the image first under the root's mask over both (BlockKind.mask
"image_ones_first"): double-stream blocks (image and text enter apart; the joint attention returns (image, text)) and
single-stream blocks joining [image, text] inside their forward (a Span with image_first). Layouts: "hunyuan_video"
(Wan's grid; the token_replace model's first frame, the condition image, passes whole), "framepack" (the history's
tokens before the target's pass whole), "motif_video" (HunyuanVideo's grid; single blocks with a text cross-attention
refused), and ComfyUI's "comfy_hunyuan_video" (the image first in each block's input, what follows passing whole).

"comfy_hunyuan_video": ComfyUI's HunyuanVideo class (comfy.ldm.hunyuan_video.model.HunyuanVideo), which runs
HunyuanVideo, its image-to-video models, HunyuanVideo 1.5 and HunyuanImage 2.1: a latent [B, C, F, H, W] on Wan's
space-time grid (patch_size a list of 3), or [B, C, H, W] patchified by a list of 2 (HunyuanImage 2.1). Its double
blocks take the image alone, its single blocks [image, text] joined by the root: the image is each block input's first
N tokens and whatever follows passes whole (call.tail, set per block). Refused at the call: guiding_frame_index
(HunyuanVideo-I2V's token_replace model, whose first frame is modulated apart by token position) and ref_latent (a
reference latent's tokens joined before the image's)."""
from __future__ import annotations

from typing import Any, Tuple

from ...layouts.coordinates import SpaceTime
from ...layouts.entries import BlockKind, RootKind, Span, Sublayer
from ...layouts.grids import Layout, Levels, config_value, spacetime_patch
from ...layouts.image_first import HeadGrid, PatchAxes, image_count
from ...layouts.sequences import split_sequence
from ...layouts.signatures import InputSpec


# Their processors (HunyuanVideoAttnProcessor2_0, HunyuanImageAttnProcessor) rotate the image's queries and keys by
# rows (cos, sin) [image, D] with diffusers' apply_rotary_emb and hand [image, text] to diffusers' dispatch with the
# root's mask: per-sample rows are applied there to the first tokens (rotation_at_dispatch's image_first).
_NO_DOWNSAMPLE = ("its processor hands the attention the root's mask over every key [image, text], and its single "
                  "blocks project keys with the queries from [image, text] joined, so no seam shrinks the image's keys "
                  "alone under that mask; use mode='merge'")
_NO_WEIGHTS = ("its processor gives the attention the root's key-padding mask, which the weighing of merged keys "
               "cannot join; use proportional_attention=False")


def double_stream(name: str) -> BlockKind:
    """A double-stream block: `attn` takes the image as hidden_states and the text as encoder_hidden_states, returns
    (image, text); `ff` sees the image alone (the text has its own ff_context, never hooked)."""
    return BlockKind(
        name,
        sublayers=(Sublayer("attn", "merge_attn", tokens=("hidden_states",), outputs=(0,), rotary="image_rotary_emb",
                            rotates="cos_sin", image_keys_first=True),
                   Sublayer("ff", "merge_mlp", tokens=("hidden_states",))),
        downsample=(), no_downsample=_NO_DOWNSAMPLE, no_weights=_NO_WEIGHTS, mask="image_ones_first",
    )


def single_stream(name: str) -> BlockKind:
    """A single-stream block given the image and the text apart, joining [image, text] inside: norm's output merges
    (its first N tokens; the modulation after it is per sample), proj_mlp and the attention run on the merged
    sequence (its processor rotates query[:, :-text]), proj_out's output unmerges before the residual."""
    return BlockKind(
        name,
        sublayers=(),
        downsample=(), no_downsample=_NO_DOWNSAMPLE, no_weights=_NO_WEIGHTS, mask="image_ones_first",
        spans=(Span("norm", 0, ("proj_out",), "merge_attn", attention="attn", rotary_at="attn", rotates="cos_sin",
                    attention_call="attn", image_first=True),),
    )


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
    when=(("flipped_img_txt", True),),  # Flux's (flipped_img_txt=False): image/flux.py
)


BLOCK_KINDS: Tuple[BlockKind, ...] = (
    double_stream("HunyuanVideoTransformerBlock"), single_stream("HunyuanVideoSingleTransformerBlock"),
    # HunyuanVideo-I2V's (image_condition_type="token_replace"): the same sub-layers; the block modulates the first
    # frame's tokens (the condition image) apart by num_tokens on every token, around the sites, and the layout passes
    # that frame whole (HeadGrid: layouts/image_first.py), so each split by num_tokens meets full-length tokens.
    double_stream("HunyuanVideoTokenReplaceTransformerBlock"),
    single_stream("HunyuanVideoTokenReplaceSingleTransformerBlock"),
    # Motif-Video's: HunyuanVideo's blocks under its own names (the same sub-layers, processor and root mask), with
    # an optional text cross-attention after the joint one. The double block's takes the joint attention's output,
    # unmerged, whole; the single block's would take it merged (refused at apply time: MotifGrid).
    double_stream("MotifVideoTransformerBlock"), single_stream("MotifVideoSingleTransformerBlock"),
    # HunyuanVideo 1.5 (diffusers): image and text enter the block apart; the joint attention rotates the image's
    # queries and keys by rows (cos, sin) [image, D], then joins [image, text] for the dispatch. Its mask is the
    # text's only, padded with True to the joined length inside the processor, so it fits merged image tokens.
    BlockKind(
        "HunyuanVideo15TransformerBlock",
        sublayers=(Sublayer("attn", "merge_attn", tokens=("hidden_states",), outputs=(0,), rotary="image_rotary_emb",
                            rotates="cos_sin", image_keys_first=True),
                   Sublayer("ff", "merge_mlp")),
        downsample=(),
        no_downsample="its processor pads the text's mask to the queries' length, so keys shorter than the queries "
                      "would not fit it; use mode='merge'",
        no_weights="its processor always gives torch's attention a mask (the text's, padded), which the weighing of "
                   "merged keys cannot join; use proportional_attention=False",
        mask="text",
    ),
    _FLIPPED_DOUBLE,
)


ROOT_KINDS: Tuple[RootKind, ...] = (
    # HunyuanVideo: [B, C, F, H, W] on Wan's grid; blocks joining [image, text], image first, under the root's mask over
    # both (double_stream, single_stream). Its token_replace image-to-video model's first frame, the condition image,
    # passes whole (HeadGrid: layouts/image_first.py).
    RootKind("HunyuanVideo", ("HunyuanVideoTransformer3DModel",), "hunyuan_video", frame_axis=2,
             supported="the HunyuanVideo video transformer (torch; merge mode; image-to-video's condition frame "
                       "never merges)"),
    # HunyuanVideo Framepack: HunyuanVideo's blocks; the history's tokens (4x, 2x, clean latents) join before the
    # target's in the blocks' input and pass whole (HeadGrid: layouts/image_first.py); its image embeddings join the
    # text.
    RootKind("HunyuanVideo Framepack", ("HunyuanVideoFramepackTransformer3DModel",), "framepack", frame_axis=2,
             supported="the HunyuanVideo Framepack video transformer (torch; merge mode; its history tokens never "
                       "merge)"),
    # Motif-Video: HunyuanVideo's latent [B, C, F, H, W] on Wan's grid and its blocks under other names (double_stream,
    # single_stream): [image, text] joined, image first, under the root's mask over both, all True over the image. Its
    # image-to-video pipeline's image embedding joins the text (passing whole).
    RootKind(family="Motif-Video", classes=("MotifVideoTransformer3DModel",), layout="motif_video", frame_axis=2,
             supported="the Motif-Video transformer (torch; merge mode)"),
    # HunyuanVideo 1.5: [B, C, F, H, W] patchified by a Conv3d in Wan's token order; the text passes whole.
    RootKind("HunyuanVideo 1.5", ("HunyuanVideo15Transformer3DModel",), "spacetime", frame_axis=2,
             supported="the HunyuanVideo 1.5 video transformer (torch; merge mode)"),
    # ComfyUI's HunyuanVideo class (HunyuanVideo and its image-to-video models, HunyuanVideo 1.5, HunyuanImage 2.1):
    # Flux's block classes, the double blocks built flipped (image first; _FLIPPED_DOUBLE), the single
    # blocks over [image, text]; the image first in every block's input, the text after it passing whole
    # (ComfyHunyuanVideoGrid). Condition tokens that would join the image's are refused at the call.
    RootKind("HunyuanVideo (ComfyUI)", ("HunyuanVideo",), "comfy_hunyuan_video", module="comfy.",
             supported="ComfyUI's HunyuanVideo, HunyuanVideo 1.5 and HunyuanImage 2.1 (comfy.ldm.hunyuan_video.model."
                       "HunyuanVideo; merge mode; without guiding_frame_index, ref_latent or an attention mask)"),
)


def _hunyuan_video(root: Any, kind: RootKind, xp: Any) -> Layout:
    patch = spacetime_patch(root)
    first = 1 if config_value(root, "image_condition_type") == "token_replace" else 0
    return Levels(root, kind, xp) if patch is None else HeadGrid(root, kind, xp, patch, first)


class MotifGrid(HeadGrid):
    def __init__(self, root: Any, kind: RootKind, xp: Any, patch: Tuple[int, int, int]) -> None:
        super().__init__(root, kind, xp, patch, 0)
        self.single_cross = bool(config_value(root, "enable_text_cross_attention_single"))

    def validate(self, patch: Any) -> None:
        if self.single_cross and patch.args.merge_attn:
            raise ValueError(
                f"ToMe cannot merge the single blocks of {self.model} built with enable_text_cross_attention_single="
                f"True: their text cross-attention takes the merged joint attention's output with the unmerged rotary "
                f"rows; call apply_patch with merge_attn=False (the double blocks' feed-forward merges)")


def _motif_video(root: Any, kind: RootKind, xp: Any) -> Layout:
    patch = spacetime_patch(root)
    return Levels(root, kind, xp) if patch is None else MotifGrid(root, kind, xp, patch)


def _framepack(root: Any, kind: RootKind, xp: Any) -> Layout:
    patch = spacetime_patch(root)
    return Levels(root, kind, xp) if patch is None else HeadGrid(root, kind, xp, patch, 0)


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
    patch = spacetime_patch(root)  # ComfyUI's root keeps patch_size as an attribute (a list)
    if patch is not None:
        return ComfyHunyuanVideoGrid(root, kind, xp, patch)
    size = getattr(root, "patch_size", None) if config_value(root, "patch_size") is None else config_value(root, "patch_size")
    if isinstance(size, (tuple, list)) and len(size) == 2 and all(isinstance(p, int) and p > 0 for p in size):
        return ComfyHunyuanImageGrid(root, kind, xp, size[0], size[1])  # HunyuanImage 2.1: [B, C, H, W]
    return Levels(root, kind, xp)


LAYOUTS = {"hunyuan_video": _hunyuan_video, "framepack": _framepack, "motif_video": _motif_video,
           "comfy_hunyuan_video": _comfy_hunyuan_video}
