"""diffusers' own step caches, run beside ToMe (`--cache fbc|taylorseer` in the loop bench and the
yardstick): what users pick instead of token reduction on diffusion transformers.

Each cache is applied with diffusers' own `apply_*` function (SD3's transformer has no `enable_cache`
in diffusers 0.42) before the ToMe patch, given a cache context for the whole loop (one call per step,
the guidance halves batched), and removed after it, so every timed loop starts from a fresh cache.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, Optional, Tuple


@dataclass(frozen=True)
class Cache:
    title: str
    config: Callable[[], Any]  # diffusers' config object, with the settings used
    apply: str  # diffusers.hooks' function
    hooks: Tuple[str, ...]  # the hook names it registers (removed by name)
    # Denoiser classes on which diffusers 0.42 itself fails with this cache, and why.
    fails_on: Dict[str, str]
    # It keeps sub-layer outputs across steps (inside blocks): ToMe's merge mode refuses it (see
    # adapters.guards), so it stacks with downsampling only.
    inside_blocks: bool = False


def _fbc() -> Any:
    from diffusers.hooks import FirstBlockCacheConfig

    return FirstBlockCacheConfig(threshold=0.05)  # diffusers' documented example threshold


def _taylorseer() -> Any:
    import torch
    from diffusers.hooks import TaylorSeerCacheConfig

    # diffusers' defaults (full steps 0-2, then one full step in 5), Taylor factors kept in float32.
    return TaylorSeerCacheConfig(taylor_factors_dtype=torch.float32)


_UNET = "diffusers' block registry does not describe UNet blocks (IndexError inside diffusers)"
CACHES: Dict[str, Cache] = {
    "fbc": Cache("First Block Cache (threshold 0.05)", _fbc, "apply_first_block_cache",
                 ("fbc_leader_block_hook", "fbc_block_hook"),
                 {"SD3Transformer2DModel": "diffusers' tail residual subtracts the text output that SD3's last "
                                           "block (context_pre_only) returns as None",
                  "UNet2DConditionModel": _UNET}),
    "taylorseer": Cache("TaylorSeer (diffusers' defaults)", _taylorseer, "apply_taylorseer_cache",
                        ("taylorseer_cache",), {}, inside_blocks=True),
}


def stacks_with(name: str, mode: str) -> bool:
    """Whether cache `name` can run under a ToMe setting of `mode` (merge mode refuses caches of layer
    outputs inside its blocks)."""
    return mode == "downsample" or not CACHES[name].inside_blocks


def check(name: Optional[str], model_class: str, backend: str, compile: bool, steps: int) -> None:
    """ValueError, in the user's terms, for a cache this run cannot use on a `model_class` denoiser."""
    if name is None:
        return
    if name not in CACHES:
        raise ValueError(f"--cache {name!r}: choose from {', '.join(CACHES)}")
    if backend != "torch":
        raise ValueError("--cache runs diffusers' caches: torch only")
    if compile:
        raise ValueError("--cache is not compiled in this benchmark: drop --compile")
    if steps < 2:
        raise ValueError("--cache needs a denoising loop to act on: add --steps N (N >= 2)")
    reason = CACHES[name].fails_on.get(model_class)
    if reason is not None:
        raise ValueError(f"--cache {name} fails on {model_class} in diffusers itself ({reason}); "
                         f"choose another cache")


@contextlib.contextmanager
def enabled(model: Any, name: Optional[str]) -> Iterator[None]:
    """`model` with a fresh cache `name` for the length of the block (nothing when `name` is None)."""
    if name is None:
        yield
        return
    import diffusers.hooks as dh
    from diffusers.hooks import HookRegistry
    from diffusers.hooks.hooks import CacheContext, _set_cache_context

    cache = CACHES[name]
    getattr(dh, cache.apply)(model, cache.config())
    _set_cache_context(model, CacheContext("cond"))
    try:
        yield
    finally:
        _set_cache_context(model, None)
        registry = HookRegistry.check_if_exists_or_initialize(model)
        for hook in cache.hooks:
            registry.remove_hook(hook, recurse=True)
