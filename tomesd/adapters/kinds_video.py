"""Block kinds of diffusers' video transformers whose blocks see every frame's tokens in one sequence (roots.py:
layout "spacetime"), added from diffusers 0.42 by table entries: ConsisID, Cosmos, EasyAnimate, Sana-Video. (Wan's,
CogVideoX's and SkyReels-V2's are in kinds.py; Wan Animate runs Wan's block.)"""
from __future__ import annotations

from typing import Tuple

from .kind_types import BlockKind, Downsample, Sublayer

VIDEO_KINDS: Tuple[BlockKind, ...] = (
    # ConsisID: CogVideoX's block under another class name (joint attention over [text, image] returning
    # (image, text), image rows [image, D]; the feed-forward sees [text, image] joined).
    BlockKind(
        "ConsisIDBlock",
        sublayers=(Sublayer("attn1", "merge_attn", tokens=("hidden_states",), outputs=(0,),
                            rotary="image_rotary_emb"),
                   Sublayer("ff", "merge_mlp")),
        downsample=(),
        no_downsample=(
            "ConsisID's attention processor (CogVideoX's) joins text and image tokens before projecting keys and "
            "values (and rotates the image keys after), so no seam takes image keys alone; use mode='merge'"),
    ),
    # Cosmos: image self-attention rotating queries and keys by rows (cos, sin) [image, D] (halves rotated, on
    # [B, heads, S, D]: not the dispatch's interleaved "cos_sin", so matched once for the batch) before
    # diffusers' dispatch; cross-attention to the text (Cosmos 2.5: and image context); the feed-forward. The
    # AdaLN modulations around them may be per token (a per-frame timestep); they stay outside the sites.
    BlockKind(
        "CosmosTransformerBlock",
        sublayers=(Sublayer("attn1", "merge_attn", tokens=("hidden_states",), rotary="image_rotary_emb"),
                   Sublayer("attn2", "merge_crossattn", tokens=("hidden_states",)),
                   Sublayer("ff", "merge_mlp")),
        downsample=(Downsample("attn1", "dispatch"),),
    ),
    # EasyAnimate: joint attention over [text, image] given the image as hidden_states, returning (image, text),
    # its image queries and keys rotated by rows [image, D] inside the processor, which calls torch's attention
    # itself. Its feed-forward is not a site: a block built without a text feed-forward (past mmdit_layers) runs
    # `ff` on the image and then on the text.
    BlockKind(
        "EasyAnimateTransformerBlock",
        sublayers=(Sublayer("attn1", "merge_attn", tokens=("hidden_states",), outputs=(0,),
                            rotary="image_rotary_emb"),),
        downsample=(),
        no_downsample=(
            "EasyAnimate's processor rotates the image keys after projecting them and calls torch's attention "
            "itself, so no seam takes the rotated keys; use mode='merge'"),
    ),
    # Sana-Video: linear self-attention over every frame's image tokens, rotated by Wan's rows [1, S, 1, D];
    # cross-attention to the text. Its feed-forward (GLUMBTempConv) convolves the (frames, rows, columns) grid,
    # so it is not a merge site.
    BlockKind(
        "SanaVideoTransformerBlock",
        sublayers=(Sublayer("attn1", "merge_attn", tokens=("hidden_states",), rotary="rotary_emb", rotary_axis=1),
                   Sublayer("attn2", "merge_crossattn", tokens=("hidden_states",))),
        downsample=(),
        no_downsample=(
            "Sana-Video's linear self-attention rotates its keys by every image token's rotary row, so keys "
            "cannot come from the downsampled grid; use mode='merge'"),
        no_weights=("Sana-Video's self-attention is linear attention (ReLU kernels, no softmax), so there are no "
                    "scores for a merged key's weight; apply_patch with proportional_attention=False"),
    ),
)
