"""Block kinds of diffusers' transformers whose joint attention puts the image before the text, [image, text], under a
key-padding mask the root builds over both (BlockKind.mask "image_ones_first"): HunyuanVideo (text-to-video, and
Framepack's blocks, which are its classes), HunyuanImage 2.1 and Motif-Video (HunyuanVideo's under its own names).
Each has double-stream blocks (image and text enter apart; the joint attention returns (image, text)) and
single-stream blocks that join [image, text] inside their forward (a Span with image_first)."""
from __future__ import annotations

from typing import Tuple

from .kind_types import BlockKind, Span, Sublayer

# Their processors (HunyuanVideoAttnProcessor2_0, HunyuanImageAttnProcessor) rotate the image's queries and keys by
# rows (cos, sin) [image, D] with diffusers' apply_rotary_emb and hand [image, text] to diffusers' dispatch with the
# root's mask: per-sample rows are applied there to the first tokens (rotation_at_dispatch's image_first).
_NO_DOWNSAMPLE = ("its processor hands the attention the root's mask over every key [image, text], and its single "
                  "blocks project keys with the queries from [image, text] joined, so no seam shrinks the image's keys "
                  "alone under that mask; use mode='merge'")
_NO_WEIGHTS = ("its processor gives the attention the root's key-padding mask, which the weighing of merged keys "
               "cannot join; use proportional_attention=False")


def _double(name: str) -> BlockKind:
    """A double-stream block: `attn` takes the image as hidden_states and the text as encoder_hidden_states, returns
    (image, text); `ff` sees the image alone (the text has its own ff_context, never hooked)."""
    return BlockKind(
        name,
        sublayers=(Sublayer("attn", "merge_attn", tokens=("hidden_states",), outputs=(0,), rotary="image_rotary_emb",
                            rotates="cos_sin", image_keys_first=True),
                   Sublayer("ff", "merge_mlp", tokens=("hidden_states",))),
        downsample=(), no_downsample=_NO_DOWNSAMPLE, no_weights=_NO_WEIGHTS, mask="image_ones_first",
    )


def _single(name: str) -> BlockKind:
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


IMAGE_FIRST_KINDS: Tuple[BlockKind, ...] = (
    _hidream("HiDreamImageTransformerBlock", single=False), _hidream("HiDreamImageSingleTransformerBlock", single=True),
    _double("HunyuanVideoTransformerBlock"), _single("HunyuanVideoSingleTransformerBlock"),
    _double("HunyuanImageTransformerBlock"), _single("HunyuanImageSingleTransformerBlock"),
    # HunyuanVideo-I2V's (image_condition_type="token_replace"): the same sub-layers; the block modulates the first
    # frame's tokens (the condition image) apart by num_tokens on every token, around the sites, and the layout passes
    # that frame whole (layouts_image_first.py), so each split by num_tokens meets full-length tokens.
    _double("HunyuanVideoTokenReplaceTransformerBlock"), _single("HunyuanVideoTokenReplaceSingleTransformerBlock"),
    # Motif-Video's: HunyuanVideo's blocks under its own names (the same sub-layers, processor and root mask), with
    # an optional text cross-attention after the joint one. The double block's takes the joint attention's output,
    # unmerged, whole; the single block's would take it merged (refused at apply time: layouts_image_first.py).
    _double("MotifVideoTransformerBlock"), _single("MotifVideoSingleTransformerBlock"),
)
