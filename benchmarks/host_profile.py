"""Where an eager forward's host time goes, with and without ToMe: cProfile over a few forwards of one model at real
width (the GPU report's models), each function's own time, ToMe's modules apart. On a GPU the forward is timed with
one synchronisation at its end, as a user's loop runs it; cProfile adds its own overhead to every Python call, so
read the shares, not the absolute times.

    python benchmarks/host_profile.py --arch sdxl --res 1024 --dtype float16 --device cuda
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch

import tomesd
from tomesd.bench.kits.pick import make_kit


def timed(kit, forward, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        kit.sync()
        started = time.perf_counter()
        forward()
        kit.sync()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def profile(forward, kit, calls: int, top: int, title: str) -> None:
    profiler = cProfile.Profile()
    kit.sync()
    profiler.enable()
    for _ in range(calls):
        forward()
    kit.sync()
    profiler.disable()
    stats = pstats.Stats(profiler)
    total = stats.total_tt / calls
    ours = sum(row[2] for key, row in stats.stats.items() if "tome" in key[0]) / calls
    print(f"\n## {title}: {total * 1e3:.1f} ms of profiled host time per forward, ToMe's own functions "
          f"{ours * 1e3:.1f} ms")
    stats.sort_stats("tottime").print_stats(top)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--arch", default="sdxl")
    parser.add_argument("--res", type=int, default=1024)
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--depth", type=int, default=None)
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    kit = make_kit("torch", args.device, args.dtype)
    from tomesd.bench.arguments import ARCH_NAMES

    config = ARCH_NAMES.get(args.arch, args.arch)  # --arch as the bench takes it, or a config name (tiny)
    model = kit.build(config, 0, args.depth)
    inputs = kit.inputs(config, 2, args.res, 0)
    forward = lambda: kit.forward(model, inputs)  # noqa: E731
    with torch.no_grad():
        for _ in range(3):
            forward()
        base = timed(kit, forward, 7)
        profile(forward, kit, args.calls, args.top, f"{args.arch} {args.res} unpatched")
        tomesd.apply_patch(model, ratio=args.ratio)
        for _ in range(3):
            forward()
        ours = timed(kit, forward, 7)
        profile(forward, kit, args.calls, args.top, f"{args.arch} {args.res} ToMe r={args.ratio}")
        tomesd.remove_patch(model)
        again = timed(kit, forward, 7)
    print(f"\nwall per forward: unpatched {base * 1e3:.1f} ms, ToMe {ours * 1e3:.1f} ms ({base / ours:.2f}x), "
          f"unpatched again {again * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
