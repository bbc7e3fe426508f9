"""`python -m tomesd bench` (the benchmark), `python -m tomesd quality` (what each setting costs in quality,
on the project's yardstick), `python -m tomesd tune` (the fastest setting that keeps the images close, on
this machine) and `python -m tomesd demo` (what ToMe merges, at a glance)."""
from __future__ import annotations

import argparse
import sys
import time
from typing import List, Optional

from .bench.kits.configs import CONFIGS, TEXT_TOKENS
from .bench.measures.tokens import token_counter

def demo(res: int, ratio: float, batch: int, seed: int, config: str = "sd15") -> None:
    import torch
    from diffusers import UNet2DConditionModel

    import tomesd

    torch.manual_seed(seed)
    print(f"building the {config} UNet architecture with random weights (nothing is downloaded) ...", flush=True)
    unet = UNet2DConditionModel(**CONFIGS[config]).eval()
    latent = res // 8
    x = torch.randn(batch, 4, latent, latent)
    t, context = torch.tensor(500), torch.randn(batch, TEXT_TOKENS, CONFIGS[config]["cross_attention_dim"])

    def run() -> tuple:
        with token_counter(unet, "torch") as seen:
            start = time.perf_counter()
            with torch.no_grad():
                out = unet(x, t, context).sample
            return out, time.perf_counter() - start, list(seen)

    base, base_s, base_tokens = run()
    tomesd.apply_patch(unet, ratio=ratio, seed=seed)
    merged, tome_s, tome_tokens = run()
    tomesd.remove_patch(unet)
    restored, _, _ = run()

    print(f"\n{res}x{res} image, batch {batch}, ratio {ratio}: self-attention tokens per block (before -> after)")
    for (name, before), (_, after) in zip(base_tokens, tome_tokens):
        note = f"  merged {before - after} ({(before - after) / before:.0%})" if after != before else ""
        print(f"  {name:<55} {before:>6} -> {after:<6}{note}")
    rel = ((merged - base).norm() / base.norm()).item()
    print(f"\nUNet forward: {base_s:.2f} s without ToMe, {tome_s:.2f} s with ToMe ({base_s / tome_s:.2f}x; one run, not a benchmark)")
    print(f"relative change of the UNet output: {rel:.3f}; after remove_patch: {(restored - base).abs().max().item():.1e}")


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tomesd", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    from .bench.cli import add_arguments, run

    add_arguments(sub.add_parser("bench", help="time and measure ToMe on a UNet built from its config"))
    from .quality import yardstick

    yardstick.add_arguments(sub.add_parser("quality", help="price each setting's quality on the built-in digits yardstick"))
    from . import tune

    from . import frontier

    frontier.add_arguments(sub.add_parser("frontier", help="every setting's closeness (quality) against its speed at "
                                                           "real width (bench), the Pareto front marked"))
    tune.add_arguments(sub.add_parser("tune", help="find the fastest setting on this machine (and, with --model, "
                                                   "your weights) that keeps the images close"))
    d = sub.add_parser("demo", help="patch a built-in SD1.5-architecture UNet and print what merged")
    d.add_argument("--res", type=int, default=256, help="image side in pixels (latent = res/8)")
    d.add_argument("--ratio", type=float, default=0.5)
    d.add_argument("--batch", type=int, default=2)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--config", choices=sorted(CONFIGS), default="sd15", help="UNet architecture (default: SD1.5's)")
    args = parser.parse_args(argv)
    if args.command == "bench":
        sys.exit(run(args))
    if args.command == "quality":
        sys.exit(yardstick.run(args))
    if args.command == "tune":
        sys.exit(tune.run(args))
    if args.command == "frontier":
        sys.exit(frontier.run(args))
    demo(args.res, args.ratio, args.batch, args.seed, args.config)
