"""Diffusion transformers that patchify their latent once, read by their class name's suffix (layout "patches": one
(h/p, w/p) grid for every block): SD3 / SD3.5 (blocks: sd3.py), PixArt and DiT (the UNets' BasicTransformerBlock:
unet.py), ppdiffusers' Transformer2DModel, SD3's ControlNet, and Sana, whose block is here."""
from __future__ import annotations

from typing import Tuple

from ...layouts.entries import BlockKind, Downsample, RootKind, Sublayer


BLOCK_KINDS: Tuple[BlockKind, ...] = (
    # Sana: linear self-attention over the image, cross-attention to the text; its feed-forward (GLUMBConv)
    # is a convolution over the (height, width) token grid, so it is not a merge site.
    BlockKind(
        "SanaTransformerBlock",
        sublayers=(Sublayer("attn1", "merge_attn"), Sublayer("attn2", "merge_crossattn")),
        downsample=(Downsample("attn1", "context"),),
        no_weights=("Sana's self-attention is linear attention (ReLU kernels, no softmax), so there are no scores "
                    "for a merged key's weight; apply_patch with proportional_attention=False"),
    ),
)


ROOT_KINDS: Tuple[RootKind, ...] = (
    # Denoisers that patchify their latent once: SD3Transformer2DModel, PixArtTransformer2DModel,
    # DiTTransformer2DModel, ppdiffusers' Transformer2DModel (PixArt, DiT), SD3ControlNetModel,
    # SanaTransformer2DModel.
    RootKind("diffusion transformer", ("Transformer2DModel", "SD3ControlNetModel"), "patches", suffix=True,
             supported="an SD3 / SD3.5, PixArt, DiT or Sana transformer (torch or paddle)"),
)
