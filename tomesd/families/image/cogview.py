"""CogView3-Plus, CogView4 and GLM-Image: joint attention over [text, image] given the image as hidden_states,
returning (image, text), on a patchified latent (layouts "patches" and "patchgrid"). Their video kin, CogVideoX and
ConsisID, are in video/cogvideox.py."""
from __future__ import annotations

from typing import Tuple

from ...layouts.entries import BlockKind, Downsample, RootKind, Sublayer


BLOCK_KINDS: Tuple[BlockKind, ...] = (
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
)


ROOT_KINDS: Tuple[RootKind, ...] = (
    # CogView3-Plus: no rotary rows (its positions are added once, at the patch embedding), so each sample is
    # matched on its own as on SD3; its own entry names it in the supported list (the suffix rule below would
    # read it alike).
    RootKind("CogView3-Plus", ("CogView3PlusTransformer2DModel",), "patches",
             supported="the CogView3-Plus transformer (torch)"),
    RootKind("CogView4", ("CogView4Transformer2DModel",), "patchgrid", supported="the CogView4 transformer (torch)"),
    # GLM-Image: CogView4's layout (rows [image, D] applied inside its processor, one matching for the batch).
    RootKind("GLM-Image", ("GlmImageTransformer2DModel",), "patchgrid", supported="the GLM-Image transformer (torch)"),
)
