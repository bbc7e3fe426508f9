"""tomesd's public API: apply_patch / remove_patch, for torch and paddle models alike; and the rest of tomesd 0.1.3's
`tomesd.patch` module, which hosts import (compat013.py): compute_merge, hook_tome_model, and the block-class
factories, which refuse by name."""
from __future__ import annotations

import inspect
from typing import Any, Mapping, Optional, Sequence, Tuple, Union

from tome_core import ToMeArgs

from . import merge  # noqa: F401  (tomesd 0.1.3's tomesd.patch.merge)
from .compat013 import compute_merge, hook_tome_model, make_diffusers_tome_block, make_tome_block, refuse_replaced
from .config import CONFIGS, ToDoConfig, ToMeConfig
from .hosts import targets
from .utils import init_generator, isinstance_str  # noqa: F401  (tomesd.patch's names in tomesd 0.1.3)

__all__ = ["apply_patch", "remove_patch", "compute_merge", "hook_tome_model", "make_tome_block",
           "make_diffusers_tome_block", "merge", "isinstance_str", "init_generator"]


def apply_patch(
    model: Any,
    ratio: Optional[Union[float, Mapping[str, float]]] = None,
    max_downsample: Optional[int] = None,
    sx: Optional[int] = None,
    sy: Optional[int] = None,
    use_rand: Optional[bool] = None,
    merge_attn: Optional[bool] = None,
    merge_crossattn: Optional[bool] = None,
    merge_mlp: Optional[bool] = None,
    *,
    seed: Optional[int] = None,
    mode: Optional[str] = None,
    downsample_factor: Optional[int] = None,
    downsample_method: Optional[str] = None,
    reuse_steps: Optional[int] = None,
    share_across_blocks: Optional[bool] = None,
    blocks: Optional[Sequence[int]] = None,
    st: Optional[int] = None,
    ratio_schedule: Optional[Sequence[Tuple[float, float]]] = None,
    bands: Optional[int] = None,
    proportional_attention: Optional[bool] = None,
    restore_tokens: Optional[bool] = None,
    kept_sizes: Optional[int] = None,
    config: Optional[Union[ToMeConfig, ToDoConfig]] = None,
) -> Any:
    """Patch every denoiser of `model` (UNets and ControlNets, never the VAE) to reduce the tokens
    its transformer blocks attend over.

    model: a diffusers or ppdiffusers pipeline, a UNet2DConditionModel / ControlNetModel /
      MultiControlNetModel (torch or paddle), a video UNet (AnimateDiff's UNetMotionModel,
      UNet3DConditionModel, SVD's UNetSpatioTemporalConditionModel, I2VGenXLUNet), an SD3 / SD3.5 (and
      SD3 ControlNet), PixArt or DiT transformer, a Flux transformer or ControlNet, the Wan video
      transformer (WanTransformer3DModel), or an LDM / SD v1-v2 model (`.model.diffusion_model`).
    max_downsample: UNets: reduce in blocks downsampled at most this much from the latent (1, 2, 4,
      8). None (default): the finest level that has attention, i.e. 1 on SD1/SD2, as tomesd's
      default, and 2 on SDXL, whose full-resolution level has no attention. Every mode.
    blocks: diffusion transformers: the indices of the blocks that reduce (default None: every
      block); their blocks all see one patch grid, so max_downsample is refused there. Every mode.
      Only image tokens are ever merged or downsampled; text tokens stay whole.
    st: video transformers (Wan), whose blocks see every frame in one sequence: the dst stride along
      time (default 1: dst in every frame; 2: one dst per cell of 2 frames x sy x sx, so tokens may
      merge across neighbouring frames). Refused on models whose blocks see one frame.

    config: a tomesd.ToMeConfig (mode="merge") or tomesd.ToDoConfig (mode="downsample") holding the
      settings below, validated when it was built; given a config, give no other setting.

    mode="merge" (default, mode=None): exact ToMe, tomesd's arguments and defaults.
      ratio (0.5): fraction of tokens merged away in each merging block; or a mapping of sites to
      ratios, {"attn": 0.5, "crossattn": 0.3, "mlp": 0.25}: each named site merges at its own ratio
      (one matching per block serves them all), unnamed sites do not (the merge_* flags follow).
      sx, sy (2, 2): stride of the dst grid; use_rand (True): random dst in each cell (odd batches
      included: a batch split over calls merges as one call). merge_attn (True) / merge_crossattn (False) / merge_mlp (False): where tokens merge.
      seed: the seed of the random dst pattern (default None: tome_core.DEFAULT_SEED, i.e. 0). A
      block's pattern is a function of the seed, the call's timestep and the block's index, so the
      same weights and inputs give the same outputs in any process, on torch and paddle alike;
      the global RNG is never read.
      reuse_steps (1): compute each block's matching at one denoising step and reuse it for the next
      reuse_steps - 1 steps; a new batch or token count recomputes. On a pipeline, its scheduler's
      loop counts the steps (no tensor read; compiles as two graphs). On a bare model a step is a
      distinct timestep value, read on the host once per call, eager only. Either way several
      calls in one step share it.
      ratio_schedule: a ratio that changes over the denoising run (tomesd #28), as (progress, ratio)
      pairs from progress 0.0: [(0.0, 0.25), (0.3, 0.5), (0.8, 0.25)] merges 0.25 in the first 30% of
      the steps, 0.5 until 80%, then 0.25. Replaces ratio; pipelines only (their loop counts the steps
      on the host); not with reuse_steps. A constant schedule equals exact ToMe.
      share_across_blocks (False): within a call, the first merging block of each level matches and
      the later blocks of that level reuse its matching.
      bands (1): diffusion transformers: merge within `bands` contiguous bands of the token sequence, each
      matched on its own with its share of the merged tokens, the random pattern the whole grid's. Under
      diffusers' context parallelism (enable_parallelism with a ContextParallelConfig) each rank merges
      within its own band (bands, if given, must be 1 or P there), so the attention's tokens and the bytes
      each collective moves shrink by the merged share; bands=P on one process gives what a P-way run gives,
      to round-off.
      proportional_attention (False): a merged key weighs in self- and joint attention as the tokens it holds
      (ToMe for ViTs' proportional attention), text and unmerged keys as one; much closer to the unpatched model
      at the same speed. The bias rides as one more query/key channel, never a mask, so SDPA keeps its fused
      kernel; torch, diffusers' processors that call scaled_dot_product_attention (or its native dispatch).
      restore_tokens (False; needs reuse_steps=k > 1): the first step of each window of k steps runs unmerged and
      keeps, per merging site and per call of the step, each token's output minus its merged row's mean (one
      [B, N, C] tensor per site and call); the window's merged steps add it to the tokens they unmerge, so a
      merged-away token gets its row's output plus its own difference instead of a copy. Eager (a pipeline's
      clock or a bare model's timestep rule), torch and paddle.
    mode="downsample": token downsampling (ToDo). Self-attention takes its keys and values from the
      block's token grid downsampled by downsample_factor per side (2); queries stay full, nothing
      is unmerged. downsample_method: "nearest" (default; the top-left token of each cell) or "avg"
      (the cell's mean). Deterministic; the merge-only arguments above are refused, but
      proportional_attention (a pooled key weighs as its cell's tokens) and restore_tokens with reuse_steps=k:
      the first step of each window of k runs every key, and each downsampled attention keeps its output minus
      its output with the downsampled keys (it runs twice there), which the window's later steps add to theirs.
      Eager, PyTorch models.
    kept_sizes (16), either mode: what the patch keeps across calls per input size and device (index constants,
      plans) is kept for at most this many recent ones; a size that comes back rebuilds its own. A server that
      sees many sizes holds a bounded amount.
    Raises, with `model` unchanged: ValueError naming the argument for a bad argument (including
    one the chosen mode has no use for, and any setting given beside `config`); TypeError for a
    `config` that is not a ToMeConfig / ToDoConfig, or an object ToMe cannot patch.
    """
    refuse_replaced(globals())  # a host's make_tome_block set here would be ignored: refused, before anything
    settings = dict(
        ratio=ratio, max_downsample=max_downsample, sx=sx, sy=sy, use_rand=use_rand, merge_attn=merge_attn,
        merge_crossattn=merge_crossattn, merge_mlp=merge_mlp, seed=seed, mode=mode,
        downsample_factor=downsample_factor, downsample_method=downsample_method, reuse_steps=reuse_steps,
        share_across_blocks=share_across_blocks, blocks=blocks, st=st, ratio_schedule=ratio_schedule, bands=bands,
        proportional_attention=proportional_attention, restore_tokens=restore_tokens, kept_sizes=kept_sizes,
    )
    return targets.apply(model, resolve(config, settings))[0]


# The settings apply_patch takes besides `model` and `config`, in its order.
SETTINGS = tuple(inspect.signature(apply_patch).parameters)[1:-1]


def resolve(config: Any, settings: Mapping[str, Any], caller: str = "apply_patch") -> ToMeArgs:
    """The validated ToMeArgs of `config`, or else of `settings` (apply_patch's, by name; None: not given),
    built by keyword. Given both, refuses before anything is patched."""
    unknown = [name for name in settings if name not in SETTINGS]
    if unknown:
        raise TypeError(f"{caller}() got an unexpected keyword argument {unknown[0]!r}")
    given = {name: settings[name] for name in SETTINGS if settings.get(name) is not None}  # in apply_patch's order
    if config is None:
        return ToMeArgs(**given)  # mode left out: ToMeArgs' default, "merge"
    if not isinstance(config, CONFIGS):
        raise TypeError(f"config must be a tomesd.ToMeConfig or tomesd.ToDoConfig, got {type(config).__name__}")
    if given:
        raise ValueError(
            f"{caller}() got config and {', '.join(given)}: give the settings either as config or as arguments, "
            f"not both (dataclasses.replace(config, ...) gives a config with some settings changed)"
        )
    return config.args


def remove_patch(model: Any) -> Any:
    """Remove every ToMe patch from `model`; a no-op for an unpatched model."""
    return targets.remove(model)[0]


def __getattr__(name: str) -> Any:
    if name == "torch":  # tomesd 0.1.3's module imported torch at its top; this one imports it when asked
        import torch

        return torch
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
