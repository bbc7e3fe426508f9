"""What proportional attention's extra channel costs inside SDPA, per attention shape ToMe r=0.5 leaves at real width.

For each shape: torch's SDPA as unpatched (head size d), and proportional attention's call (KeyWeights: d plus the
bias channel, padded to the fused kernels' multiple on CUDA; d + 1 elsewhere), timed interleaved, with the aten
attention op each one dispatched. Run on the device the numbers are for:
    python benchmarks/sdpa_channel.py [--device cuda] [--dtype float16] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from tomesd.backends import torch_sdpa
from tomesd.backends.torch_sdpa import KeyWeights

# (model, batch, heads, head size, queries = keys after r=0.5 merging, text keys)
SHAPES = [
    ("SD1.5 1024² level 1", 2, 8, 40, 8192, 0),
    ("SD1.5 2048² level 1", 2, 8, 40, 32768, 0),
    ("SDXL 1024² level 2", 2, 10, 64, 2048, 0),
    ("SD3 1024² joint", 2, 24, 64, 2048, 333),
    ("Flux 1024² joint", 1, 24, 128, 2048, 512),
    ("Wan 480x832x17 self", 1, 40, 128, 9360, 0),
]


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "attention" in str(func):
            self.ops.append(str(func).replace("aten.", "").replace(".default", ""))
        return func(*args, **(kwargs or {}))


def _flex(q, k, v, bias):
    """FlexAttention adding each key's log-size to its scores (no mask tensor; its own compiled kernel)."""
    from torch.nn.attention.flex_attention import flex_attention

    compiled = torch.compile(flex_attention, dynamic=False)

    def add_bias(score, b, h, q_idx, kv_idx):
        return score + bias[b, kv_idx]

    failed = []

    def call():
        if failed:
            return None
        try:
            return compiled(q, k, v, score_mod=add_bias)
        except Exception as error:  # a head size or device the kernel does not take
            failed.append(error)
            print("flex failed:", type(error).__name__, str(error).splitlines()[0][:200])
            return None

    return call


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json")
    parser.add_argument("--scale-down", type=int, default=1, help="divide token counts (a quick CPU check)")
    parser.add_argument("--flex", action="store_true",
                        help="also FlexAttention with the weights as a score_mod (compiled; another kernel)")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype) if args.device != "cpu" else torch.float32
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    rows = []
    for name, batch, heads, size, tokens, text in SHAPES:
        tokens //= args.scale_down
        length = tokens + text
        q, k, v = (torch.randn(batch, heads, length, size, device=args.device, dtype=dtype) for _ in range(3))
        sizes = torch.randint(1, 5, (batch, tokens), device=args.device).float()
        weigh = KeyWeights(sizes.log(), False)
        calls = {"unpatched": lambda: F.scaled_dot_product_attention(q, k, v),
                 "proportional": lambda: weigh(F.scaled_dot_product_attention, q, k, v)}
        if args.device == "cpu":  # the CPU's choice (one channel) beside CUDA's (up to a multiple of 8)

            def padded_to_8():
                channels = torch_sdpa.channels
                torch_sdpa.channels = lambda size, device: 8 - size % 8
                try:
                    return weigh(F.scaled_dot_product_attention, q, k, v)
                finally:
                    torch_sdpa.channels = channels

            calls["proportional, padded to 8"] = padded_to_8
        if args.flex:
            calls["flex score_mod"] = _flex(q, k, v, F.pad(sizes.log(), (text, 0)).to(dtype))
        ops, times = {}, {key: [] for key in calls}
        for key, fn in calls.items():
            if key.startswith("flex"):  # a higher-order op no dispatch mode sees through
                ops[key] = ["flex_attention (compiled)"]
            else:
                with _Ops() as seen:
                    fn()
                ops[key] = seen.ops
            fn()
        sync()
        for _ in range(args.repeats):  # interleaved
            for key, fn in calls.items():
                sync()
                start = time.perf_counter()
                fn()
                sync()
                times[key].append(time.perf_counter() - start)
        best = {key: sorted(t)[len(t) // 2] * 1000 for key, t in times.items()}
        row = dict(shape=name, batch=batch, heads=heads, head_size=size, keys=length, ms=best, ops=ops,
                   cost=best["proportional"] / best["unpatched"])
        rows.append(row)
        print(f"{name:24s} d={size:3d} keys={length:6d}  " + "  ".join(
            f"{key} {ms:8.3f} ms {ops[key]} x{ms / best['unpatched']:.3f}" for key, ms in best.items()), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=str(torch.cuda.get_device_name() if sync is not None and args.device != "cpu"
                                      else "cpu"), dtype=str(dtype), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
