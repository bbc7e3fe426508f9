"""`python -m tomesd quality`: what each setting costs in quality, and buys in speed, on the
project's own class-conditional digits models (proxies for SD, see the README): `--arch sd1` (default) the UNet,
`--arch sdxl` a UNet with SDXL's structure, `--arch sd3` the SD3-shaped joint-attention transformer, `--arch video`
AnimateDiff's motion UNet on moving digits, `--arch wan` Wan's space-time transformer on the same clips. `--cache`
adds one of diffusers' step caches, alone and stacked under each setting.

This module is the command (its options and its run); the settings priced are in settings.py, how they are
sampled and scored in evaluation.py, the table, JSON and plot in report.py (their names are handed on here).
"""
from __future__ import annotations

from typing import Any

from ..bench.kits.caches import CACHES
from . import model as M
from . import sampling
from .evaluation import Result, evaluate, labels_for
from .report import SCHEMA, table, write_json, write_plot
from .settings import (DEFAULT_SETTINGS, SD3_SETTINGS, SDXL_SETTINGS, SETTINGS, VIDEO_SETTINGS, WAN_SETTINGS, Setting,
                       with_cache)

__all__ = ["DEFAULT_SETTINGS", "SCHEMA", "SD3_SETTINGS", "SDXL_SETTINGS", "SETTINGS", "VIDEO_SETTINGS", "WAN_SETTINGS",
           "Result", "Setting", "add_arguments", "evaluate", "labels_for", "run", "table", "with_cache", "write_json",
           "write_plot"]


def add_arguments(parser: Any) -> None:
    parser.add_argument("--arch", choices=M.ARCHS, default="sd1",
                        help="the yardstick model: sd1 (the digits UNet, default), sdxl (a UNet with SDXL's "
                             "structure), sd3 (the SD3-shaped transformer), video (AnimateDiff's motion UNet on moving "
                             "digits, 8 frames) or wan (Wan's transformer on the same clips, one space-time grid)")
    parser.add_argument("--cache", metavar="NAME[,NAME...]", default=None,
                        help=f"also run diffusers' step caches ({', '.join(CACHES)}), each alone and stacked under "
                             "each setting; fbc:T and magcache:T set the skip threshold T")
    parser.add_argument("--images", type=int, default=64, help="samples per setting (labels 0-9 in turn)")
    parser.add_argument("--chunk", type=int, default=16, help="images per sampling call (x2 with guidance)")
    parser.add_argument("--steps", type=int, default=sampling.STEPS,
                        help="sampling steps (DDIM for the UNets, Euler for the transformers)")
    parser.add_argument("--noise-seeds", type=int, default=3, help="baseline runs from distinct noise (the noise band)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", metavar="NAMES", help="comma-separated setting names (default: all)")
    parser.add_argument("--fd-curve", metavar="N,N,...", default=None,
                        help="also measure FD's resolution against the sample count: FD of each setting and of the "
                             "baseline from every noise seed over the first N samples, for each N (the largest sets "
                             "--images); image yardsticks only")
    parser.add_argument("--json", metavar="PATH", default="quality-out/quality.json")
    parser.add_argument("--plot", metavar="PATH", default="quality-out/quality.png")
    parser.add_argument("--weights", metavar="PATH", default=None, help="default: the shipped file for --arch")


def run(args: Any) -> int:
    import sys

    try:
        for name in ("images", "chunk", "steps", "noise_seeds"):
            if getattr(args, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
        if args.noise_seeds < 2:
            raise ValueError("--noise-seeds must be at least 2: the noise band needs a second baseline")
        counts = None
        if args.fd_curve:
            try:
                counts = sorted({int(n) for n in args.fd_curve.split(",")})
            except ValueError:
                raise ValueError(f"--fd-curve takes sample counts like 64,256,1024, got {args.fd_curve!r}") from None
            if counts[0] < 2:
                raise ValueError("--fd-curve: every count must be at least 2 (FD fits a covariance)")
            if M.spec(args.arch).frames is not None:
                raise ValueError("--fd-curve: the video yardstick has no FD (its classifier reads centred digits)")
            args.images = counts[-1]
        settings = SETTINGS[args.arch]
        if args.only:
            wanted = [n.strip() for n in args.only.split(",")]
            unknown = [n for n in wanted if n not in {s.name for s in settings}]
            if unknown:
                raise ValueError(f"--only: unknown settings {unknown}; known: {[s.name for s in settings]}")
            settings = [settings[0]] + [s for s in settings[1:] if s.name in wanted]
        from ..bench.kits import caches

        picked = caches.names(args.cache)
        caches.check(picked, M.spec(args.arch).host, "torch", False, args.steps)
        settings = with_cache(settings, picked)
        if args.plot:
            import matplotlib  # noqa: F401  (checked before the work, not after)
        models = M.load(args.weights, args.arch)
    except (ValueError, FileNotFoundError, ImportError) as exc:
        print(f"tomesd quality: error: {exc}", file=sys.stderr)
        return 2
    from ..bench.progress import progress_bar

    chunks = -(-args.images // args.chunk)
    with progress_bar(chunks * (len(settings) + args.noise_seeds - 1), "sampling chunks") as bar:
        report = evaluate(settings, args.images, args.chunk, args.steps, args.noise_seeds, args.seed, models, bar.update,
                          args.arch)
    sampler = "DDIM" if M.spec(args.arch).objective == "epsilon" else "flow-matching Euler"
    unit = "digits" if M.spec(args.arch).frames is None else f"{M.spec(args.arch).frames}-frame clips"
    print(f"\nyardstick ({args.arch}): {args.images} {unit} per setting, {args.steps} {sampler} steps, guidance "
          f"{sampling.GUIDANCE}, batch {2 * args.chunk} per denoiser call; times are sums over interleaved chunks")
    print(table(report))
    if counts:
        from . import fd_curve

        samples = {s.name: report["samples"][s.name] for s in settings[1:]}
        report["fd_curve"] = fd_curve.curve(samples, [report["samples"][settings[0].name]]
                                            + report["baselines_other_noise"], report["classifier"],
                                            report["real_features"], counts)
        print(f"\nFD against the sample count (the band: the baseline's FD from {args.noise_seeds} noise seeds, "
              f"largest difference):")
        print(fd_curve.table(report["fd_curve"]))
    if args.json:
        write_json(args.json, report)
        print(f"results: {args.json}")
    if args.plot:
        write_plot(args.plot, report)
        print(f"plot: {args.plot}")
    return 0
