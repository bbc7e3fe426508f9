"""diffusers' context parallelism on CPU: P spawned processes over gloo, each running the same cases.

Test-only shims (never in the library), as the issue that asked for these tests found them:
- `torch.accelerator.device_count()` is 0 on CPU and diffusers takes `rank % device_count` for the device;
- the NATIVE attention backend (the only context-parallel one on CPU) refuses `return_lse=True`, which ring
  attention needs: its forward op is replaced by one returning (out, lse);
- models are called with `return_dict=False` (the gathered output is a tuple);
- diffusers 0.42's tensor parallelism names the accelerators it runs on; "cpu" is added (gloo runs DTensor).

`run(world, cases, tmp_path)` runs `cases` (names of functions in this module's CASES, each returning a dict of
tensors or an error message) on `world` processes and returns rank 0's results; every rank returns its own
tokens-into-attention counts under "tokens/<rank>".
"""
from __future__ import annotations

import os
import socket
import sys
import traceback
from typing import Any, Callable, Dict, List

import torch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shim_cpu_context_parallelism() -> None:
    torch.accelerator.device_count = lambda: 1
    from diffusers.models import attention_dispatch as ad

    def forward(ctx, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
                return_lse=False, _save_ctx=True, _parallel_config=None):
        q, k, v = (x.permute(0, 2, 1, 3) for x in (query, key, value))
        scores = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
        out = (torch.softmax(scores, -1) @ v).permute(0, 2, 1, 3)
        return (out, torch.logsumexp(scores, -1).permute(0, 2, 1)) if return_lse else out

    ad._native_attention_forward_op = forward
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

    mp.start_processes(_worker, args=(world, _free_port(), cases, str(out_dir), list(sys.path)), nprocs=world,
                       join=True, start_method="spawn")
    return [torch.load(os.path.join(out_dir, f"rank{rank}.pt")) for rank in range(world)]


def count_tokens(modules: Dict[str, torch.nn.Module]) -> Callable[[], Dict[str, List[int]]]:
    """Token counts reaching each named module's input, per call (pre-hooks in `Module.__call__`)."""
    seen: Dict[str, List[int]] = {name: [] for name in modules}
    for name, module in modules.items():
        module.register_forward_pre_hook(lambda m, a, name=name: seen[name].append(a[0].shape[1]))
    return lambda: seen
