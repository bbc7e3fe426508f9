"""`tomesd bench --context-parallel N`: the chosen transformer run context-parallel on N local processes
(diffusers' `enable_parallelism(ContextParallelConfig(...))`; gloo on CPU, NCCL on CUDA GPUs, one GPU a
process), the baseline beside ToMe at each ratio, each rank merging within its own band (tome_core/bands.py).

Per configuration: the time of one call (rank 0's wall clock between barriers, median over the rounds; the
configurations take turns in every round), the image tokens one rank's first attention takes in, and the
elements and bytes every rank hands to collectives in one call (all-to-all for Ulysses, all-gather for ring
and for the output), counted op by op with a dispatch mode, so they are exact on any machine.

On CPU, diffusers' context parallelism needs two stand-ins that `cpu_stand_ins` installs in the bench's own
processes (the patch itself needs neither): a device count for `rank % device_count` (0 on CPU), and an
attention op that returns its log-sum-exp, which ring attention needs and the NATIVE backend, the only
context-parallel one on CPU, refuses to give.
"""
from __future__ import annotations

import json
import os
import socket
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any, List, Optional, Tuple

# The bench's denoisers to which diffusers gives a context-parallel plan.
PLANNED = ("FluxTransformer2DModel", "WanTransformer3DModel")
ATTENTIONS = ("ulysses", "ring")


@dataclass(frozen=True)
class CPSettings:
    config: str
    processes: int
    attention: str = "ulysses"
    depth: Optional[int] = None
    res: int = 512
    width: int = 0
    batch: int = 1
    ratios: Tuple[float, ...] = (0.5,)
    frames: int = 17
    repeats: int = 3
    warmup: int = 1
    device: str = "cpu"
    dtype: str = "float32"
    seed: int = 0


@dataclass
class CPRow:
    method: str  # baseline | tome
    ratio: Optional[float]
    times_s: List[float] = field(default_factory=list)
    time_s: float = float("nan")
    speedup: float = float("nan")
    tokens_per_rank: int = 0  # image tokens into the first attention of one rank
    collective_elements: int = 0  # per rank per call: elements handed to collectives
    collective_bytes: int = 0


def check(model_class: str, processes: int, attention: str, backend: str, compile: bool, caches: tuple) -> None:
    """ValueError, in the user's terms, for a context-parallel run this bench cannot make."""
    if model_class not in PLANNED:
        raise ValueError(f"--context-parallel runs diffusers' context-parallel plans, which {model_class} has none "
                         f"of: use --arch flux or --arch wan")
    if processes < 2:
        raise ValueError("--context-parallel N needs N >= 2 processes")
    if attention not in ATTENTIONS:
        raise ValueError(f"--cp-attention: choose {' or '.join(ATTENTIONS)}")
    if backend != "torch" or compile or caches:
        raise ValueError("--context-parallel runs eager torch without caches: drop --backend paddle, --compile "
                         "and --cache")


def cpu_stand_ins() -> None:
    """What diffusers' context parallelism lacks on CPU (see the module's docstring)."""
    import torch
    from diffusers.models import attention_dispatch

    torch.accelerator.device_count = lambda: 1

    def native_with_lse(ctx, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                        enable_gqa=False, return_lse=False, _save_ctx=True, _parallel_config=None):
        q, k, v = (x.permute(0, 2, 1, 3) for x in (query, key, value))
        scores = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
        out = (torch.softmax(scores, -1) @ v).permute(0, 2, 1, 3)
        return (out, torch.logsumexp(scores, -1).permute(0, 2, 1)) if return_lse else out

    attention_dispatch._native_attention_forward_op = native_with_lse


def collective_counter() -> Any:
    """A dispatch mode adding up the elements and bytes of every collective's input (c10d functional ops)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Collectives(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.elements = self.bytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "_c10d_functional" and "wait" not in func.__name__:
                for arg in args:
                    if isinstance(arg, torch.Tensor):
                        self.elements += arg.numel()
                        self.bytes += arg.numel() * arg.element_size()
            return func(*args, **(kwargs or {}))

    return Collectives()


def free_port() -> int:
    """A free TCP port on the loopback, for the processes' rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _first_attention_input(model: Any) -> Any:
    for name, module in model.named_modules():
        if name.endswith(("attn.to_q", "attn1.to_q")):
            return module
    raise ValueError(f"{type(model).__name__} has no attention to count tokens at")


def _worker(rank: int, settings: CPSettings, port: int, out_path: str) -> None:
    import torch
    import torch.distributed as dist

    import tomesd
    from diffusers import ContextParallelConfig

    from .kits.torch_kit import TorchKit

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    on_gpu = settings.device in ("cuda", "gpu")
    if on_gpu:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if on_gpu else "gloo", rank=rank, world_size=settings.processes)
    try:
        if not on_gpu:
            cpu_stand_ins()
        kit = TorchKit(f"cuda:{rank}" if on_gpu else "cpu", settings.dtype)
        model = kit.build(settings.config, settings.seed, settings.depth)
        degree = {f"{settings.attention}_degree": settings.processes}
        model.enable_parallelism(config=ContextParallelConfig(**degree))
        x, t, c, extra = kit.inputs(settings.config, settings.batch, settings.res, settings.seed, settings.frames,
                                    settings.width or None)
        seen: List[int] = []
        _first_attention_input(model).register_forward_pre_hook(lambda m, a: seen.append(a[0].shape[1]))
        rows = [CPRow("baseline", None)] + [CPRow("tome", ratio) for ratio in settings.ratios]

        def call() -> Any:
            with torch.no_grad():
                return model(hidden_states=x, timestep=t.expand(x.shape[0]), encoder_hidden_states=c,
                             return_dict=False, **extra)[0]

        def run_as(row: CPRow, fn: Any) -> Any:
            if row.method == "tome":
                tomesd.apply_patch(model, ratio=row.ratio)
            try:
                return fn()
            finally:
                tomesd.remove_patch(model)

        for row in rows:  # one call each: tokens, and what the collectives move
            seen.clear()
            counter = collective_counter()
            with counter:
                run_as(row, call)
            row.tokens_per_rank, row.collective_elements, row.collective_bytes = seen[0], counter.elements, counter.bytes
        for round_ in range(settings.warmup + settings.repeats):
            for row in rows[round_ % len(rows):] + rows[:round_ % len(rows)]:  # each round starts elsewhere
                def timed_call() -> float:
                    dist.barrier()
                    kit.sync()
                    start = time.perf_counter()
                    call()
                    kit.sync()
                    dist.barrier()
                    return time.perf_counter() - start

                elapsed = run_as(row, timed_call)
                if round_ >= settings.warmup:
                    row.times_s.append(elapsed)
        if rank == 0:
            for row in rows:
                row.time_s = statistics.median(row.times_s)
                row.speedup = rows[0].time_s / row.time_s
            with open(out_path, "w") as f:
                json.dump([asdict(row) for row in rows], f)
    finally:
        dist.destroy_process_group()


def run(settings: CPSettings) -> List[CPRow]:
    """Spawn the processes, run every configuration on all of them, return rank 0's rows."""
    import torch.multiprocessing as mp

    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "rows.json")
        mp.start_processes(_worker, args=(settings, port, out_path), nprocs=settings.processes, join=True,
                           start_method="spawn")
        with open(out_path) as f:
            return [CPRow(**row) for row in json.load(f)]


def table(settings: CPSettings, rows: List[CPRow]) -> str:
    base = rows[0]
    lines = ["| configuration | time per call (s) | speed-up | image tokens into attention per rank | "
             "collective elements per rank per call | collective MiB per rank per call | communication saved |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        name = "baseline" if row.method == "baseline" else f"ToMe (ours) r={row.ratio:g}"
        saved = 1 - row.collective_bytes / base.collective_bytes if base.collective_bytes else float("nan")
        lines.append(f"| {name} | {row.time_s:.3f} | {row.speedup:.2f}x | {row.tokens_per_rank} | "
                     f"{row.collective_elements:,} | {row.collective_bytes / 2 ** 20:.2f} | {saved:.0%} |")
    return "\n".join(lines)
