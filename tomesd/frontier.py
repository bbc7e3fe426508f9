"""`python -m tomesd frontier`: every setting a yardstick prices, with its closeness to the unpatched model (from
`quality`: PSNR on the project's yardstick) and its speed at real width (from `bench`: time per denoiser call over
a denoising loop, interleaved with the baseline, and the FLOPs ratio), plotted closeness against speed with the
Pareto front marked: the settings no other setting beats on both.

The closeness comes from a `quality --json` file of the same yardstick (`--closeness`), or from a quality run made
here first. The speed is timed on the yardstick's real architecture (sd1: SD1.5's UNet, sdxl: SDXL's, sd3:
SD3-medium, video: AnimateDiff, wan: Wan 2.1 1.3B) with random weights, at `--res` and `--depth`; step caches
(`--cache`) alone and stacked under each setting, as `quality --cache` prices them. A ratio schedule needs a
pipeline's loop and is left out of the timing, with a note.

What pays on a GPU: each run also marks the closest setting whose FLOPs ratio reaches `--flops-floor` (FLOPS_FLOOR,
1.4x), the mildest there where no yardstick prices the model (`--closeness none`); GPU_PICKS holds the marks per
model at real width (docs/frontier.md), which `tune --device cuda` tries first.

Longer than most modules: the command's steps (closeness, timing and FLOPs, the front and the GPU pick, the table
and the plot) each read and extend one list of points; apart, each would be a few functions passing that list on."""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

ARCH_OF = {"sd1": "sd15", "sdxl": "sdxl", "sd3": "sd3", "video": "animatediff", "wan": "wan"}

# On a GPU eager ToMe's own work (matching: host time, docs/gpu.md) eats a small saving: the H100 bounds r=0.5 at its
# device-time ratio (Flux 1.11x, SD1.5 1024² 1.14x, SDXL below 1). A setting pays there when it leaves at most
# 1 / FLOPS_FLOOR of the compute; the frontier marks the closest such setting, `tune --device cuda` tries it first.
FLOPS_FLOOR = 1.4


@dataclass(frozen=True)
class GpuPick:
    """The setting picked for one model at one size by predicted device time (tomesd/devicetime/picks.py: the closest
    on the yardstick whose predicted device-time ratio on an H100 reaches the model's goal), which `tune --device
    cuda` tries first and tomesd.recommend returns. Its settings and closeness come from the frontier run `counted`."""
    arch: str  # bench's --arch name
    res: Tuple[int, int]  # height, width in pixels
    frames: Optional[int]  # video: frames per clip
    name: str  # the setting's name on the yardstick's list (quality.settings)
    kwargs: Dict[str, Any]
    flop_ratio: float  # per denoiser call over a loop
    psnr: Optional[float]  # on `yardstick`; None: no yardstick prices the model, the mildest at the goal is marked
    yardstick: Optional[str]
    counted: str
    predicted_ratio: float = 0.0  # predicted device-time ratio per call over a loop (H100, eager)
    goal: float = 0.0  # the device-time ratio the pick was to reach
    reached: bool = True  # False: nothing reached the goal, this is the fastest predicted (docs/device-picks.md)


def _device_picks() -> Tuple[GpuPick, ...]:
    """GPU_PICKS from tomesd/devicetime/picks.json (`python -m tomesd.devicetime picks` writes it)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "devicetime", "picks.json")
    with open(path) as f:
        doc = json.load(f)
    picks = []
    for m in doc["models"]:
        point = next(p for p in m["points"] if p["name"] == m["pick"])
        picks.append(GpuPick(m["arch"], tuple(m["res"]), m["frames"], point["name"], point["kwargs"],
                             round(point["flop_ratio"], 2), point["psnr"], m["yardstick"], m["frontier"],
                             round(point["predicted_ratio"], 2), m["goal"], m["reached"]))
    return tuple(picks)


# What each model at real width runs first on a GPU (docs/device-picks.md; tests/cli/test_frontier.py checks each
# against its frontier run and the yardsticks' settings).
GPU_PICKS: Tuple[GpuPick, ...] = _device_picks()


def find_gpu_pick(arch: str, res: Tuple[int, int], frames: Optional[int] = None) -> Optional[GpuPick]:
    """GPU_PICKS' entry for this model at this size (frames: video only), or None: the FLOPs ratio grows with the size,
    so an entry holds at its own size alone."""
    return next((p for p in GPU_PICKS if (p.arch, p.res, p.frames) == (arch, tuple(res), frames)), None)


def add_arguments(parser: Any) -> None:
    parser.add_argument("--arch", choices=sorted(ARCH_OF), default="sd3",
                        help="the yardstick (its settings and closeness) and the architecture timed: sd1 -> SD1.5's "
                             "UNet, sdxl -> SDXL's UNet, sd3 -> SD3-medium, video -> AnimateDiff, wan -> Wan 2.1 1.3B")
    parser.add_argument("--closeness", metavar="PATH[,PATH...]", default=None,
                        help="`python -m tomesd quality --arch ARCH --json PATH` files (comma-separated; a setting "
                             "priced in several takes the last file's row); `none`: no yardstick prices the "
                             "architecture (Flux), FLOPs and speed alone; default: run quality here")
    parser.add_argument("--flops-floor", type=float, default=FLOPS_FLOOR,
                        help="mark the closest setting (yardstick PSNR) whose FLOPs ratio is at least this "
                             f"(default {FLOPS_FLOOR}: what pays on a GPU, docs/frontier.md)")
    parser.add_argument("--only", metavar="NAMES", default=None, help="comma-separated setting names (default: all)")
    parser.add_argument("--cache", metavar="NAME[,NAME...]", default=None,
                        help="diffusers' step caches, alone and stacked under each setting (as quality --cache)")
    parser.add_argument("--images", type=int, default=64, help="when quality runs here: samples per setting")
    parser.add_argument("--noise-seeds", type=int, default=3, help="when quality runs here: baseline noise seeds")
    parser.add_argument("--sampling-steps", type=int, default=None,
                        help="when quality runs here: its sampling steps (default: quality's)")
    parser.add_argument("--config", default=None,
                        help="the architecture timed instead of the yardstick's real one (bench's --config names: "
                             "tiny-sd3 and the like for checks)")
    parser.add_argument("--res", type=int, default=1024, help="image side in pixels (video: 512 is usual)")
    parser.add_argument("--width", type=int, default=0, help="image width in pixels (default: --res, square)")
    parser.add_argument("--flops-only", action="store_true",
                        help="time nothing: each setting's FLOPs ratio alone, counted on the meta device (sizes this "
                             "machine cannot time; the front is then on the FLOPs ratio)")
    parser.add_argument("--depth", type=int, default=None, help="transformers: blocks built (default: all)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--frames", type=int, default=None, help="video: frames per clip (default: the arch's)")
    parser.add_argument("--steps", type=int, default=6, help="denoiser calls per timed loop (reuse needs 2 or more)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float32")
    parser.add_argument("--json", metavar="PATH", default="frontier-out/frontier.json")
    parser.add_argument("--plot", metavar="PATH", default="frontier-out/frontier.png")


def run(args: Any) -> int:
    from .bench.kits.configs import ARCHS
    from .bench.progress import progress_bar
    from .bench.measures.runner import Config, Settings, run_unet
    from .quality import settings as S

    try:
        if args.steps < 2:
            raise ValueError("--steps must be at least 2: reused matches and restored tokens show over a loop")
        settings = _picked(S.SETTINGS[args.arch], args.only)
        from .bench.kits import caches

        settings = S.with_cache(settings, caches.names(args.cache))
        closeness = _closeness(args, settings)
        if args.closeness and args.closeness != "none" and not args.only:  # the settings those files priced
            settings = [settings[0]] + [s for s in settings[1:] if s.name in closeness]
    except (ValueError, FileNotFoundError) as exc:
        print(f"tomesd frontier: error: {exc}", file=sys.stderr)
        return 2
    arch = args.config or ARCH_OF[args.arch]
    if arch not in ARCHS:
        print(f"tomesd frontier: error: --config {arch!r}: choose from {sorted(ARCHS)}", file=sys.stderr)
        return 2
    bench = Settings(config=arch, depth=args.depth, res=args.res, batch=args.batch, ratios=(), steps=args.steps,
                     repeats=args.repeats, warmup=args.warmup, device=args.device, dtype=args.dtype,
                     frames=args.frames or ARCHS[arch].frames or 16, width=args.width)
    timed, notes = [], []
    for setting in settings[1:]:
        if setting.kwargs and "ratio_schedule" in setting.kwargs:
            notes.append(f"{setting.name}: not timed (a ratio schedule follows a pipeline's loop)")
            continue
        if setting.kwargs and args.depth and max(setting.kwargs.get("blocks") or [0]) >= args.depth:
            notes.append(f"{setting.name}: not timed (its blocks are beyond --depth {args.depth})")
            continue
        timed.append((setting, config_of(setting)))
    configs = [Config("baseline")] + [config for _, config in timed]
    rows: List[Any] = [None] * len(configs)
    if not args.flops_only:
        print(f"timing {len(configs)} configurations on {ARCHS[arch].name} at {_size(args)}, depth "
              f"{args.depth or 'full'}, {args.steps} calls per loop", file=sys.stderr)
        with progress_bar(len(configs) * (args.warmup + args.repeats + 1), "denoiser loops") as bar:
            rows = run_unet(bench, bar.update, notes, configs)
    flops = _flops(bench, [config for _, config in timed], notes)
    points = [_point(setting, row, closeness.get(setting.name), ratio)
              for (setting, _), row, ratio in zip(timed, rows[1:], flops)]
    front = pareto(points, "flop_ratio" if args.flops_only else "speedup")
    pick, rule = gpu_pick(points, args.flops_floor, yardstick=args.closeness != "none")
    for point in points:
        point["front"] = point["name"] in front
        point["gpu_pick"] = pick is not None and point["name"] == pick["name"]
    if pick is None:
        notes.append(f"no setting{'' if args.closeness == 'none' else ' with a PSNR'} leaves a FLOPs ratio of "
                     f"{args.flops_floor}x or more here")
    elif args.closeness == "none":
        notes.append(f"no yardstick prices {ARCHS[arch].name}: of the settings at {args.flops_floor}x FLOPs or more, "
                     "the one that removes the least compute is marked, its closeness unmeasured")
    print(_table(points, args, notes, rule))
    doc = {"schema": "tomesd-frontier/1", "yardstick": args.arch, "architecture": ARCHS[arch].name,
           "res": args.res, "width": args.width or args.res, "flops_only": args.flops_only, "depth": args.depth,
           "batch": args.batch,
           "steps": args.steps, "device": args.device, "frames": bench.frames if ARCHS[arch].frames else None,
           "closeness": args.closeness, "flops_floor": args.flops_floor,
           "gpu_pick": None if pick is None else {"name": pick["name"], "rule": rule},
           "dtype": args.dtype, "baseline_time_s": None if rows[0] is None else rows[0].time_s, "points": points,
           "notes": notes}
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
        print(f"results: {args.json}")
    if args.plot:
        _plot(args.plot, doc)
        print(f"plot: {args.plot}")
    return 0


def _picked(settings: List[Any], only: Optional[str]) -> List[Any]:
    if not only:
        return settings
    wanted = [name.strip() for name in only.split(",")]
    unknown = [name for name in wanted if name not in {s.name for s in settings}]
    if unknown:
        raise ValueError(f"--only: unknown settings {unknown}; known: {[s.name for s in settings]}")
    return [settings[0]] + [s for s in settings[1:] if s.name in wanted]


def _closeness(args: Any, settings: List[Any]) -> Dict[str, Dict[str, Any]]:
    """Each setting's row of a quality run, by name: read from --closeness (of several files, the last that prices a
    setting gives its row; `none`: nothing), or from a quality run made now."""
    path = args.closeness
    if path == "none":
        return {}
    if path is None:
        from .quality import yardstick

        path = os.path.splitext(args.json or "frontier-out/frontier.json")[0] + "-closeness.json"
        names = ",".join(s.name for s in settings[1:] if s.cache is None)
        from .quality import sampling

        quality = argparse.Namespace(arch=args.arch, cache=args.cache, images=args.images, chunk=min(16, args.images),
                                     steps=args.sampling_steps or sampling.STEPS, noise_seeds=args.noise_seeds, seed=0, only=names or None,
                                     fd_curve=None, json=path, plot=None, weights=None)
        if yardstick.run(quality) != 0:
            raise ValueError("the quality run failed (its error is above)")
    rows: Dict[str, Dict[str, Any]] = {}
    for one in path.split(","):
        with open(one) as f:
            doc = json.load(f)
        if doc.get("arch", "sd1") != args.arch:
            raise ValueError(f"--closeness {one} prices the {doc.get('arch', 'sd1')} yardstick, not {args.arch}")
        rows.update({row["name"]: dict(row, source=os.path.basename(one)) for row in doc["results"]})
    return rows


def config_of(setting: Any) -> Any:
    """The bench configuration that times a quality setting: its apply_patch arguments given whole."""
    from .bench.measures.runner import Config

    if not setting.kwargs:
        return Config("baseline", cache=setting.cache)
    kwargs = setting.kwargs
    ratio = kwargs.get("ratio") if isinstance(kwargs.get("ratio"), (int, float)) else None
    return Config("tome", ratio, kwargs.get("mode") or "merge", kwargs.get("reuse_steps", 1), setting.cache,
                  json.dumps(kwargs, sort_keys=True))


def _flops(bench: Any, configs: List[Any], notes: List[str]) -> List[Optional[float]]:
    """The baseline's FLOPs over each configuration's, per denoiser call over a loop, counted on the meta device:
    a reused matching costs what matching every step costs there (its matching is not counted), restored tokens
    run one call in reuse_steps unmerged (in downsample mode, with each downsampled attention run again reduced).
    None for a step cache (it skips whole calls by the values it meets)."""
    if bench.device != "cpu" and not bench.device.startswith("cuda"):
        return [None] * len(configs)
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from .bench.measures.runner import Config
    from .bench.kits.torch_kit import TorchKit

    kit = TorchKit("meta", bench.dtype)
    with torch.device("meta"):
        model = kit.build(bench.config, bench.seed, bench.depth)
    inputs = kit.inputs(bench.config, bench.batch, bench.res, bench.seed + 1, bench.frames, bench.width or None)

    names = {id(module): f"{type(model).__name__}.{name}" for name, module in model.named_modules()}

    def count(config: Any) -> Tuple[int, Dict[str, Dict[Any, int]], List[Tuple[Any, str]]]:
        """The forward's FLOPs, also per module and op, and the attentions the patch downsamples (name, way)."""
        from .hosts.targets import installed_patches

        with kit.method(model, config, bench), FlopCounterMode(display=False) as counter:
            kit.forward(model, inputs)
            sites = [(names.get(id(getattr(block, way.attention, None))), way.via) for patch in installed_patches(model)
                     for block, kind in zip(patch.blocks, patch.kinds) for way in kind.downsample]
        return int(counter.get_total_flops()), counter.get_flop_counts(), sites

    base, base_counts, _ = count(Config("baseline"))
    out: List[Optional[float]] = []
    for config in configs:
        if config.cache is not None or config.kwargs is None:
            out.append(None)
            continue
        kwargs = json.loads(config.kwargs)
        k = kwargs.pop("reuse_steps", 1)
        restored = kwargs.pop("restore_tokens", False)
        try:
            merged, counts, sites = count(Config("tome", kwargs=json.dumps(kwargs, sort_keys=True)))
        except Exception as exc:  # noqa: BLE001 - what cannot run on meta (a host read) is left uncounted
            notes.append(f"FLOPs of {kwargs} not counted on the meta device: {type(exc).__name__}")
            out.append(None)
            continue
        rerun = _rerun(counts, base_counts, sites) if kwargs.get("mode") == "downsample" else 0
        per_call = (base + rerun + (k - 1) * merged) / k if restored else merged
        out.append(base / per_call)
    return out


def _rerun(counts: Dict[str, Dict[Any, int]], base: Dict[str, Dict[Any, int]], sites: List[Tuple[Any, str]]) -> int:
    """What downsample mode's restoring runs again at a window's first step, from FLOPs per module and op: each
    attention downsampling changed (one at a level it leaves out is not run again), reduced; the whole module where
    it downsamples before projecting, the attention's own products alone where it does at the dispatch."""
    total = 0
    for name, via in sites:
        ops = counts.get(name)
        if ops is None or ops == base.get(name):
            continue
        total += sum(flops for op, flops in ops.items()
                     if via != "dispatch" or str(op).split(".")[1] not in ("addmm", "mm", "linear"))
    return total


def _point(setting: Any, row: Any, close: Optional[Dict[str, Any]], flop_ratio: Optional[float]) -> Dict[str, Any]:
    close = close or {}
    return {"name": setting.name, "kwargs": setting.kwargs, "cache": setting.cache,
            "speedup": None if row is None else row.speedup, "time_s": None if row is None else row.time_s,
            "flop_ratio": flop_ratio, "psnr": close.get("psnr"),
            "temporal_psnr": close.get("temporal_psnr"), "accuracy": close.get("accuracy"), "fd": close.get("fd"),
            "closeness_source": close.get("source")}


def pareto(points: List[Dict[str, Any]], speed: str = "speedup") -> List[str]:
    """The names of the points no other point matches or beats on both speed (`speed`: the measured speed-up, or the
    FLOPs ratio) and PSNR (one strictly)."""
    scored = [p for p in points if p.get("psnr") is not None and p.get(speed) is not None]

    def beaten(p: Dict[str, Any]) -> bool:
        return any(q is not p and q[speed] >= p[speed] and q["psnr"] >= p["psnr"]
                   and (q[speed] > p[speed] or q["psnr"] > p["psnr"]) for q in scored)

    return [p["name"] for p in sorted(scored, key=lambda p: p[speed]) if not beaten(p)]


def closest_paying(points: List[Dict[str, Any]], floor: float = FLOPS_FLOOR,
                   key: str = "flop_ratio") -> Optional[Dict[str, Any]]:
    """Of the points whose `key` (the FLOPs ratio, or the predicted device-time ratio) is at least `floor` and whose
    closeness was measured, the closest (highest PSNR; of equals, the higher ratio); None when no point qualifies.
    What pays on a GPU, where eager ToMe's own work eats a small saving whatever the measured speed-up on a CPU says."""
    paying = [p for p in points if p.get("psnr") is not None and p.get(key) is not None and p[key] >= floor]
    return max(paying, key=lambda p: (p["psnr"], p[key])) if paying else None


def mildest_paying(points: List[Dict[str, Any]], floor: float = FLOPS_FLOOR,
                   key: str = "flop_ratio") -> Optional[Dict[str, Any]]:
    """Where no yardstick prices the model (Flux): of the points whose `key` is at least `floor`, the one that
    removes the least (the lowest ratio; of equals, the first listed); None when none does."""
    paying = [p for p in points if p.get(key) is not None and p[key] >= floor]
    return min(paying, key=lambda p: p[key]) if paying else None


def gpu_pick(points: List[Dict[str, Any]], floor: float = FLOPS_FLOOR, yardstick: bool = True,
             key: str = "flop_ratio") -> Tuple[Optional[Dict[str, Any]], str]:
    """The setting that pays on a GPU, and the words that mark it: the closest at `floor` or more where a yardstick
    priced the settings, else the mildest; by the FLOPs ratio, or by `key="predicted_ratio"` (devicetime/picks.py)."""
    what = "FLOPs" if key == "flop_ratio" else "predicted device time"
    if yardstick:
        return closest_paying(points, floor, key), f"closest at >= {floor}x {what}"
    return mildest_paying(points, floor, key), f"mildest at >= {floor}x {what} (no yardstick)"


def _size(args: Any) -> str:
    return f"{args.res}x{args.width}" if args.width else f"{args.res}²"


def _table(points: List[Dict[str, Any]], args: Any, notes: List[str], rule: str) -> str:
    def num(value: Optional[float], fmt: str) -> str:
        return "-" if value is None else format(value, fmt) + ("x" if fmt == ".2f" else "")

    lines = [f"\nfrontier ({args.arch} yardstick; speed on {args.config or ARCH_OF[args.arch]} at {_size(args)}, depth "
             f"{args.depth or 'full'}, batch {args.batch}, {args.steps} calls per loop, {args.device})",
             "| setting | speed-up | FLOPs ratio | PSNR (dB) | on the front |", "|---|---|---|---|---|"]
    for p in sorted(points, key=lambda p: -(p["speedup"] or p["flop_ratio"] or 0)):
        marks = (["yes"] if p["front"] else []) + ([rule] if p.get("gpu_pick") else [])
        lines.append(f"| {p['name']} | {num(p['speedup'], '.2f')} | {num(p['flop_ratio'], '.2f')} | "
                     f"{num(p['psnr'], '.1f')} | {'; '.join(marks)} |")
    for p in (p for p in points if p.get("gpu_pick")):
        psnr = "" if p["psnr"] is None else f", {p['psnr']:.1f} dB ({p.get('closeness_source') or 'quality'})"
        lines.append(f"{rule}: {p['name']} ({p['flop_ratio']:.2f}x FLOPs{psnr}): what pays on a GPU")
    return "\n".join(lines + [f"note: {note}" for note in notes])


def _plot(path: str, doc: Dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 7))
    speed = "flop_ratio" if doc.get("flops_only") else "speedup"
    points = [p for p in doc["points"] if p["psnr"] is not None and p[speed] is not None]
    for p in points:
        ax.plot(p[speed], p["psnr"], "o", color="tab:red" if p["front"] else "tab:blue")
        ax.annotate(p["name"], (p[speed], p["psnr"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
    front = sorted((p for p in points if p["front"]), key=lambda p: p[speed])
    ax.plot([p[speed] for p in front], [p["psnr"] for p in front], "-", color="tab:red", label="Pareto front")
    if doc.get("flops_only") and doc.get("flops_floor"):
        ax.axvline(doc["flops_floor"], linestyle=":", color="gray")
    for p in (p for p in points if p.get("gpu_pick")):
        ax.plot(p[speed], p["psnr"], "*", markersize=15, color="tab:green", label=doc["gpu_pick"]["rule"])
    what = "FLOPs ratio" if doc.get("flops_only") else "speed-up"
    ax.set(xlabel=f"{what} per denoiser call ({doc['architecture']}, {doc['res']}x{doc['width']}, {doc['device']})",
           ylabel=f"PSNR vs the unpatched model ({doc['yardstick']} yardstick, dB)")
    ax.grid(alpha=0.3)
    ax.legend()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
