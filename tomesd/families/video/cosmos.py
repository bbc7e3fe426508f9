"""Cosmos (Predict 2 / 2.5) on diffusers ([B, C, F, H, W], Wan's token order: layout "spacetime") and ComfyUI's Cosmos
Predict2 (MiniTrainDIT: blocks on the grid [B, T, H, W, D], the patch from patch_temporal / patch_spatial: layout
"comfy_cosmos", ComfyCosmos here).

The "comfy_cosmos" layout: ComfyUI's Cosmos Predict2 (comfy.ldm.cosmos.predict2.MiniTrainDIT). Its latent
[B, C, T, H, W] is patchified by (patch_temporal, patch_spatial, patch_spatial), attributes of the root (it names
no patch_size), into a grid [B, T', H', W', D] that its blocks take and return whole; each attention is given the grid
flattened in (t, h, w) order, Wan's space-time order. So the matching is SpaceTime's, computed from the block's
input read as [B, T'*H'*W', D] (a view); the attentions' flattened tokens merge and unmerge around them."""
from __future__ import annotations

from numbers import Integral
from typing import Any, Optional, Tuple

from ...layouts.coordinates import SpaceTime
from ...layouts.entries import BlockKind, Downsample, RootKind, Sublayer


BLOCK_KINDS: Tuple[BlockKind, ...] = (
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
    # Block(x [B, T, H, W, D], emb, crossattn_emb, rope_emb_L_1_1_D, ...): `self_attn` is given the modulated grid
    # flattened to tokens in (t, h, w) order and the rows `rope_emb` [1, L, 1, 1, 1, D] (a batch axis of one: they
    # follow each sample's merged tokens), which it applies to its own queries and keys only; `cross_attn` takes the
    # text as keys (it is given the rows too and leaves them unused). The MLP runs on the grid [B, T, H, W, D], so it is
    # no merge site. The modulation (per sample, or per frame) is applied to the grid outside these sub-layers.
    BlockKind(
        "Block",
        sublayers=(Sublayer("self_attn", "merge_attn", tokens=("x",), rotary="rope_emb", rotary_axis=1),
                   Sublayer("cross_attn", "merge_crossattn", tokens=("x",))),
        downsample=(),
        tokens=("x_B_T_H_W_D",),
        no_downsample=(
            "Cosmos Predict2 here (ComfyUI's MiniTrainDIT) rotates self-attention's keys by rows for every token "
            "inside its attention module, so keys from a downsampled grid would not meet their rows; use mode='merge'"),
        module="comfy.ldm.cosmos.predict2",
    ),
)


ROOT_KINDS: Tuple[RootKind, ...] = (
    # Cosmos (Predict 2 / 2.5): [B, C, F, H, W], Wan's token order; rotary rows [image, D] without a batch axis.
    RootKind("Cosmos", ("CosmosTransformer3DModel",), "spacetime", frame_axis=2,
             supported="the Cosmos video transformer (torch)"),
    # ComfyUI's Cosmos Predict2: blocks on the grid [B, T, H, W, D], flattened in Wan's order around each attention;
    # the patch from its patch_temporal / patch_spatial (ComfyCosmos, below).
    RootKind("Cosmos Predict2 (ComfyUI)", ("MiniTrainDIT",), "comfy_cosmos", frame_axis=2, module="comfy.",
             supported="ComfyUI's Cosmos Predict2 (comfy.ldm.cosmos.predict2.MiniTrainDIT; merge mode)"),
)


def _cosmos_patch(root: Any) -> Optional[Tuple[int, int, int]]:
    pt, ps = getattr(root, "patch_temporal", None), getattr(root, "patch_spatial", None)
    if all(isinstance(p, Integral) and not isinstance(p, bool) and p > 0 for p in (pt, ps)):
        return int(pt), int(ps), int(ps)
    return None


class ComfyCosmos(SpaceTime):
    """SpaceTime's grid and matching, the patch from the root's patch_temporal / patch_spatial; a block input given
    as the grid [B, T, H, W, D] is read as its tokens [B, T*H*W, D]."""

    def __init__(self, root: Any, kind: RootKind, xp: Any) -> None:
        self.found_patch = _cosmos_patch(root)
        super().__init__(root, kind, xp, kind.frame_axis or 2, self.found_patch or (1, 1, 1))

    def validate(self, patch: Any) -> None:
        if self.found_patch is None:
            raise ValueError(f"ToMe reads {self.model}'s patch from its patch_temporal and patch_spatial (ints), and "
                             f"this model has none: apply it to the MiniTrainDIT ComfyUI builds")

    def image_tokens(self, call: Any, x: Any, index: int = 0) -> Any:
        shape = self.xp.shape(x)
        if len(shape) == 5:  # the grid [B, T, H, W, D]: its tokens in (t, h, w) order
            x = self.xp.reshape(x, [shape[0], shape[1] * shape[2] * shape[3], shape[4]])
        return super().image_tokens(call, x, index)


LAYOUTS = {"comfy_cosmos": ComfyCosmos}
