"""Block kinds of transformers whose main layers run on one unified sequence of image and text tokens with padding
(layout "unified", layouts_unified.py): Z-Image and Lumina 2, whose blocks also serve the model's refiners (an
image-only noise refiner, a text-only context refiner), told apart by the layout by where the block sits; their
masks are key-padding masks over every token ([B, S]) that follow the merged tokens (BlockKind.mask = "tokens").
And OmniGen's, whose image comes last (layout "patchgrid") under a mask over every (query, key) pair ("pairs")."""
from __future__ import annotations

from typing import Tuple

from .kind_types import BlockKind, Sublayer

_NO_DOWNSAMPLE = ("its sequence joins the image with text and padding under a key-padding mask, and no seam takes "
                  "the image's keys alone; use mode='merge'")
_NO_WEIGHTS = ("its attention is given a key-padding mask, which the weighing of merged keys cannot join; use "
               "proportional_attention=False")

UNIFIED_KINDS: Tuple[BlockKind, ...] = (
    # Z-Image: self-attention over the whole sequence (given positionally), its queries and keys rotated by complex
    # rows [B, S, D/2] (a batch axis: they follow each sample) inside the processor, a [B, S] mask when samples'
    # lengths differ; the feed-forward sees every token. The AdaLN scales and gates are per sample (per token in
    # omni mode, which the layout refuses) and applied outside these sub-layers.
    BlockKind(
        "ZImageTransformerBlock",
        sublayers=(Sublayer("attention", "merge_attn", tokens=("hidden_states",), rotary="freqs_cis", rotary_axis=1),
                   Sublayer("feed_forward", "merge_mlp", tokens=("x",))),
        downsample=(),
        no_downsample=_NO_DOWNSAMPLE,
        no_weights=_NO_WEIGHTS,
        mask="tokens",
        module="diffusers.",
    ),
    # Lumina 2: self-attention given the normed tokens as hidden_states and again as encoder_hidden_states (both
    # merge), rows [B, S, D/2] complex, a [B, S] mask when the prompts' lengths differ; the feed-forward.
    BlockKind(
        "Lumina2TransformerBlock",
        sublayers=(Sublayer("attn", "merge_attn", tokens=("hidden_states",), rotary="image_rotary_emb",
                            rotary_axis=1, also=("encoder_hidden_states",)),
                   Sublayer("feed_forward", "merge_mlp", tokens=("x",))),
        downsample=(),
        no_downsample=_NO_DOWNSAMPLE,
        no_weights=_NO_WEIGHTS,
        mask="tokens",
        module="diffusers.",
    ),
    # OmniGen: [condition tokens, time token, image] (layout "patchgrid": the image last), self-attention given the
    # normed tokens as hidden_states and encoder_hidden_states, rows (cos, sin) [S, D] with no batch axis (applied
    # in the processor, which calls torch's attention itself: one matching serves the batch) and an additive mask
    # [B, 1, S, S]: causal over the conditions, bidirectional over the image. Its pipeline's masks give every image
    # query the same row and every image key the same column, so merged rows take their representative's.
    BlockKind(
        "OmniGenBlock",
        sublayers=(Sublayer("self_attn", "merge_attn", tokens=("hidden_states",), rotary="image_rotary_emb",
                            also=("encoder_hidden_states",)),
                   Sublayer("mlp", "merge_mlp", tokens=("hidden_states",))),
        downsample=(),
        no_downsample=_NO_DOWNSAMPLE,
        no_weights=_NO_WEIGHTS,
        mask="pairs",
        module="diffusers.",
    ),
)
