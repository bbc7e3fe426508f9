"""CogVideoX and ConsisID (CogVideoX's block under another name): joint attention over [text, image] returning
(image, text), a latent [B, F, C, H, W] (layout "spacetime", frames on axis 1)."""
from __future__ import annotations

from typing import Tuple

from ...layouts.entries import BlockKind, RootKind, Sublayer


BLOCK_KINDS: Tuple[BlockKind, ...] = (
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
)


ROOT_KINDS: Tuple[RootKind, ...] = (
    RootKind("CogVideoX", ("CogVideoXTransformer3DModel",), "spacetime", frame_axis=1,
             supported="the CogVideoX video transformer (torch)"),
    # ConsisID: CogVideoX's blocks and latent [B, F, C, H, W]; its face features join between blocks, on every token.
    RootKind("ConsisID", ("ConsisIDTransformer3DModel",), "spacetime", frame_axis=1,
             supported="the ConsisID video transformer (torch)"),
)
