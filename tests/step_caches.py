"""diffusers' step caches on the tiny transformers, for the stacking tests: each cache's config (small
loops: 6 steps), how to apply and remove it, and a loop that records what the attentions computed."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Tuple

import torch

import tiny_torch as T

TIMESTEPS = [900, 800, 700, 600, 500, 400]


class Clock:
    """The timestep the caches' callbacks read (FasterCache, Pyramid Attention Broadcast)."""

    value = 0


def _taylorseer(kind: str) -> Any:
    from diffusers.hooks import TaylorSeerCacheConfig

    # diffusers' default identifiers end in `attn`: PixArt's and Wan's `attn1` / `attn2` need naming.
    names = {"pixart": [r"^transformer_blocks\.\d+\.attn[12]$"], "wan": [r"^blocks\.\d+\.attn[12]$"]}.get(kind)
    return TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=2, taylor_factors_dtype=torch.float32,
                                 cache_identifiers=names)


def _fastercache(kind: str) -> Any:
    from diffusers.hooks import FasterCacheConfig

    # SD3's pooled text vector is a guidance-batched input too (diffusers' default list knows video models').
    return FasterCacheConfig(
        spatial_attention_block_skip_range=2, spatial_attention_timestep_skip_range=(-1, 1000),
        current_timestep_callback=lambda: Clock.value, attention_weight_callback=lambda m: 0.5,
        unconditional_batch_skip_range=2, unconditional_batch_timestep_skip_range=(-1, 1000), tensor_format="BCHW",
        _unconditional_conditional_input_kwargs_identifiers=[
            "hidden_states", "encoder_hidden_states", "timestep", "pooled_projections"])


def _pab(kind: str) -> Any:
    from diffusers.hooks import PyramidAttentionBroadcastConfig

    return PyramidAttentionBroadcastConfig(
        spatial_attention_block_skip_range=2, spatial_attention_timestep_skip_range=(-1, 1000),
        cross_attention_block_skip_range=2, cross_attention_timestep_skip_range=(-1, 1000),
        current_timestep_callback=lambda: Clock.value)


def _magcache(kind: str) -> Any:
    from diffusers.hooks import MagCacheConfig

    # Ratios of 1.0: the accumulated error stays 0, so every step after the retained ones is skipped.
    return MagCacheConfig(threshold=0.5, num_inference_steps=len(TIMESTEPS), retention_ratio=0.34,
                          mag_ratios=[1.0] * len(TIMESTEPS))


def _fbc(kind: str) -> Any:
    from diffusers.hooks import FirstBlockCacheConfig

    return FirstBlockCacheConfig(threshold=10.0)  # random weights: always "close enough" to skip


@dataclass(frozen=True)
class Cache:
    config: Callable[[str], Any]
    apply: str
    hooks: Tuple[str, ...]
    layer_outputs: bool  # keeps attention outputs (else whole blocks' residuals)


CACHES: Dict[str, Cache] = {
    "taylorseer": Cache(_taylorseer, "apply_taylorseer_cache", ("taylorseer_cache",), True),
    "fastercache": Cache(_fastercache, "apply_faster_cache", ("faster_cache_denoiser", "faster_cache_block"), True),
    "pab": Cache(_pab, "apply_pyramid_attention_broadcast", ("pyramid_attention_broadcast",), True),
    "magcache": Cache(_magcache, "apply_mag_cache", ("mag_cache_leader_block_hook", "mag_cache_block_hook"), False),
    "fbc": Cache(_fbc, "apply_first_block_cache", ("fbc_leader_block_hook", "fbc_block_hook"), False),
}

# Pairs that fail without ToMe, in diffusers 0.42 itself, and why.
FAILS_IN_DIFFUSERS = {
    ("sd3", "fbc"): "the tail residual subtracts the text output SD3's last block returns as None",
    ("flux", "fastercache"): "a 4-D / 3-D concatenation in its unconditional-batch approximation",
}


def model(kind: str) -> torch.nn.Module:
    return {"sd3": lambda: T.transformer("sd3"), "pixart": lambda: T.transformer("pixart"),
            "flux": T.flux, "wan": T.wan}[kind]()


def inputs(kind: str, t: int) -> dict:
    if kind == "flux":
        return T.flux_inputs(t=t / 1000)
    if kind == "wan":
        return T.wan_inputs(t=float(t))
    return T.transformer_inputs(kind, t=float(t))


def run(kind: str, net: torch.nn.Module, x: dict) -> torch.Tensor:
    if kind == "flux":
        with torch.no_grad():
            return net(**x).sample
    if kind == "wan":
        return T.run_wan(net, x)
    return T.run_transformer(net, x)


def attentions(net: torch.nn.Module) -> List[torch.nn.Module]:
    """The image attentions of each block (the modules diffusers' attention caches hook)."""
    names = ("attn", "attn1")
    return [getattr(b, n) for b in net.modules() if type(b).__name__.endswith("Block")
            for n in names if getattr(b, n, None) is not None]


def apply(net: torch.nn.Module, kind: str, name: str) -> None:
    import diffusers.hooks as dh

    getattr(dh, CACHES[name].apply)(net, CACHES[name].config(kind))


def remove(net: torch.nn.Module, name: str) -> None:
    from diffusers.hooks import HookRegistry

    registry = HookRegistry.check_if_exists_or_initialize(net)
    for hook in CACHES[name].hooks:
        registry.remove_hook(hook, recurse=True)


def reset(net: torch.nn.Module) -> None:
    from diffusers.hooks import HookRegistry

    HookRegistry.check_if_exists_or_initialize(net).reset_stateful_hooks(recurse=True)


def loop(kind: str, net: torch.nn.Module) -> Tuple[List[torch.Tensor], List[List[int]], List[List[torch.Tensor]]]:
    """Run the 6 steps under a cache context: outputs; per step, the query tokens of each attention that
    computed (its `to_q` ran); per step, each image attention's output as the block sees it."""
    from diffusers.hooks.hooks import CacheContext, _set_cache_context

    outs, queries, seen = [], [], []
    handles = []
    for attn in attentions(net):
        handles.append(attn.to_q.register_forward_pre_hook(lambda m, a: queries[-1].append(a[0].shape[1])))
        handles.append(attn.register_forward_hook(
            lambda m, a, out: seen[-1].append((out[0] if isinstance(out, tuple) else out).detach().clone())))
    try:
        for t in TIMESTEPS:
            Clock.value = t
            queries.append([])
            seen.append([])
            _set_cache_context(net, CacheContext("cond"))
            outs.append(run(kind, net, inputs(kind, t)))
    finally:
        for handle in handles:
            handle.remove()
    return outs, queries, seen


def kept_token_counts(net: torch.nn.Module) -> set:
    """The token counts (dim 1) of every tensor the attention caches keep."""
    counts = set()

    def walk(value: Any, depth: int) -> None:
        if isinstance(value, torch.Tensor):
            if value.dim() >= 3:
                counts.add(value.shape[1])
        elif depth > 0 and isinstance(value, (list, tuple)):
            for item in value:
                walk(item, depth - 1)
        elif depth > 0 and isinstance(value, dict):
            for item in value.values():
                walk(item, depth - 1)
        elif depth > 0 and hasattr(value, "__dict__") and not isinstance(value, torch.nn.Module):
            for item in vars(value).values():
                walk(item, depth - 1)

    for attn in attentions(net):
        for hook in getattr(getattr(attn, "_diffusers_hook", None), "hooks", {}).values():
            if hook._is_stateful:
                walk(hook, 8)
    return counts
