"""`python -m tomesd quality`: what each setting costs in quality, and buys in speed, on the
project's own class-conditional digits models (proxies for SD, see the README): `--arch sd1` (default)
the UNet, `--arch sd3` the SD3-shaped joint-attention transformer, `--arch video` AnimateDiff's motion
UNet on moving digits, `--arch wan` Wan's space-time transformer on the same clips. `--cache` adds one of
diffusers' step caches, alone and stacked under each setting.

Every setting samples the same labels from the same noise as the baseline, in chunks that are
interleaved across settings (alternating order), so timings are side by side. Scores:
- PSNR / SSIM against the baseline's samples from the same noise: how far the setting moves them;
- the classifier's accuracy on the conditioned label, and the Frechet distance (FD) of the
  classifier's features to those of all 1797 real digits: whether the samples are still right;
- the noise band: the baseline again from other noise seeds. A setting whose accuracy and FD differ
  from the baseline's by no more than the baseline differs from itself across seeds is "within noise".
Clips (`video`, `wan`) are scored frame by frame (PSNR, SSIM, and PSNR at each frame index) and for temporal
consistency (their frame-to-frame changes against the baseline's); the classifier reads centred digits,
so accuracy and FD are left out there.
"""
from __future__ import annotations

import copy
import json
import math
import os
import platform
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from ..bench.caches import CACHES
from . import metrics
from . import model as M
from . import sampling

SCHEMA = "tomesd-quality/1"


@dataclass(frozen=True)
class Setting:
    name: str
    kwargs: Optional[Dict[str, Any]]  # tomesd.apply_patch's arguments; None: unpatched
    cache: Optional[str] = None  # a diffusers step cache under the setting (bench.caches.CACHES)

    def __hash__(self) -> int:
        return hash(self.name)


DEFAULT_SETTINGS = [
    Setting("baseline", None),
    Setting("ToMe r=0.25", dict(ratio=0.25)),
    Setting("ToMe r=0.5", dict(ratio=0.5)),
    Setting("ToMe r=0.75", dict(ratio=0.75)),
    Setting("ToMe r=0.5 max_downsample=2", dict(ratio=0.5, max_downsample=2)),
    Setting("ToMe r=0.5 reuse 2", dict(ratio=0.5, reuse_steps=2)),
    Setting("ToMe r=0.5 reuse 3", dict(ratio=0.5, reuse_steps=3)),
    Setting("ToMe r=0.75 reuse 3", dict(ratio=0.75, reuse_steps=3)),
    Setting("ToMe r=0.5 share_across_blocks", dict(ratio=0.5, share_across_blocks=True)),
    Setting("downsample f=2 nearest", dict(mode="downsample")),
    Setting("downsample f=2 avg", dict(mode="downsample", downsample_method="avg")),
    Setting("downsample f=3 nearest", dict(mode="downsample", downsample_factor=3)),
    Setting("downsample f=2 nearest max_downsample=2", dict(mode="downsample", max_downsample=2)),
    # Every attention level (32x32, 16x16 and the 8x8 mid block): where this model leans on attention.
    Setting("ToMe r=0.5 max_downsample=4", dict(ratio=0.5, max_downsample=4)),
    Setting("ToMe r=0.5 max_downsample=4 reuse 3", dict(ratio=0.5, max_downsample=4, reuse_steps=3)),
    Setting("downsample f=2 nearest max_downsample=4", dict(mode="downsample", max_downsample=4)),
    # Ratios over the run's progress (tomesd #28), patched through a pipeline whose scheduler counts the steps.
    Setting("ToMe r=0.25 then 0.75 (schedule)", dict(ratio_schedule=[(0.0, 0.25), (0.5, 0.75)])),
    Setting("ToMe r=0.75 then 0.25 (schedule)", dict(ratio_schedule=[(0.0, 0.75), (0.5, 0.25)])),
]

# The SD3-shaped model: one 32x32 patch grid in every one of its 4 joint blocks (the last context_pre_only).
SD3_SETTINGS = [
    Setting("baseline", None),
    Setting("ToMe r=0.25", dict(ratio=0.25)),
    Setting("ToMe r=0.5", dict(ratio=0.5)),
    Setting("ToMe r=0.75", dict(ratio=0.75)),
    Setting("ToMe r=0.5 reuse 2", dict(ratio=0.5, reuse_steps=2)),
    Setting("ToMe r=0.5 reuse 3", dict(ratio=0.5, reuse_steps=3)),
    Setting("ToMe r=0.5 share_across_blocks", dict(ratio=0.5, share_across_blocks=True)),
    Setting("ToMe r=0.5 merge_mlp", dict(ratio=0.5, merge_mlp=True)),
    # Lower ratios with the feed-forward merged too: the candidates for "as close as r=0.5, and faster".
    Setting("ToMe r=0.4 merge_mlp", dict(ratio=0.4, merge_mlp=True)),
    Setting("ToMe r=0.3 merge_mlp", dict(ratio=0.3, merge_mlp=True)),
    Setting("ToMe r=0.75 blocks 1-3", dict(ratio=0.75, blocks=[1, 2, 3])),
    Setting("downsample f=2 nearest", dict(mode="downsample")),
    Setting("downsample f=2 avg", dict(mode="downsample", downsample_method="avg")),
    Setting("downsample f=3 nearest", dict(mode="downsample", downsample_factor=3)),
    Setting("downsample f=4 nearest", dict(mode="downsample", downsample_factor=4)),
    Setting("downsample f=4 avg", dict(mode="downsample", downsample_factor=4, downsample_method="avg")),
    # The band rule: what each rank of a 2- or 4-way context-parallel run merges (bands of 16 or 8 patch rows).
    Setting("ToMe r=0.5 bands=2", dict(ratio=0.5, bands=2)),
    Setting("ToMe r=0.5 bands=4", dict(ratio=0.5, bands=4)),
]
# The motion UNet: its spatial blocks merge within each frame (32x32, 16x16 and the 8x8 mid block, as on
# the image UNet); temporal blocks are never touched.
VIDEO_SETTINGS = [
    Setting("baseline", None),
    Setting("ToMe r=0.25", dict(ratio=0.25)),
    Setting("ToMe r=0.5", dict(ratio=0.5)),
    Setting("ToMe r=0.75", dict(ratio=0.75)),
    Setting("ToMe r=0.5 reuse 3", dict(ratio=0.5, reuse_steps=3)),
    Setting("ToMe r=0.5 max_downsample=4", dict(ratio=0.5, max_downsample=4)),
    Setting("downsample f=2 nearest", dict(mode="downsample")),
    Setting("downsample f=2 nearest max_downsample=4", dict(mode="downsample", max_downsample=4)),
]
# Wan: one space-time grid of 8 frames x 16 x 16 patches in every block; `st=2` keeps one dst per 2 x 2 x 2
# cell, so a token may merge into the neighbouring frame's (what cross-frame merging costs, beside st=1).
WAN_SETTINGS = [
    Setting("baseline", None),
    Setting("ToMe r=0.25", dict(ratio=0.25)),
    Setting("ToMe r=0.25 st=2", dict(ratio=0.25, st=2)),
    Setting("ToMe r=0.5", dict(ratio=0.5)),
    Setting("ToMe r=0.5 st=2", dict(ratio=0.5, st=2)),
    Setting("ToMe r=0.75", dict(ratio=0.75)),
    Setting("ToMe r=0.75 st=2", dict(ratio=0.75, st=2)),
    Setting("ToMe r=0.5 merge_mlp", dict(ratio=0.5, merge_mlp=True)),
    Setting("ToMe r=0.5 st=2 merge_mlp", dict(ratio=0.5, st=2, merge_mlp=True)),
    Setting("ToMe r=0.5 reuse 3", dict(ratio=0.5, reuse_steps=3)),
    # The band rule: what each rank of a 2- or 4-way context-parallel run merges (4 or 2 frames of 16 x 16).
    Setting("ToMe r=0.5 bands=2", dict(ratio=0.5, bands=2)),
    Setting("ToMe r=0.5 bands=4", dict(ratio=0.5, bands=4)),
]
SETTINGS = {"sd1": DEFAULT_SETTINGS, "sd3": SD3_SETTINGS, "video": VIDEO_SETTINGS, "wan": WAN_SETTINGS}


def with_cache(settings: List[Setting], picked: Sequence[str]) -> List[Setting]:
    """`settings` (the baseline first), then each cache alone and stacked under each other setting."""
    stacked = list(settings)
    for cache in picked:
        stacked += [Setting(f"{cache} alone", None, cache)] + [
            Setting(f"{s.name} + {cache}", s.kwargs, cache) for s in settings[1:]]
    return stacked


@dataclass
class Result:
    name: str
    kwargs: Optional[Dict[str, Any]]
    time_s: float = 0.0
    speedup: float = 1.0
    psnr: Optional[float] = None
    ssim: Optional[float] = None
    accuracy: Optional[float] = None  # None for clips (the classifier reads centred digits)
    fd: Optional[float] = None
    within_noise: Optional[bool] = None  # accuracy and FD within the baseline's noise band (they separate little)
    chunk_times_s: List[float] = field(default_factory=list)
    # The verdict the tables rest on: the standard error of the mean per-image PSNR against the baseline, and
    # whether the setting stays closer to the baseline than unrelated samples by more than twice that.
    psnr_se: Optional[float] = None
    above_floor: Optional[bool] = None
    # Clips only: PSNR at each frame index, and the frame-to-frame changes' PSNR against the baseline's.
    psnr_by_frame: Optional[List[float]] = None
    temporal_psnr: Optional[float] = None
    temporal_psnr_se: Optional[float] = None  # over clips, as psnr_se
    identical: bool = False  # every sample equals the baseline's bit for bit (infinite PSNR, no error to quote)


def labels_for(n: int) -> Any:
    import torch

    return torch.arange(n) % M.NUM_CLASSES


def _sample_chunk(unet: Any, labels_embedding: Any, setting: Setting, labels: Any, noise: Any, steps: int,
                  arch: str = "sd1"):
    import tomesd

    from ..bench.caches import enabled

    # A ratio schedule needs a pipeline's loop: the denoiser is patched through a pipeline that holds it.
    scheduled = setting.kwargs is not None and setting.kwargs.get("ratio_schedule") is not None
    target = sampling.pipeline(unet, arch) if scheduled else unet
    with enabled(unet, setting.cache, steps):  # a fresh cache for each chunk's sampling run
        if setting.kwargs is not None:
            tomesd.apply_patch(target, **setting.kwargs)
        try:
            start = time.perf_counter()
            images = sampling.sample(unet, labels_embedding, labels, noise, steps=steps, arch=arch,
                                     sched=target.scheduler if scheduled else None)
            return images, time.perf_counter() - start
        finally:
            if setting.kwargs is not None:
                tomesd.remove_patch(target)


def evaluate(
    settings: List[Setting],
    images: int = 64,
    chunk: int = 16,
    steps: int = sampling.STEPS,
    noise_seeds: int = 3,
    seed: int = 0,
    models: Any = None,
    progress: Any = None,
    arch: str = "sd1",
) -> Dict[str, Any]:
    """Sample `images` per setting (seed `seed`) plus the baseline from `noise_seeds - 1` more seeds."""
    import torch

    unet, labels_embedding, classifier = models if models is not None else M.load(arch=arch)
    clips = M.spec(arch).frames is not None
    real, _ = M.digits()
    real_features = None if clips else metrics.features(classifier, real)
    labels = labels_for(images)
    if settings[0].kwargs is not None or settings[0].cache is not None:
        raise ValueError("the first setting must be the baseline (kwargs None, no cache)")
    out: Dict[Setting, List[Any]] = {s: [] for s in settings}
    times: Dict[Setting, List[float]] = {s: [] for s in settings}
    noise = sampling.noise(images, seed, arch)
    starts = list(range(0, images, chunk))
    for i, start in enumerate(starts):  # interleaved, alternating order
        for setting in settings if i % 2 == 0 else settings[::-1]:
            part, seconds = _sample_chunk(unet, labels_embedding, setting, labels[start:start + chunk],
                                          noise[start:start + chunk], steps, arch)
            out[setting].append(part)
            times[setting].append(seconds)
            if progress is not None:
                progress(1)
    spread = []
    for k in range(1, noise_seeds):
        other = sampling.noise(images, seed + 1000 * k, arch)
        parts = []
        for start in starts:
            parts.append(_sample_chunk(unet, labels_embedding, settings[0], labels[start:start + chunk],
                                       other[start:start + chunk], steps, arch)[0])
            if progress is not None:
                progress(1)
        spread.append(torch.cat(parts))

    def scores(x: Any) -> Dict[str, Optional[float]]:
        if clips:
            return {"accuracy": None, "fd": None}
        return {"accuracy": metrics.accuracy(classifier, x, labels),
                "fd": metrics.frechet_distance(metrics.features(classifier, x), real_features)}

    base_images = torch.cat(out[settings[0]])
    base = scores(base_images)
    others = [scores(x) for x in spread]
    band = {
        "accuracy": None if clips else max([abs(o["accuracy"] - base["accuracy"]) for o in others], default=0.0),
        "fd": None if clips else max([abs(o["fd"] - base["fd"]) for o in others], default=0.0),
        # Two baselines from different noise: what "unrelated samples" look like to PSNR / SSIM.
        "unrelated": metrics.closeness(spread[0], base_images) if spread else None,
        "seeds": noise_seeds,
        "baseline_scores": [base] + others,
    }
    if clips and spread:
        band["unrelated"]["temporal_psnr"] = metrics.temporal_psnr(spread[0], base_images)
    results = []
    base_time = sum(times[settings[0]])
    for setting in settings:
        x = torch.cat(out[setting])
        r = Result(setting.name, copy.deepcopy(setting.kwargs), time_s=sum(times[setting]),
                   chunk_times_s=times[setting], **scores(x))
        r.speedup = base_time / r.time_s
        if setting is not settings[0]:
            r.psnr, r.ssim = metrics.closeness(x, base_images).values()
            r.psnr_se = metrics.standard_error(metrics.psnr_per_image(x, base_images))
            r.identical = bool(torch.equal(x, base_images))  # e.g. a cache that skipped nothing at its threshold
            if band["unrelated"] is not None:
                r.above_floor = r.identical or r.psnr - 2 * r.psnr_se > band["unrelated"]["psnr"]
            if clips:
                r.psnr_by_frame = metrics.psnr_by_frame(x, base_images)
                r.temporal_psnr = metrics.temporal_psnr(x, base_images)
                r.temporal_psnr_se = metrics.standard_error(metrics.temporal_psnr_per_clip(x, base_images))
            else:
                r.within_noise = (abs(r.accuracy - base["accuracy"]) <= band["accuracy"]
                                  and r.fd - base["fd"] <= band["fd"])
        results.append(r)
    return {"results": results, "noise_band": band, "images": images, "steps": steps, "chunk": chunk,
            "seed": seed, "arch": arch, "samples": {s.name: torch.cat(out[s]) for s in settings},
            "baselines_other_noise": spread, "classifier": classifier, "real_features": real_features}


def table(report: Dict[str, Any]) -> str:
    band = report["noise_band"]
    clips = any(r.temporal_psnr is not None for r in report["results"]) or band["accuracy"] is None
    judge = ("temporal PSNR vs baseline (dB, ± standard error) | PSNR at first / last frame |" if clips
             else "accuracy | FD to real digits |")
    lines = ["| setting | sampling time (s) | speed-up | PSNR vs baseline (dB, ± standard error) | SSIM vs baseline | "
             + judge + " closer than unrelated samples |", "|---|---|---|---|---|---|---|---|"]
    for r in report["results"]:
        psnr = "-" if r.psnr is None else f"{r.psnr:.1f}" + ("" if r.psnr_se is None else f" ± {r.psnr_se:.2f}")
        if r.identical:
            psnr = "identical to the baseline"
        ssim = "-" if r.ssim is None else f"{r.ssim:.3f}"
        floor = "-" if r.above_floor is None else ("yes" if r.above_floor else "no")
        if clips:
            ends = "-" if r.psnr_by_frame is None else f"{r.psnr_by_frame[0]:.1f} / {r.psnr_by_frame[-1]:.1f}"
            judged = ("-" if r.temporal_psnr is None else f"{r.temporal_psnr:.1f}"
                      + ("" if r.temporal_psnr_se is None else f" ± {r.temporal_psnr_se:.2f}")) + f" | {ends}"
            if r.identical:
                judged = "identical | identical"
        else:
            judged = f"{r.accuracy:.3f} | {r.fd:.2f}"
        lines.append(f"| {r.name} | {r.time_s:.1f} | {r.speedup:.2f}x | {psnr} | {ssim} | {judged} | {floor} |")
    unrelated = band["unrelated"]
    lines.append("")
    pair = "" if unrelated is None else (f"two baselines from different noise: PSNR {unrelated['psnr']:.1f} dB, SSIM "
                                         f"{unrelated['ssim']:.3f}")
    if clips:
        lines.append(f"noise band (baseline from {band['seeds']} noise seeds): {pair}"
                     + ("" if unrelated is None else f", temporal PSNR {unrelated['temporal_psnr']:.1f} dB"))
    else:
        lines.append(f"noise band (baseline from {band['seeds']} noise seeds): accuracy ±{band['accuracy']:.3f}, "
                     f"FD ±{band['fd']:.2f}" + ("" if unrelated is None else f"; {pair}"))
    # A setting equal to the baseline has infinite PSNR and no finite error: it resolves nothing.
    errors = [r.psnr_se for r in report["results"] if r.psnr_se is not None and math.isfinite(r.psnr_se)]
    if errors:
        unit = "clips" if clips else "digits"
        temporal = [r.temporal_psnr_se for r in report["results"]
                    if r.temporal_psnr_se is not None and math.isfinite(r.temporal_psnr_se)]
        lines.append(f"resolution: at {report['images']} {unit}, PSNR differences under about "
                     f"{2 * max(errors):.1f} dB"
                     + ("" if not temporal else
                        f" and temporal PSNR differences under about {2 * max(temporal):.1f} dB")
                     + " (twice the largest standard error) are not resolved"
                     + ("" if clips else "; accuracy and FD separate far less"))
    return "\n".join(lines)


def write_json(path: str, report: Dict[str, Any]) -> None:
    import torch

    doc = {
        "schema": SCHEMA,
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "torch": torch.__version__, "cpus": os.cpu_count()},
        "arch": report.get("arch", "sd1"),
        "images": report["images"], "steps": report["steps"], "chunk": report["chunk"], "seed": report["seed"],
        "noise_band": report["noise_band"],
        "results": [asdict(r) for r in report["results"]],
    }
    if "fd_curve" in report:
        doc["fd_curve"] = report["fd_curve"]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)


def write_plot(path: str, report: Dict[str, Any]) -> None:
    """Closeness (PSNR), accuracy and FD against speed-up: one marker per setting, legend below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results, band = report["results"], report["noise_band"]
    base = results[0]
    clips = band["accuracy"] is None
    fig, axes = plt.subplots(1, 3, figsize=(15, 6.5))
    markers = "os^vD<>pPX*h"
    for i, r in enumerate(results):
        style = dict(marker=markers[i % len(markers)], color=plt.cm.tab20(i % 20), linestyle="none", markersize=8)
        if r.psnr is not None:
            axes[0].plot(r.speedup, r.psnr, label=r.name, **style)
        else:
            axes[0].plot([], [], label=r.name, **style)
        if clips:
            if r.temporal_psnr is not None:
                axes[1].plot(r.speedup, r.temporal_psnr, **style)
                axes[2].plot(range(len(r.psnr_by_frame)), r.psnr_by_frame, color=style["color"],
                             marker=style["marker"])
        else:
            axes[1].plot(r.speedup, r.accuracy, **style)
            axes[2].plot(r.speedup, r.fd, **style)
    if band["unrelated"] is not None:
        axes[0].axhline(band["unrelated"]["psnr"], color="grey", ls=":", label="two baselines, different noise")
    axes[0].set(ylabel="PSNR vs the baseline's samples (dB, higher = closer)")
    if clips:
        if band["unrelated"] is not None:
            axes[1].axhline(band["unrelated"]["temporal_psnr"], color="grey", ls=":")
        axes[1].set(ylabel="temporal PSNR: frame-to-frame changes vs the baseline's (dB)")
        axes[2].set(ylabel="PSNR vs the baseline at each frame (dB)", xlabel="frame")
    else:
        for ax, key in ((axes[1], "accuracy"), (axes[2], "fd")):
            ax.axhspan(getattr(base, key) - band[key], getattr(base, key) + band[key], color="grey", alpha=0.2)
        axes[1].set(ylabel="classifier accuracy on the label (band: baseline noise)")
        axes[2].set(ylabel="Frechet distance to real digits (band: baseline noise)")
    for ax in axes[:2] if clips else axes:
        ax.set(xlabel="sampling speed-up vs baseline (x)")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.legend(loc="lower center", ncol=4, fontsize=8)
    fig.suptitle(f"Yardstick ({report.get('arch', 'sd1')}): quality vs speed-up ({report['images']} digits, "
                 f"{report['steps']} sampling steps)")
    fig.tight_layout(rect=(0, 0.2, 1, 1))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def add_arguments(parser: Any) -> None:
    parser.add_argument("--arch", choices=M.ARCHS, default="sd1",
                        help="the yardstick model: sd1 (the digits UNet, default), sd3 (the SD3-shaped transformer), "
                             "video (AnimateDiff's motion UNet on moving digits, 8 frames) or wan (Wan's transformer "
                             "on the same clips, one space-time grid)")
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
        from ..bench import caches

        picked = caches.names(args.cache)
        caches.check(picked, M.spec(args.arch).host, "torch", False, args.steps)
        settings = with_cache(settings, picked)
        if args.plot:
            import matplotlib  # noqa: F401  (checked before the work, not after)
        models = M.load(args.weights, args.arch)
    except (ValueError, FileNotFoundError, ImportError) as exc:
        print(f"tomesd quality: error: {exc}", file=sys.stderr)
        return 2
    from ..bench.cli import progress_bar

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
