"""diffusers' own step caches, run beside ToMe (`--cache NAME` in the loop bench and the yardstick): what
users pick instead of token reduction on diffusion transformers, and what they can stack with it.

Each cache is applied with diffusers' own `apply_*` function (SD3's transformer has no `enable_cache`
in diffusers 0.42) before the ToMe patch, given a cache context for the whole loop (one call per step,
the guidance halves batched), and removed after it, so every timed loop starts from a fresh cache. Caches
of attention outputs (TaylorSeer, FasterCache, Pyramid Attention Broadcast) keep full tokens under merge
mode: ToMe's hooks sit inside them (backends/torch_links.py). Caches of whole blocks (First Block Cache,
MagCache) skip blocks, and ToMe matches nothing for a skipped block.
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, Optional, Tuple


class StepClock:
    """The timestep the denoiser was last called with, on diffusers' 0-1000 scale: FasterCache and Pyramid
    Attention Broadcast decide by it (a pipeline passes its own `_current_timestep`; a bare loop has none)."""

    def __init__(self) -> None:
        self.value = 1000.0

    def __call__(self) -> float:
        return self.value

    def pre(self, module: Any, args: tuple, kwargs: dict) -> None:
        t = kwargs.get("timestep", args[1] if len(args) > 1 else None)
        if t is None:
            return
        value = float(t.reshape(-1)[0]) if hasattr(t, "reshape") else float(t)  # one host read per step
        self.value = value * 1000 if value <= 1.0 else value  # Flux takes sigmas (t / 1000)


# Every block attention of the transformers the bench builds: SD3's and Flux's `attn` (and SD3.5's `attn2`),
# Wan's and PixArt's `attn1` and `attn2`.
ATTENTIONS = r"(blocks|transformer_blocks|single_transformer_blocks)\.\d+\.attn\d?"


@dataclass(frozen=True)
class Cache:
    title: str
    config: Callable[[StepClock, int], Any]  # diffusers' config object for a loop of `steps`, with its settings
    apply: str  # diffusers.hooks' function
    hooks: Tuple[str, ...]  # the hook names it registers (removed by name)
    # Denoiser classes on which diffusers 0.42 itself fails with this cache, and why.
    fails_on: Dict[str, str]
    # The config field `--cache NAME:VALUE` sets (a skip threshold), and its value when none is given.
    knob: Optional[str] = None
    default: Optional[float] = None


def _fbc(clock: StepClock, steps: int) -> Any:
    from diffusers.hooks import FirstBlockCacheConfig

    # diffusers' default threshold. It skips a step when the first block's residual moved less than that since
    # the last computed step: a model whose residual moves more skips nothing (`fbc:0.2` raises it).
    return FirstBlockCacheConfig(threshold=0.05)


def _taylorseer(clock: StepClock, steps: int) -> Any:
    import torch
    from diffusers.hooks import TaylorSeerCacheConfig

    # diffusers' defaults (full steps 0-2, then one full step in 5), Taylor factors kept in float32. Its default
    # identifiers end in `attn` (fullmatch), which hooks nothing on Wan and PixArt (`attn1`, `attn2`): every
    # block attention is named here, the same modules as the default on SD3 and Flux.
    return TaylorSeerCacheConfig(taylor_factors_dtype=torch.float32, cache_identifiers=[ATTENTIONS])


def _fastercache(clock: StepClock, steps: int) -> Any:
    from diffusers.hooks import FasterCacheConfig
    from diffusers.hooks.faster_cache import _UNCOND_COND_INPUT_KWARGS_IDENTIFIERS

    # diffusers' documented example for CogVideoX / Flux: attention recomputed every 2nd step inside
    # timesteps (-1, 681). Its unconditional-batch skip halves the inputs it names: SD3's pooled text vector is
    # named too, which diffusers' default list leaves whole (a shape error inside SD3, without ToMe).
    return FasterCacheConfig(spatial_attention_block_skip_range=2, spatial_attention_timestep_skip_range=(-1, 681),
                             current_timestep_callback=clock, attention_weight_callback=lambda _: 0.3,
                             tensor_format="BCHW", _unconditional_conditional_input_kwargs_identifiers=(
                                 *_UNCOND_COND_INPUT_KWARGS_IDENTIFIERS, "pooled_projections"))


def _pab(clock: StepClock, steps: int) -> Any:
    from diffusers.hooks import PyramidAttentionBroadcastConfig

    # diffusers' documented example: spatial attention recomputed every 2nd step inside timesteps (100, 800).
    return PyramidAttentionBroadcastConfig(spatial_attention_block_skip_range=2,
                                           spatial_attention_timestep_skip_range=(100, 800),
                                           current_timestep_callback=clock)


def _magcache(clock: StepClock, steps: int) -> Any:
    from diffusers.hooks import MagCacheConfig
    from diffusers.hooks.mag_cache import FLUX_MAG_RATIOS

    # Flux's calibrated magnitude ratios, the only ones diffusers ships (interpolated to the loop's length);
    # calibrate on your own model for real use (MagCacheConfig(calibrate=True)).
    return MagCacheConfig(num_inference_steps=steps, mag_ratios=FLUX_MAG_RATIOS)


_UNET = "diffusers' block registry does not describe UNet blocks (IndexError inside diffusers)"
CACHES: Dict[str, Cache] = {
    "fbc": Cache("First Block Cache", _fbc, "apply_first_block_cache",
                 ("fbc_leader_block_hook", "fbc_block_hook"),
                 {"SD3Transformer2DModel": "diffusers' tail residual subtracts the text output that SD3's last "
                                           "block (context_pre_only) returns as None",
                  "UNet2DConditionModel": _UNET}, knob="threshold", default=0.05),
    "taylorseer": Cache("TaylorSeer (diffusers' defaults)", _taylorseer, "apply_taylorseer_cache",
                        ("taylorseer_cache",), {}),
    "fastercache": Cache("FasterCache (attention every 2nd step below t=681)", _fastercache, "apply_faster_cache",
                         ("faster_cache_denoiser", "faster_cache_block"),
                         {"FluxTransformer2DModel": "a 4-D / 3-D concatenation in its unconditional-batch "
                                                    "approximation"}),
    "pab": Cache("Pyramid Attention Broadcast (attention every 2nd step in t=100-800)", _pab,
                 "apply_pyramid_attention_broadcast", ("pyramid_attention_broadcast",), {}),
    "magcache": Cache("MagCache with Flux's magnitude ratios", _magcache, "apply_mag_cache",
                      ("mag_cache_leader_block_hook", "mag_cache_block_hook"), {"UNet2DConditionModel": _UNET},
                      knob="threshold", default=0.06),
}


def _split(name: str) -> Tuple[str, Optional[float]]:
    """`fbc:0.2` -> ("fbc", 0.2); `fbc` -> ("fbc", None). ValueError in `--cache`'s terms."""
    base, sep, value = name.partition(":")
    if base not in CACHES:
        raise ValueError(f"--cache {name!r}: choose one or more of {', '.join(CACHES)}, comma-separated")
    if not sep:
        return base, None
    cache = CACHES[base]
    if cache.knob is None:
        tunable = [f"{other}:{c.knob.upper()}" for other, c in CACHES.items() if c.knob is not None]
        raise ValueError(f"--cache {name!r}: {base} takes no value; only {', '.join(tunable)} do")
    try:
        number = float(value)
    except ValueError:
        number = float("nan")
    if not number > 0:
        raise ValueError(f"--cache {name!r}: {base}'s {cache.knob} must be a positive number, as in {base}:"
                         f"{cache.default}")
    return base, number


def lookup(name: str) -> Cache:
    """The cache `--cache` names, with its knob set where the name gives a value (`fbc:0.2`); its title
    says the knob's value."""
    base, value = _split(name)
    cache = CACHES[base]
    if cache.knob is None:
        return cache
    chosen = cache.default if value is None else value

    def config(clock: StepClock, steps: int) -> Any:
        made = cache.config(clock, steps)
        setattr(made, cache.knob, chosen)
        return made

    return dataclasses.replace(cache, title=f"{cache.title} ({cache.knob} {chosen:g})", config=config)


def names(text: Optional[str]) -> Tuple[str, ...]:
    """`--cache`'s value: one cache or several, comma-separated (each is run alone and stacked, side by side)."""
    if text is None:
        return ()
    picked = tuple(dict.fromkeys(part.strip() for part in text.split(",")))
    if not picked or not all(picked):
        raise ValueError(f"--cache {text!r}: choose one or more of {', '.join(CACHES)}, comma-separated")
    for name in picked:
        _split(name)
    return picked


def check(picked: Tuple[str, ...], model_class: str, backend: str, compile: bool, steps: int) -> None:
    """ValueError, in the user's terms, for a cache this run cannot use on a `model_class` denoiser."""
    for name in picked:
        _check_one(name, model_class, backend, compile, steps)


def _check_one(name: str, model_class: str, backend: str, compile: bool, steps: int) -> None:
    if backend != "torch":
        raise ValueError("--cache runs diffusers' caches: torch only")
    if compile:
        raise ValueError("--cache is not compiled in this benchmark: drop --compile")
    if steps < 2:
        raise ValueError("--cache needs a denoising loop to act on: add --steps N (N >= 2)")
    reason = lookup(name).fails_on.get(model_class)
    if reason is not None:
        others = [other for other, cache in CACHES.items() if model_class not in cache.fails_on]
        raise ValueError(f"--cache {name} fails on {model_class} in diffusers itself ({reason}); "
                         f"choose another cache (none of {', '.join(others)} is known to fail there)")


@contextlib.contextmanager
def enabled(model: Any, name: Optional[str], steps: int = 50) -> Iterator[None]:
    """`model` with a fresh cache `name` for a loop of `steps` for the length of the block (nothing when
    `name` is None)."""
    if name is None:
        yield
        return
    import diffusers.hooks as dh
    from diffusers.hooks import HookRegistry
    from diffusers.hooks.hooks import CacheContext, _set_cache_context

    cache, clock = lookup(name), StepClock()
    handle = model.register_forward_pre_hook(clock.pre, with_kwargs=True)
    getattr(dh, cache.apply)(model, cache.config(clock, steps))
    registry = HookRegistry.check_if_exists_or_initialize(model)
    # The root's list of hooked modules is cached by the first cache context set on it; a cache of other modules
    # applied since (diffusers' `apply_*`, unlike `enable_cache`, leaves it) would get no context and raise.
    registry.invalidate_child_registries_cache()
    _set_cache_context(model, CacheContext("cond"))
    try:
        yield
    finally:
        _set_cache_context(model, None)
        handle.remove()
        for hook in cache.hooks:
            registry.remove_hook(hook, recurse=True)
        registry.invalidate_child_registries_cache()
