"""tomesd's public API: apply_patch / remove_patch, for torch and paddle models alike."""
from __future__ import annotations

from typing import Any, Optional

from tome_core import ToMeArgs

from .adapters import targets


def apply_patch(
    model: Any,
    ratio: float = 0.5,
    max_downsample: Optional[int] = None,
    sx: int = 2,
    sy: int = 2,
    use_rand: bool = True,
    merge_attn: bool = True,
    merge_crossattn: bool = False,
    merge_mlp: bool = False,
    *,
    seed: Optional[int] = None,
) -> Any:
    """Patch every denoiser of `model` (UNets and ControlNets, never the VAE) with Token Merging.

    model: a diffusers or ppdiffusers pipeline, a UNet2DConditionModel / ControlNetModel /
      MultiControlNetModel (torch or paddle), or an LDM / SD v1-v2 model (`.model.diffusion_model`).
    ratio: fraction of tokens merged away in each merging block (0.5 halves them).
    max_downsample: merge in blocks downsampled at most this much from the latent (1, 2, 4, 8).
      None (default): the finest level that has attention, i.e. 1 on SD1/SD2, as tomesd's
      default, and 2 on SDXL, whose full-resolution level has no attention.
    sx, sy: stride of the dst grid; use_rand: random dst in each cell (off for odd batches).
    merge_attn / merge_crossattn / merge_mlp: where tokens are merged.
    seed: the seed of the random dst pattern (default None: tome_core.DEFAULT_SEED, i.e. 0). A
      block's pattern is a function of the seed, the call's timestep and the block's index, so the
      same weights and inputs give the same outputs in any process, on torch and paddle alike;
      the global RNG is never read.
    Raises ValueError / TypeError, with `model` unchanged, for bad arguments or objects.
    """
    args = ToMeArgs(ratio, max_downsample, sx, sy, use_rand, merge_attn, merge_crossattn, merge_mlp, seed)
    return targets.apply(model, args)[0]


def remove_patch(model: Any) -> Any:
    """Remove every ToMe patch from `model`; a no-op for an unpatched model."""
    return targets.remove(model)[0]
