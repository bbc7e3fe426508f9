"""OmniGen: [condition tokens (text with input images' tokens), time token, image] under a mask over every (query, key)
pair; the image is the last N tokens of a patchified latent (layout "patchgrid"), its condition tokens never merge."""
from __future__ import annotations

from typing import Tuple

from ...layouts.entries import BlockKind, RootKind, Sublayer
_NO_DOWNSAMPLE = ("its sequence joins the image with text and padding under a key-padding mask, and no seam takes "
                  "the image's keys alone; use mode='merge'")
_NO_WEIGHTS = ("its attention is given a key-padding mask, which the weighing of merged keys cannot join; use "
               "proportional_attention=False")


BLOCK_KINDS: Tuple[BlockKind, ...] = (
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


ROOT_KINDS: Tuple[RootKind, ...] = (
    # OmniGen: [condition tokens (text with input images' tokens), time token, image] under a mask [B, 1, S, S]:
    # the image is the last N tokens of a patchified latent, rows [S, D] with no batch axis (one matching).
    RootKind("OmniGen", ("OmniGenTransformer2DModel",), "patchgrid", module="diffusers.",
             supported="the OmniGen transformer (torch; its condition tokens never merge)"),
)
