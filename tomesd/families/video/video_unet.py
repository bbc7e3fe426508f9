"""Video UNets whose spatial blocks are the UNets' BasicTransformerBlocks (image/unet.py): AnimateDiff's
UNetMotionModel, UNet3DConditionModel, SVD's UNetSpatioTemporalConditionModel, I2VGenXLUNet; and Latte, a video
transformer of that block. Their spatial blocks see one frame per batch row, so tomesd's level rule merges within
each frame (layout "levels" with video=True); their temporal blocks are left alone (TEMPORAL_CONTAINERS)."""
from __future__ import annotations

from typing import Tuple

from ...layouts.entries import BlockKind, RootKind


BLOCK_KINDS: Tuple[BlockKind, ...] = ()


ROOT_KINDS: Tuple[RootKind, ...] = (
    # Video UNets: the latent is [B, C, F, H, W] ([B, F, C, H, W] for SVD), H and W last; the spatial blocks
    # see one frame per batch row, so tomesd's level rule merges within each frame.
    RootKind("video UNet", ("UNetMotionModel", "UNet3DConditionModel", "UNetSpatioTemporalConditionModel",
                            "I2VGenXLUNet"), "levels", video=True,
             supported="a video UNet (AnimateDiff's UNetMotionModel, UNet3DConditionModel, SVD's "
                       "UNetSpatioTemporalConditionModel, I2VGenXLUNet)"),
    # Latte: a video transformer whose spatial blocks see one frame per batch row (h x w tokens) and whose temporal
    # blocks (the same class, in `temporal_transformer_blocks`) see one grid cell's frames. The level rule merges the
    # spatial blocks within each frame; a temporal block's token count (the frames) fits no grid level at or
    # below the spatial blocks' (the patch size), so it is left alone (max_downsample could reach it: leave it out).
    RootKind("Latte", ("LatteTransformer3DModel",), "levels", video=True,
             supported="the Latte video transformer (torch)"),
)


# Modules whose transformer blocks attend over frames, not over a frame's grid: AnimateDiff's motion
# modules, the temporal attentions of UNet3DConditionModel and I2VGenXLUNet (and their `transformer_in`).
# Their blocks are BasicTransformerBlocks like the spatial ones, so they are told apart by where they sit,
# never by class; ToMe leaves them untouched. (SVD's temporal blocks are a class of their own.)
TEMPORAL_CONTAINERS = ("TransformerTemporalModel", "AnimateDiffTransformer3D")
