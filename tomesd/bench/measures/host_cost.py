"""One forward's host work, counted on any machine: the ops it dispatches (in eager CUDA each is a kernel launch)
and the Python functions it calls (the interpretive work around them), for the model alone and for what ToMe
adds per block it reduces. No GPU and no clock: the counts are the same on every machine and every run.

Launches are the aten ops a forward dispatches, views and pure metadata left out (they launch nothing); Python
calls are `sys.setprofile`'s "call" events (calls of Python functions; calls of C functions such as torch's own
ops are not counted).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional

# Ops that allocate or relabel and launch no kernel.
_NO_KERNEL = frozenset({
    "aten.empty.memory_format", "aten.empty_strided.default", "aten.empty_like.default", "aten.detach.default",
    "aten.lift_fresh.default", "aten.sym_size.int", "aten.sym_stride.int", "aten.sym_numel.default",
    "aten.is_same_size.default", "aten.set_.source_Storage_storage_offset", "aten._local_scalar_dense.default",
    "aten._unsafe_view.default",
})


@dataclass
class HostWork:
    """One forward's kernel launches and Python calls."""

    launches: int
    python_calls: int
    ops: Optional[Dict[str, int]] = None  # launches by op, when asked for

    def minus(self, other: "HostWork") -> "HostWork":
        return HostWork(self.launches - other.launches, self.python_calls - other.python_calls)

    def per(self, blocks: int) -> Dict[str, float]:
        blocks = max(blocks, 1)
        return {"launches": round(self.launches / blocks, 1), "python_calls": round(self.python_calls / blocks, 1)}


def count_launches(run: Callable[[], Any], by_op: bool = False) -> HostWork:
    """The ops `run()` dispatches that launch a kernel (views and metadata left out)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    counts: Dict[str, int] = {}

    class Launches(TorchDispatchMode):
        # Higher-order ops (flex attention's kernel) pass through here too: counted as one launch each, run as called;
        # an infra mode, so that flex attention's own torch.compile runs under it (dynamo refuses other modes)
        supports_higher_order_operators = True

        @classmethod
        def is_infra_mode(cls) -> bool:
            return True

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not getattr(func, "is_view", False) and str(func) not in _NO_KERNEL:
                name = str(func)
                counts[name] = counts.get(name, 0) + 1
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), Launches():
        run()
    return HostWork(sum(counts.values()), 0, dict(sorted(counts.items(), key=lambda kv: -kv[1])) if by_op else None)


def count_python_calls(run: Callable[[], Any]) -> int:
    """Calls of Python functions while `run()` runs (sys.setprofile's "call" events, this thread). The garbage
    collector is run before and held off during it: a collection inside would count the callbacks of whatever it
    frees (torch.compile's weak references to the tensors of graphs compiled earlier in the process), not the run's."""
    import gc

    count = [0]

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            count[0] += 1

    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(previous)
        if enabled:
            gc.enable()
    return count[0] - 1  # the first event is run() itself


def host_work(run: Callable[[], Any], by_op: bool = False) -> HostWork:
    """`run()`'s launches and Python calls (each from a run of its own, after one warm-up run: first calls
    import and cache)."""
    import torch

    with torch.no_grad():
        run()
        launches = count_launches(run, by_op)
        calls = count_python_calls(run)
    return HostWork(launches.launches, calls, launches.ops)


def reduced_blocks(model: Any, run: Callable[[], Any]) -> int:
    """The blocks of a patched `model` that reduced their tokens (merged, or downsampled keys) in one `run()`."""
    import tomesd

    with tomesd.observe(model) as seen:
        run()
    return len({(i, record.model) for record in seen.calls for i, block in record.blocks.items()
                if block.merge is not None})


def tome_host_cost(model: Any, run: Callable[[], Any], patch: Callable[[Any], Any], by_op: bool = False
                   ) -> Dict[str, Any]:
    """The model's own host work per forward and what `patch(model)` adds per block it reduces; the patch is
    removed after."""
    import tomesd

    own = host_work(run, by_op)
    patch(model)
    try:
        blocks = reduced_blocks(model, run)
        patched = host_work(run, by_op)
    finally:
        tomesd.remove_patch(model)
    added = patched.minus(own)
    out = {"own": {"launches": own.launches, "python_calls": own.python_calls}, "blocks": blocks,
           "added": {"launches": added.launches, "python_calls": added.python_calls},
           "per_block": added.per(blocks)}
    if by_op:
        out["added_ops"] = {k: v - (own.ops or {}).get(k, 0) for k, v in (patched.ops or {}).items()
                            if v != (own.ops or {}).get(k, 0)}
    return out


# The yardsticks: each model's real block structure (every block, every level) at a tiny width; batch 2 (one image
# with guidance) on an 8x8 latent, where compute is negligible and the host's work is what a forward costs.
NARROW: Dict[str, Dict[str, Any]] = {
    "sd1.5": dict(cls="UNet2DConditionModel", config=dict(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=2, block_out_channels=(32, 32, 64, 64),
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=16, attention_head_dim=8, norm_num_groups=8)),
    "sdxl": dict(cls="UNet2DConditionModel", config=dict(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=2, block_out_channels=(32, 32, 64),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        transformer_layers_per_block=(1, 2, 10), attention_head_dim=(2, 4, 8), cross_attention_dim=16,
        use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=8,
        projection_class_embeddings_input_dim=8 * 6 + 16, norm_num_groups=8)),
    "sd3": dict(cls="SD3Transformer2DModel", config=dict(
        sample_size=8, patch_size=2, in_channels=4, num_layers=24, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=16, caption_projection_dim=16, pooled_projection_dim=8, out_channels=4,
        pos_embed_max_size=16)),
    "flux": dict(cls="FluxTransformer2DModel", config=dict(
        patch_size=1, in_channels=16, num_layers=6, num_single_layers=12, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=16, pooled_projection_dim=16, guidance_embeds=True, axes_dims_rope=(4, 6, 6))),
    "wan": dict(cls="WanTransformer3DModel", config=dict(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
        text_dim=16, freq_dim=16, ffn_dim=64, num_layers=30, rope_max_seq_len=64)),
}
TEXT_TOKENS = 8


def build_narrow(name: str, seed: int = 0) -> Any:
    import diffusers
    import torch

    torch.manual_seed(seed)
    spec = NARROW[name]
    return getattr(diffusers, spec["cls"])(**spec["config"]).eval()


def narrow_inputs(name: str, batch: int = 2, side: int = 8, seed: int = 0) -> Dict[str, Any]:
    """Keyword inputs of one forward of NARROW[name] on a side x side latent (Flux: packed 2x2, so side/2 squared
    tokens; Wan: 2 latent frames)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    t = torch.tensor([500.0] * batch)
    if name in ("sd1.5", "sdxl"):
        out = dict(sample=rand(batch, 4, side, side), timestep=t, encoder_hidden_states=rand(batch, TEXT_TOKENS, 16))
        if name == "sdxl":
            out["added_cond_kwargs"] = {"text_embeds": rand(batch, 16), "time_ids": rand(batch, 6)}
        return out
    if name == "sd3":
        return dict(hidden_states=rand(batch, 4, side, side), timestep=t,
                    encoder_hidden_states=rand(batch, TEXT_TOKENS, 16), pooled_projections=rand(batch, 8))
    if name == "flux":
        s = side // 2
        ids = torch.zeros(s, s, 3)
        ids[..., 1] += torch.arange(s)[:, None]
        ids[..., 2] += torch.arange(s)[None, :]
        return dict(hidden_states=rand(batch, s * s, 16), timestep=t / 1000, guidance=torch.full((batch,), 3.5),
                    encoder_hidden_states=rand(batch, TEXT_TOKENS, 16), pooled_projections=rand(batch, 16),
                    img_ids=ids.reshape(-1, 3), txt_ids=torch.zeros(TEXT_TOKENS, 3))
    if name == "wan":
        return dict(hidden_states=rand(batch, 4, 2, side, side), timestep=t,
                    encoder_hidden_states=rand(batch, TEXT_TOKENS, 16))
    raise KeyError(name)
