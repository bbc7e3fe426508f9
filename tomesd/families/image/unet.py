"""UNets: Stable Diffusion 1.x / 2.x and SDXL, their ControlNets, on diffusers, ppdiffusers, the original LDM code and
ComfyUI (whose UNets have class names of their own: any root whose blocks are known and whose family is not in this
package is read as one). Their transformer blocks are BasicTransformerBlocks (PixArt's and DiT's too: their root is
dit.py's), at several levels of the latent; tomesd's level rule picks which levels merge (layout "levels")."""
from __future__ import annotations

from typing import Tuple

from ...layouts.entries import BlockKind, Downsample, NOT_YET, RUN_WITHOUT, RootKind, Sublayer


BLOCK_KINDS: Tuple[BlockKind, ...] = (
    # UNets (diffusers, ppdiffusers, LDM), PixArt and DiT.
    BlockKind(
        "BasicTransformerBlock",
        sublayers=(Sublayer("attn1", "merge_attn"), Sublayer("attn2", "merge_crossattn"), Sublayer("ff", "merge_mlp")),
        downsample=(Downsample("attn1", "context"),),
    ),
)


ROOT_KINDS: Tuple[RootKind, ...] = (
    # Denoisers whose input is not an image (or video) latent: their blocks hold tokens of embeddings.
    RootKind("Prior", ("PriorTransformer",), "levels", refused="a prior over embeddings, not over an image latent"),
    RootKind(family="DreamLite", classes=("DreamLiteTransformer2DModel", "DreamLiteUNetModel"), layout="levels",
             refused=f"a UNet whose finest levels, where ToMe's level rule merges, have no self-attention "
                     f"(BasicTransformerBlockDreamLite without attn1), {NOT_YET}; {RUN_WITHOUT}"),
)


# Any other root with known blocks: a UNet (diffusers, ppdiffusers, LDM) or a ControlNet, by tomesd's levels. The
# registry answers it for a root no family claims.
FALLBACK = RootKind("UNet", ("UNet2DConditionModel", "ControlNetModel"), "levels",
                    supported="a UNet2DConditionModel or ControlNetModel")
