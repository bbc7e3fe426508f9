"""`python -m tomesd tune`: search ToMe's settings on this machine and print the fastest one that keeps the
images close enough, as the line that applies it.

What pays depends on the GPU, the attention kernel, the resolution, the model and the setting, so it is
measured here. The search walks families of settings (merge ratios, merge at more levels, the
feed-forward merged too, keys downsampled, matches reused across steps), each from mild to aggressive,
and prunes: a family whose mildest setting gains nothing beyond the noise (and MIN_GAIN) is dropped, and a family stops
at its first setting that is no faster than the one before or (with --model) moves the images below the
closeness threshold. Every timing of a setting is paired with a baseline timing taken right before it, so
drifts of the machine hit both alike; the noise is three robust standard deviations of the baseline's own
timings (from their median absolute deviation).

On a GPU (`--device cuda`) eager ToMe's own work (its matching is host time, docs/gpu.md) eats a small saving, so
the mild settings each family starts from lose there: the model's GPU pick at its size (the closest on the
project's yardstick whose predicted device-time ratio reaches the model's goal, frontier.GPU_PICKS,
docs/device-picks.md) is tried first. A setting that reuses matches over steps is timed over one window of its steps (each its own timestep).

Longer than most modules: the search, the two ways of measuring a setting (a bare model, a pipeline's loop) and the
report share Trial and Result and are read in that order; apart, each would be a few functions around them."""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

Kwargs = Dict[str, Any]

# The least gain that counts, whatever the noise: a setting 5% faster than the one before it is worth its
# change in the images only if the run can tell it apart, and below 5% it rarely can on a busy machine.
MIN_GAIN = 0.05


@dataclass
class Trial:
    name: str
    kwargs: Kwargs
    speedup: float
    psnr: Optional[float] = None
    outcome: str = ""  # kept | too far | no gain | no faster than the milder one


@dataclass
class Result:
    trials: List[Trial] = field(default_factory=list)
    best: Optional[Trial] = None
    noise: float = 0.0
    min_psnr: Optional[float] = None
    floor_psnr: Optional[float] = None
    budget_hit: bool = False


def families(transformer: bool, loop: bool) -> List[Tuple[str, List[Kwargs]]]:
    """The settings tried, by family, each from mild to aggressive. UNets also try merging at the first
    two levels; transformers the feed-forward merged too; a pipeline (--model) reused matches and a ratio
    that rises over the run."""
    out = [("merge", [dict(ratio=r) for r in (0.25, 0.5, 0.75)])]
    if transformer:
        out.append(("merge + feed-forward", [dict(ratio=r, merge_mlp=True) for r in (0.25, 0.4, 0.5, 0.75)]))
    else:
        out.append(("merge at two levels", [dict(ratio=r, max_downsample=2) for r in (0.5, 0.75)]))
    if loop:
        out.append(("merge, reused across steps", [dict(ratio=0.5, reuse_steps=k) for k in (2, 3)]))
        # gentle while the layout forms, stronger after (tomesd #28)
        out.append(("merge, ratio rising over the run", [dict(ratio_schedule=((0.0, 0.25), (0.5, 0.5))),
                                                          dict(ratio_schedule=((0.0, 0.5), (0.5, 0.75)))]))
    out.append(("downsampled keys", [dict(mode="downsample", downsample_factor=f) for f in (2, 3, 4)]))
    out.append(("downsampled keys, averaged", [dict(mode="downsample", downsample_method="avg", downsample_factor=f)
                                               for f in (2, 4)]))
    return out


def on_gpu(device: str) -> bool:
    return device.startswith(("cuda", "gpu"))


def gpu_first(arch: Optional[str], res: Tuple[int, int], frames: Optional[int]) -> Tuple[Optional[Any], str]:
    """On a GPU: the frontier's pick for this model and size (frontier.GPU_PICKS: what pays there), tried before the
    families, and the line that says what was offered and why (or that nothing is listed for this model and size)."""
    from .frontier import find_gpu_pick

    pick = find_gpu_pick(arch, res, frames) if arch else None
    size = f"{res[0]}x{res[1]}" + (f", {frames} frames" if frames else "")
    if pick is None:
        return None, (f"on a GPU: no setting is picked for {arch or 'this model'} at {size} (frontier.GPU_PICKS, "
                      f"docs/device-picks.md); the families start from their mildest")
    why = (f"closest on the {pick.yardstick} yardstick ({pick.psnr:.1f} dB)" if pick.yardstick is not None else
           "no yardstick prices this model: the mildest")
    reach = (f"at >= {pick.goal}x" if pick.reached else f"the fastest predicted; nothing reaches {pick.goal}x")
    return pick, (f"on a GPU, tried first: {describe(pick.kwargs)} ({pick.predicted_ratio:.2f}x predicted device "
                  f"time on an H100, {reach}; {pick.flop_ratio:.2f}x FLOPs at {size}; {why}; docs/device-picks.md)")


def describe(kwargs: Kwargs) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items())


def search(time_once: Callable[[Optional[Kwargs]], float], psnr_of: Optional[Callable[[Kwargs], float]],
           plan: List[Tuple[str, List[Kwargs]]], repeats: int, budget_s: float, min_psnr: Optional[float],
           clock: Callable[[], float] = time.monotonic) -> Result:
    """Measure the plan's settings against the baseline (time_once(None)), pruning as the module says.
    `psnr_of` gives a setting's closeness to the baseline (None: quality not priced)."""
    start = clock()
    base_times: List[float] = [time_once(None)]
    result = Result(min_psnr=min_psnr)

    def noise() -> float:
        # Three robust standard deviations of the baseline's timings (1.4826 x their median absolute deviation),
        # relative to their median: one stalled timing does not swamp it.
        if len(base_times) < 2:
            return 0.0
        median = statistics.median(base_times)
        return 3 * 1.4826 * statistics.median(abs(t - median) for t in base_times) / median

    for family, settings in plan:
        previous = 1.0
        for kwargs in settings:
            if clock() - start > budget_s:
                result.budget_hit = True
                break
            pairs = []
            for _ in range(repeats):
                base_times.append(time_once(None))
                pairs.append((base_times[-1], time_once(kwargs)))
            speedup = statistics.median(b for b, _ in pairs) / statistics.median(t for _, t in pairs)
            trial = Trial(describe(kwargs), kwargs, speedup)
            result.trials.append(trial)
            if speedup <= previous * (1 + max(noise(), MIN_GAIN)):
                trial.outcome = "no gain" if previous == 1.0 else "no faster than the milder one"
                break  # this family gains nothing more here
            if psnr_of is not None:
                trial.psnr = psnr_of(kwargs)
                if min_psnr is not None and trial.psnr < min_psnr:
                    trial.outcome = "too far"
                    break  # more aggressive settings of the family move the images further
            trial.outcome = "kept"
            previous = speedup
        if result.budget_hit:
            break
    result.noise = noise()
    kept = [t for t in result.trials if t.outcome == "kept"]
    result.best = max(kept, key=lambda t: t.speedup) if kept else None
    return result


def report(result: Result, backend: str, pipeline: bool) -> str:
    lines = ["| setting | speed-up | PSNR vs baseline (dB) | outcome |", "|---|---|---|---|"]
    for t in result.trials:
        psnr = "-" if t.psnr is None else f"{t.psnr:.1f}"
        lines.append(f"| {t.name} | {t.speedup:.2f}x | {psnr} | {t.outcome} |")
    lines.append(f"noise: {result.noise:.1%} (three robust standard deviations of the baseline's timings)")
    if result.floor_psnr is not None:
        lines.append(f"floor: the unpatched images from other noise lie at {result.floor_psnr:.1f} dB; threshold "
                     f"{result.min_psnr:.1f} dB")
    if result.budget_hit:
        lines.append("the time budget ran out before every family was tried (--budget)")
    if result.best is None:
        lines.append(f"no setting is faster than the baseline by more than the noise here (or {MIN_GAIN:.0%})"
                     + (" while staying above the threshold" if pipeline else ""))
        return "\n".join(lines)
    args = describe(result.best.kwargs)
    call = f"pipe.apply_tome({args})" if backend == "paddle" else f"tomesd.apply_patch({'pipe' if pipeline else 'model'}, {args})"
    quality = (f", {result.best.psnr:.1f} dB from the unpatched images" if result.best.psnr is not None else
               "; quality was not priced (no --model): `python -m tomesd quality` prices these settings on the "
               "project's yardstick, `tomesd tune --model PATH` on your own weights")
    lines.append(f"fastest here: {call}  ({result.best.speedup:.2f}x{quality})")
    return "\n".join(lines)


# ---- the command ----
def add_arguments(parser: argparse.ArgumentParser) -> None:
    from .bench.cli import ARCH_NAMES, _resolution

    parser.add_argument("--backend", choices=["torch", "paddle"], default="torch")
    parser.add_argument("--arch", choices=sorted(ARCH_NAMES), default="sd1",
                        help="without --model: the architecture timed (random weights; speed only)")
    parser.add_argument("--config", default=None, help=argparse.SUPPRESS)  # tiny ones, for tests
    parser.add_argument("--depth", type=int, default=None, help="transformers: blocks built")
    parser.add_argument("--res", type=_resolution, default=(512, 512), help="image side, or HEIGHTxWIDTH")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--frames", type=int, default=None)
    parser.add_argument("--model", metavar="PATH", help="a local pipeline: time and price each setting on it")
    parser.add_argument("--prompts", metavar="FILE", default=None, help="with --model: one prompt per line")
    parser.add_argument("--steps", type=int, default=20, help="with --model: denoising steps")
    parser.add_argument("--min-psnr", type=float, default=None,
                        help="with --model: the closeness a setting must keep (default: the floor, i.e. the PSNR "
                             "between two unpatched runs from different noise)")
    parser.add_argument("--repeats", type=int, default=3, help="timings per setting (each paired with the baseline)")
    parser.add_argument("--budget", type=float, default=900.0, help="seconds the search may take (default 900)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32")
    parser.add_argument("--seed", type=int, default=0)


def _model_measure(args: argparse.Namespace, kit: Any, timer: Callable[[], float] = time.perf_counter,
                   on_model: Optional[Callable[[Any], None]] = None) -> Tuple[Callable, Callable, bool]:
    """(time_once, psnr_of, is_transformer) for a bare model built from its config; `timer` times the forwards."""
    import tomesd

    from .bench.kits.configs import ARCHS

    config = args.config or {"sd1": "sd15"}.get(args.arch, args.arch)
    arch = ARCHS[config]
    model = kit.build(config, args.seed, args.depth)
    if on_model is not None:
        on_model(model)
    height, width = args.res
    inputs = kit.inputs(config, args.batch, height, args.seed + 1, args.frames or arch.frames or 16,
                        width if width != height else None)

    def time_once(kwargs: Optional[Kwargs]) -> float:
        """One forward's time; a setting that reuses matches over k steps: one window of k forwards, each its own
        timestep (restored tokens run the first unmerged), per forward."""
        steps = (kwargs or {}).get("reuse_steps") or 1
        window = [inputs] if steps == 1 else [inputs[:1] + (t,) + inputs[2:] for t in kit.timesteps(steps)]
        if kwargs:
            tomesd.apply_patch(model, **kwargs)
        try:
            kit.sync()
            start = timer()
            for step in window:
                kit.forward(model, step)
            kit.sync()
            return (timer() - start) / len(window)
        finally:
            if kwargs:
                tomesd.remove_patch(model)

    kit.forward(model, inputs)  # warm-up: the first forward allocates, and would count as noise
    return time_once, None, arch.transformer


def model_key(pipe: Any) -> Optional[str]:
    """The frontier's name (bench's --arch) for a pipeline's denoiser, where frontier.GPU_PICKS may list it."""
    from .recommend import family_of

    return family_of(pipe)


def _pipeline_measure(args: argparse.Namespace, kit: Any, timer: Callable[[], float] = time.perf_counter,
                      on_model: Optional[Callable[[Any], None]] = None) -> Tuple[Callable, Callable, bool, float]:
    """(time_once, psnr_of, is_transformer, floor PSNR) for a local pipeline: every prompt once, from the
    baseline's noise; a setting's closeness is that of the images its last timing made. `timer` times the runs."""
    import tomesd

    from .bench import pipeline as P

    pipe = P.load(args.model, kit)
    if on_model is not None:
        on_model(pipe)
    pipe.set_progress_bar_config(disable=True)
    prompts = P.read_prompts(args.prompts)
    height, width = args.res
    generator = (lambda s: kit.torch.Generator().manual_seed(s)) if kit.name == "torch" else \
        (lambda s: kit.paddle.Generator().manual_seed(s))

    def images(seed_offset: int = 0) -> Any:
        return P.as_array([pipe(p, num_inference_steps=args.steps, height=height, width=width,
                                generator=generator(args.seed + seed_offset)).images[0] for p in prompts])

    last: Dict[str, Any] = {}

    def time_once(kwargs: Optional[Kwargs]) -> float:
        if kwargs:
            tomesd.apply_patch(pipe, **kwargs)
        try:
            kit.sync()
            start = timer()
            last["images"] = images()
            kit.sync()
            return (timer() - start) / len(prompts)
        finally:
            if kwargs:
                tomesd.remove_patch(pipe)

    time_once(None)  # warm-up
    base = last["images"]
    floor = P.closeness(images(P.FLOOR_SEED_OFFSET), base)["psnr"]
    transformer = getattr(pipe, "transformer", None) is not None
    return time_once, (lambda kwargs: P.closeness(last["images"], base)["psnr"]), transformer, floor


def run(args: argparse.Namespace, *, timer: Callable[[], float] = time.perf_counter,
        clock: Callable[[], float] = time.monotonic, on_model: Optional[Callable[[Any], None]] = None) -> int:
    """The command. `timer` times each forward (or pipeline run) and `clock` keeps --budget; `on_model` is
    called with the model built (or the pipeline loaded) before its first forward. Tests pass one virtual
    clock for both and, through `on_model`, a hook that advances it: their timings are exact whatever the
    machine's speed or load."""
    from .bench.kits.pick import MissingBackend, make_kit

    try:
        for name in ("repeats", "batch", "steps"):
            if getattr(args, name) < 1:
                raise ValueError(f"--{name} must be at least 1")
        if args.budget <= 0:
            raise ValueError("--budget must be positive (seconds)")
        if args.min_psnr is not None and args.model is None:
            raise ValueError("--min-psnr prices closeness to the unpatched images, which needs --model")
        if args.model is not None:
            from .bench.pipeline import BadModelPath, pipeline_library, read_prompts

            read_prompts(args.prompts)
            library = pipeline_library(args.model)
            if (library == "ppdiffusers") != (args.backend == "paddle"):
                raise BadModelPath(f"--model {args.model!r} is a {library} pipeline: use --backend "
                                   f"{'paddle' if library == 'ppdiffusers' else 'torch'}")
        kit = make_kit(args.backend, args.device, args.dtype)
    except (ValueError, MissingBackend) as exc:
        print(f"tomesd tune: error: {exc}", file=sys.stderr)
        return 2
    floor, loaded = None, []

    def seen(model: Any) -> None:
        loaded.append(model)
        if on_model is not None:
            on_model(model)

    if args.model is None:
        time_once, psnr_of, transformer = _model_measure(args, kit, timer, seen)
        arch: Optional[str] = {"sd15": "sd1"}.get(args.config, args.config) if args.config else args.arch
    else:
        time_once, psnr_of, transformer, floor = _pipeline_measure(args, kit, timer, seen)
        arch = model_key(loaded[0])
    min_psnr = args.min_psnr if args.min_psnr is not None else floor
    plan = families(transformer, loop=args.model is not None)
    offered = None
    if on_gpu(args.device):
        from .bench.kits.configs import ARCHS

        built = ARCHS.get({"sd1": "sd15"}.get(arch or "", arch or ""))
        video = built is not None and built.frames
        pick, offered = gpu_first(arch, args.res, (args.frames or built.frames) if video else None)
        if pick is not None:
            plan = [("what pays on a GPU", [dict(pick.kwargs)])] + plan
    result = search(time_once, psnr_of, plan, args.repeats, args.budget, min_psnr, clock)
    result.floor_psnr = floor
    what = args.model or f"{args.config or args.arch} (random weights, speed only)"
    print(f"tomesd tune: {what}, {args.res[0]}x{args.res[1]}, {kit.name} on {args.device}; "
          f"{len(result.trials)} of {sum(len(s) for _, s in plan)} settings measured")
    if offered:
        print(offered)
    print(report(result, args.backend, args.model is not None))
    return 0
