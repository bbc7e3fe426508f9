"""diffusers' context parallelism on CPU: P spawned processes over gloo, each running the same cases.

Stand-ins, never in the patch's runtime: the bench's own two for diffusers' context parallelism on CPU
(`tomesd.bench.context_parallel.cpu_stand_ins`, which `tomesd bench --context-parallel` installs in its
processes too):
- `torch.accelerator.device_count()` is 0 on CPU and diffusers takes `rank % device_count` for the device;
- the NATIVE attention backend (the only context-parallel one on CPU) refuses `return_lse=True`, which ring
  attention needs: its forward op is replaced by one returning (out, lse);
and, for these tests alone:
- models are called with `return_dict=False` (the gathered output is a tuple);
- diffusers 0.42's tensor parallelism names the accelerators it runs on; "cpu" is added (gloo runs DTensor).

`run(world, cases, out_dir)` runs `cases` (names of functions in tests/parallel_cases.py, each returning a dict
of tensors; one that raises reports its traceback as a string) on `world` processes and returns every rank's
results.
"""
from __future__ import annotations

import os
import sys
import traceback
from typing import Any, Callable, Dict, List

import torch

from tomesd.bench.context_parallel import cpu_stand_ins, free_port


def shim_cpu_context_parallelism() -> None:
    cpu_stand_ins()  # the device count and ring attention's log-sum-exp (tomesd/bench/context_parallel.py)
    # diffusers 0.42 lets tensor parallelism run on accelerators only; gloo and DTensor run it on CPU as well.
    from diffusers.hooks import tensor_parallel

    tensor_parallel._SUPPORTED_TP_DEVICES = (*tensor_parallel._SUPPORTED_TP_DEVICES, "cpu")


def _worker(rank: int, world: int, port: int, cases: List[str], out_dir: str, path: List[str]) -> None:
    sys.path[:0] = [p for p in path if p not in sys.path]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    try:
        shim_cpu_context_parallelism()
        import parallel_cases

        results: Dict[str, Any] = {}
        for name in cases:
            try:
                results[name] = getattr(parallel_cases, name)(world)
            except Exception as exc:  # reported, not raised: the other ranks must not hang in a collective
                results[name] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-2000:]}"
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        torch.distributed.destroy_process_group()


def run(world: int, cases: List[str], out_dir: str) -> List[Dict[str, Any]]:
    """Each rank's results of `cases` on `world` gloo processes."""
    import torch.multiprocessing as mp

    mp.start_processes(_worker, args=(world, free_port(), cases, str(out_dir), list(sys.path)), nprocs=world,
                       join=True, start_method="spawn")
    return [torch.load(os.path.join(out_dir, f"rank{rank}.pt")) for rank in range(world)]


def count_tokens(modules: Dict[str, torch.nn.Module]) -> Callable[[], Dict[str, List[int]]]:
    """Token counts reaching each named module's input, per call (pre-hooks in `Module.__call__`)."""
    seen: Dict[str, List[int]] = {name: [] for name in modules}
    for name, module in modules.items():
        module.register_forward_pre_hook(lambda m, a, name=name: seen[name].append(a[0].shape[1]))
    return lambda: seen
