"""EasyAnimate: joint attention over [text, image] given the image as hidden_states, on Wan's space-time grid (layout
"spacetime")."""
from __future__ import annotations

from typing import Tuple

from ...layouts.entries import BlockKind, RootKind, Sublayer


BLOCK_KINDS: Tuple[BlockKind, ...] = (
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
)


ROOT_KINDS: Tuple[RootKind, ...] = (
    RootKind("EasyAnimate", ("EasyAnimateTransformer3DModel",), "spacetime", frame_axis=2,
             supported="the EasyAnimate video transformer (torch)"),
)
