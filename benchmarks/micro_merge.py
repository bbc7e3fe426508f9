"""Micro-benchmark: match + merge + unmerge, ours against the reference implementations.

Times one block's ToMe work at SD1.5's top level (B=2, N=4096, C=320, 64x64 grid, r=N/2) and at
1024^2 (N=16384, 128x128), no random dst, interleaved in one run so the ratios are fair.
    python benchmarks/micro_merge.py --backend torch     # vs tomesd 0.1.3
    python benchmarks/micro_merge.py --backend paddle    # vs ppdiffusers' built-in
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHAPES = [("512^2 (N=4096)", 64, 64), ("1024^2 (N=16384)", 128, 128)]


def time_it(fn, repeats: int) -> float:
    fn()  # warm-up
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=["torch", "paddle"], default="torch")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=3, help="ours/reference alternations per shape")
    opts = parser.parse_args()

    from tome_core import bipartite_soft_matching_random2d as ours

    if opts.backend == "torch":
        import torch

        from tomesd.bench.kits.references import load_tomesd_ref

        reference, ref_name = load_tomesd_ref().merge.bipartite_soft_matching_random2d, "tomesd 0.1.3"
        randn, tanh = (lambda *s: torch.randn(*s)), torch.tanh
        torch.set_grad_enabled(False)
    else:
        import paddle

        from ppdiffusers.patches.tomesd_patch_utils import bipartite_soft_matching_random2d as reference

        ref_name = "ppdiffusers 0.29"
        randn, tanh = (lambda *s: paddle.randn(list(s))), paddle.tanh
        paddle.set_grad_enabled(False)

    print(f"| shape | {ref_name}: total (ms) | ours: total (ms) | total ratio | {ref_name}: merge+unmerge (ms) | ours: merge+unmerge (ms) | merge+unmerge ratio |")
    print("|---|---|---|---|---|---|---|")
    for label, h, w in SHAPES:
        n = h * w
        x = randn(2, n, 320)

        def total(fn):
            def run():
                m, u = fn(x, w, h, 2, 2, n // 2, no_rand=True)
                return u(tanh(m(x)))
            return run

        def hot_path(fn):
            m, u = fn(x, w, h, 2, 2, n // 2, no_rand=True)
            return lambda: u(tanh(m(x)))

        times = {key: [] for key in ("ref", "ours", "ref_hot", "ours_hot")}
        for _ in range(opts.rounds):
            times["ref"].append(time_it(total(reference), opts.repeats))
            times["ours"].append(time_it(total(ours), opts.repeats))
            times["ref_hot"].append(time_it(hot_path(reference), opts.repeats))
            times["ours_hot"].append(time_it(hot_path(ours), opts.repeats))
        t = {key: statistics.median(v) * 1e3 for key, v in times.items()}
        print(
            f"| {label} | {t['ref']:.1f} | {t['ours']:.1f} | {t['ours'] / t['ref']:.2f}x "
            f"| {t['ref_hot']:.1f} | {t['ours_hot']:.1f} | {t['ours_hot'] / t['ref_hot']:.2f}x |",
            flush=True,
        )


if __name__ == "__main__":
    main()
