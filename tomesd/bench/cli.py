"""`python -m tomesd bench` / `tomesd-bench`: what ToMe buys on this machine, no download needed."""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import sys
from typing import Any, List, Optional

from . import caches
from .configs import ARCHS

ARCH_NAMES = {"sd1": "sd15", "sdxl": "sdxl", "sd3": "sd3", "pixart": "pixart", "flux": "flux",
              "animatediff": "animatediff", "svd": "svd", "wan": "wan"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", choices=["torch", "paddle"], default="torch")
    parser.add_argument("--host", choices=["diffusers", "comfyui"], default="diffusers",
                        help="comfyui: time ComfyUI's own models (--arch sd1, sdxl or flux): unpatched, ComfyUI's "
                             "TomePatchModel and this project's nodes")
    parser.add_argument("--comfyui", metavar="PATH", default=None,
                        help="with --host comfyui: a ComfyUI folder (default: $COMFYUI_PATH, else `make envs`'s copy)")
    parser.add_argument("--arch", choices=sorted(ARCH_NAMES), default=None,
                        help="architecture at real width, random weights: sd1 (SD1.5 UNet, the default), sdxl "
                             "(SDXL UNet), sd3 (SD3-medium transformer), pixart (PixArt-alpha 1024), flux "
                             "(Flux.1-dev), animatediff (SD1.5 UNet with AnimateDiff's motion adapter, video), svd "
                             "(Stable Video Diffusion img2vid-xt UNet), wan (Wan 2.1 T2V 1.3B transformer, video); "
                             "same as --config sd15/sdxl/sd3/pixart/flux/animatediff/svd/wan")
    parser.add_argument("--frames", type=int, default=None,
                        help="video architectures: frames per clip (default: AnimateDiff 16, SVD 14, Wan 17, i.e. 5 "
                             "latent frames)")
    parser.add_argument("--depth", type=int, default=None,
                        help="transformers: build only this many blocks (default: all; SD3-medium 24, PixArt 28, "
                             "Flux 19 double-stream, with twice as many single-stream)")
    parser.add_argument("--config", choices=sorted(ARCHS), default="sd15",
                        help="architecture built with random weights (default: SD1.5's UNet; tiny ones for checks)")
    parser.add_argument("--res", type=_resolution, default=(512, 512),
                        help="image side in pixels (latent = res/8), or HEIGHTxWIDTH (480x832); default 512")
    parser.add_argument("--batch", type=int, default=2, help="UNet batch (2 = one image with classifier-free guidance)")
    parser.add_argument("--ratios", default="0.25,0.5,0.75", help="comma-separated ToMe ratios")
    parser.add_argument("--modes", default=None,
                        help="comma-separated: merge (ToMe, one row per ratio), merge-mlp (ToMe with merge_mlp=True, "
                             "one row per ratio), downsample (ToDo, one row); default merge,downsample")
    parser.add_argument("--reuse-steps", default="1", metavar="K[,K...]",
                        help="merge rows per ratio, one per K: matching reused for K denoising steps (use with --steps)")
    parser.add_argument("--downsample-factor", type=int, default=2, help="per side, with --modes downsample")
    parser.add_argument("--downsample-method", choices=["nearest", "avg"], default="nearest")
    parser.add_argument("--max-downsample", type=int, default=None,
                        help="as in apply_patch; default: the finest level with attention")
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda / gpu")
    parser.add_argument("--repeats", type=int, default=3, help="timed forwards per configuration (median)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed forwards per configuration first")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compare", action="store_true",
                        help="also run the reference (tomesd 0.1.3 on torch, ppdiffusers' built-in on paddle)")
    parser.add_argument("--json", metavar="PATH", help="write machine-readable results")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG of speed-up and memory saved vs ratio")
    parser.add_argument("--no-memory", action="store_true", help="skip the CPU peak-memory probes (one process each)")
    parser.add_argument("--flops-only", action="store_true",
                        help="count each configuration's FLOPs on the meta device and stop (no timing; seconds at any "
                             "size; torch)")
    parser.add_argument("--model", metavar="PATH",
                        help="a local diffusers/ppdiffusers pipeline folder: generate under every setting (the same "
                             "--modes, --ratios, --reuse-steps, --downsample-* options) and report time per image and "
                             "closeness to the unpatched images")
    parser.add_argument("--prompt", default=None, help="with --model: one prompt (instead of the built-in three)")
    parser.add_argument("--prompts", metavar="FILE", default=None,
                        help="with --model: one prompt per line (default: three built-in prompts)")
    parser.add_argument("--seeds", type=int, default=2, help="with --model: seeds per prompt (default 2)")
    parser.add_argument("--closeness-plot", metavar="PATH", default="bench-out/closeness.png",
                        help="with --model: PSNR against speed-up, one point per setting")
    parser.add_argument("--steps", type=int, default=None,
                        help="time a loop of N UNet calls over distinct timesteps per configuration (default 1); "
                             "with --model: denoising steps (default 20)")
    parser.add_argument("--grid", metavar="PATH", default="bench-out/grid.png", help="image grid written with --model")
    parser.add_argument("--cache", metavar="NAME[,NAME...]", default=None,
                        help=f"with --steps: also run diffusers' step caches ({', '.join(caches.CACHES)}: First "
                             "Block Cache, TaylorSeer, FasterCache, Pyramid Attention Broadcast, MagCache), each "
                             "alone and under each ToMe setting, side by side (torch); fbc:T and magcache:T set "
                             "the skip threshold T (defaults 0.05 and 0.06)")
    parser.add_argument("--context-parallel", type=int, metavar="N", default=None,
                        help="--arch flux or wan: run it context-parallel on N local processes (diffusers' "
                             "enable_parallelism; gloo on CPU, NCCL on CUDA, one GPU a process), the baseline beside "
                             "ToMe at each ratio: time, tokens into attention per rank, what collectives move")
    parser.add_argument("--cp-attention", choices=["ulysses", "ring"], default="ulysses",
                        help="with --context-parallel: Ulysses (all-to-all) or ring attention")
    parser.add_argument("--compile", action="store_true",
                        help="torch only: time a torch.compile'd UNet per configuration (first call reported apart)")
    parser.add_argument("--preset", choices=["gpu"], default=None,
                        help="gpu: the GPU report, a fixed list of runs (SD1.5, SDXL, SD3, Flux, Wan; eager, "
                             "compiled, with step caches) on one CUDA GPU within --budget seconds, written as JSON "
                             "and one markdown table under --out (gpu_report.py)")
    parser.add_argument("--preset-config", choices=["full", "tiny"], default="full",
                        help="with --preset: full (the real architectures, on --device cuda) or tiny (the tiny "
                             "configurations on CPU: a check of the plumbing, not a measurement)")
    parser.add_argument("--out", metavar="DIR", default=None, help="with --preset: where the runs' JSON and the "
                                                                    "report go (default bench-out/gpu-report)")
    parser.add_argument("--only", metavar="SLUG[,SLUG...]", default=None,
                        help="with --preset: run only these runs (their JSON names without the number, e.g. "
                             "sd1-5-1024-compiled): a rerun of what failed")
    parser.add_argument("--budget", type=float, default=None, metavar="S",
                        help="with --preset: wall-clock seconds; runs that would start later are listed as not run "
                             "(default 540)")
    parser.add_argument("--compile-backend", metavar="NAME", default=None,
                        help="torch.compile backend with --compile (default: inductor; aot_eager, eager for checks)")
    parser.add_argument("--profile", action="store_true",
                        help="torch, eager: also profile one forward of the baseline, each ToMe ratio and the "
                             "reference (torch.profiler): the ops that cost most, device time on a GPU")
    parser.add_argument("--compile-mode", choices=["default", "reduce-overhead", "max-autotune-no-cudagraphs"],
                        default=None, help="inductor's mode with --compile: reduce-overhead replays each "
                                           "configuration as CUDA graphs (CUDA only)")


def _fail(message: str) -> int:
    print(f"tomesd bench: error: {message}", file=sys.stderr)
    return 2


BENCH_EXTRA = "pip install 'tome-sd[bench]'"


def missing_dependencies(args: argparse.Namespace) -> List[str]:
    """The optional modules the chosen options need and cannot import, one message each (checked
    before anything runs, so a missing plotting library does not cost a whole benchmark)."""
    needs = []
    if args.plot:
        needs.append(("matplotlib", "--plot", "matplotlib"))
    if args.model is not None:
        needs.append(("PIL", "--model (for its image grid)", "pillow"))
        needs.append(("torchmetrics", "--model (PSNR and SSIM)", "torchmetrics"))
        needs.append(("matplotlib", "--model (its closeness plot)", "matplotlib"))
    missing = []
    for module, option, package in needs:
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(f"{option} needs {package}, which is not installed: {BENCH_EXTRA} (or pip install {package})")
    return missing


class _NoBar:
    """Stands in for tqdm's progress bar when tqdm is not installed."""

    def __enter__(self) -> "_NoBar":
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def update(self, n: int = 1) -> None:
        pass

    def set_description(self, text: str) -> None:
        pass


def progress_bar(total: int, desc: str) -> object:
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, desc=desc, unit="fwd", file=sys.stderr, disable=None)


def _resolution(text: str) -> "tuple[int, int]":
    """--res: a side (512), or height x width (480x832)."""
    parts = text.lower().split("x")
    try:
        sides = [int(part) for part in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a side in pixels (512) or HEIGHTxWIDTH (480x832)") from None
    if len(sides) not in (1, 2):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a side in pixels (512) or HEIGHTxWIDTH (480x832)")
    return (sides[0], sides[-1])


def _ratios(text: str) -> List[float]:
    try:
        ratios = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--ratios {text!r}: expected comma-separated numbers such as 0.25,0.5") from None
    if not ratios or any(not 0 < r < 1 for r in ratios):
        raise ValueError(f"--ratios {text!r}: each ratio must be in (0, 1)")
    return ratios


def _ints(text: str, option: str) -> List[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"{option} {text!r}: expected comma-separated integers") from None
    if not values or any(v < 1 for v in values):
        raise ValueError(f"{option} {text!r}: each value must be at least 1")
    return values


def _modes(text: str) -> List[str]:
    modes = [part.strip() for part in text.split(",") if part.strip()]
    bad = [m for m in modes if m not in ("merge", "merge-mlp", "downsample")]
    if not modes or bad:
        raise ValueError(f"--modes {text!r}: choose from merge, merge-mlp, downsample")
    return modes


def _context_parallel(settings: Any, model_name: str, json_path: Optional[str]) -> int:
    import json

    from . import context_parallel

    size = f"{settings.res}x{settings.width or settings.res}"
    print(f"{model_name}, random weights, {size}, batch {settings.batch}, {settings.dtype}, context-parallel "
          f"({settings.attention}) on {settings.processes} {settings.device} processes; baseline and "
          f"{len(settings.ratios)} ToMe configurations interleaved", file=sys.stderr)
    rows = context_parallel.run(settings)
    print(f"\n{model_name} at {size}, {settings.attention} over {settings.processes} processes on "
          f"{settings.device}; median of {settings.repeats} calls after {settings.warmup} warm-up")
    print(context_parallel.table(settings, rows))
    print("collectives: the elements (and bytes) each rank hands to all-to-all / all-gather in one call, counted "
          "op by op: the same on any machine; times are this machine's")
    if json_path:
        os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
        with open(json_path, "w") as f:
            json.dump({"schema": "tomesd-bench-cp/1", "settings": dataclasses.asdict(settings),
                       "results": [dataclasses.asdict(row) for row in rows]}, f, indent=1)
    return 0


def _bench(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(prog="tomesd-bench")
    add_arguments(parser)
    return run(parser.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    if getattr(args, "preset", None) is not None:
        from . import gpu_report

        if args.device == "cpu" and args.preset_config == "full":
            return _fail("--preset gpu times the real architectures on a CUDA GPU: add --device cuda (or "
                         "--preset-config tiny for a CPU check of the plumbing)")
        if args.budget is None:
            args.budget = gpu_report.BUDGET_S
        if args.only is not None:
            try:
                gpu_report.pick(args.only)
            except ValueError as exc:
                return _fail(str(exc))
        return gpu_report.run(args, _bench)
    if getattr(args, "host", "diffusers") == "comfyui":
        from . import comfyui

        if isinstance(args.res, int):
            args.res = (args.res, args.res)
        return comfyui.run(args)
    from .kits import MissingBackend, make_kit
    from .pipeline import BadModelPath
    from .flops import fill_flops
    from .report import table, verdict, write_json, write_plot
    from .runner import Settings, configurations, fill_memory_reductions, measure_cpu_memory, run_unet

    try:
        if isinstance(args.res, int):  # given as a number (tests, callers of run())
            args.res = (args.res, args.res)
        height, width = args.res
        ratios = _ratios(args.ratios)
        modes = _modes(args.modes or "merge,downsample")
        reuse = _ints(args.reuse_steps, "--reuse-steps")
        if args.steps is not None and args.steps < 1:
            raise ValueError("--steps must be at least 1")
        if args.downsample_factor < 1:
            raise ValueError("--downsample-factor must be at least 1")
        if args.compile and max(reuse) > 1:
            raise ValueError("--reuse-steps above 1 cannot be compiled: telling denoising steps apart reads the "
                             "timestep on the host")
        if max(reuse) > 1 and (args.steps or 1) < 2:
            raise ValueError("--reuse-steps above 1 needs --steps N (N >= 2): reuse only shows over a denoising loop")
        for name in ("batch", "repeats"):
            if getattr(args, name) < 1:
                raise ValueError(f"--{name} must be at least 1")
        if min(height, width) < 1:
            raise ValueError("--res must be at least 1")
        if height % 8 or width % 8:
            raise ValueError("--res must be a multiple of 8 (the VAE's downsampling)")
        if args.model is not None:
            from .pipeline import read_prompts

            if args.prompt is not None and args.prompts is not None:
                raise ValueError("give --prompt or --prompts, not both")
            prompts = [args.prompt] if args.prompt is not None else read_prompts(args.prompts)
            if args.seeds < 1:
                raise ValueError("--seeds must be at least 1")
            if args.compare or args.cache or args.compile:
                raise ValueError("--model runs our settings on the pipeline; --compare, --cache and --compile go "
                                 "with the UNet bench alone")
        if args.model is not None and height != width:
            raise ValueError("--model generates square images: give --res as one side")
        if args.model is not None and not os.path.isdir(args.model):
            raise BadModelPath(f"--model {args.model!r}: no such folder")
        if args.compile_backend is not None and not args.compile:
            raise ValueError("--compile-backend goes with --compile")
        compile_mode = getattr(args, "compile_mode", None)
        if compile_mode is not None and not args.compile:
            raise ValueError("--compile-mode goes with --compile")
        if compile_mode is not None and (args.compile_backend or "inductor") != "inductor":
            raise ValueError(f"--compile-mode is inductor's; --compile-backend {args.compile_backend} has no modes")
        if compile_mode == "reduce-overhead" and args.device not in ("cuda", "gpu"):
            raise ValueError("--compile-mode reduce-overhead replays CUDA graphs: it needs --device cuda")
        if args.compile and args.backend != "torch":
            raise ValueError("--compile is torch only (torch.compile); paddle has no compiled mode in this benchmark")
        if getattr(args, "profile", False) and (args.backend != "torch" or args.compile or args.model is not None):
            raise ValueError("--profile times eager torch forwards: no --backend paddle, --compile or --model")
        missing = missing_dependencies(args)
        if missing:
            raise ValueError("; ".join(missing))
        if args.arch is not None:
            args.config = ARCH_NAMES[args.arch]
        arch = ARCHS[args.config]
        if args.frames is not None and not arch.video:
            raise ValueError(f"--frames is for video architectures (animatediff, svd, wan); {arch.name} is an image model")
        if args.frames is not None and args.frames < 1:
            raise ValueError("--frames must be at least 1")
        if args.flops_only and (args.backend != "torch" or args.model is not None or args.compile):
            raise ValueError("--flops-only counts with torch on the meta device: no --backend paddle, --model or "
                             "--compile")
        if arch.video and args.backend != "torch":
            raise ValueError(f"{arch.name} runs on torch only in this benchmark")
        if arch.video and args.compare:
            raise ValueError(f"--compare runs tomesd 0.1.3, which cannot patch {arch.cls}")
        if args.cache is not None and args.model is not None:
            raise ValueError("--cache goes with the loop bench (--steps), not --model")
        picked_caches = caches.names(args.cache)
        caches.check(picked_caches, arch.cls, args.backend, args.compile, args.steps or 1)
        if args.depth is not None and not (arch.transformer and 1 <= args.depth <= arch.full_depth):
            raise ValueError(f"--depth cuts a transformer's blocks (1 to {arch.full_depth})" if arch.transformer
                             else f"--depth is for transformers; {arch.name} is a UNet")
        if arch.transformer and args.compare:
            raise ValueError(f"--compare runs tomesd 0.1.3 / ppdiffusers' built-in, which patch UNets only; "
                             f"{arch.name} has no reference")
        if arch.transformer and args.max_downsample is not None:
            raise ValueError("--max-downsample picks UNet levels; a transformer's blocks all see one token grid")
        settings = Settings(
            backend=args.backend, config=args.config, depth=args.depth, res=height, width=width if width != height else 0,
            batch=args.batch, ratios=tuple(ratios),
            max_downsample=args.max_downsample, dtype=args.dtype, device=args.device, repeats=args.repeats,
            warmup=max(args.warmup, 0), compare=args.compare, seed=args.seed,
            compile=args.compile, compile_backend=args.compile_backend or "inductor",
            compile_mode=None if compile_mode in (None, "default") else compile_mode,
            modes=tuple(modes), reuse_steps=tuple(reuse), downsample_factor=args.downsample_factor,
            downsample_method=args.downsample_method, steps=1 if args.model is not None else (args.steps or 1),
            caches=picked_caches, frames=args.frames or arch.frames or 16,
        )
        cp_settings = None
        if getattr(args, "context_parallel", None) is not None:
            from . import context_parallel

            context_parallel.check(ARCHS[settings.config].cls, args.context_parallel, args.cp_attention, settings.backend,
                                   settings.compile, settings.caches)
            cp_settings = context_parallel.CPSettings(
                config=settings.config, processes=args.context_parallel, attention=args.cp_attention,
                depth=settings.depth, res=settings.res, width=settings.width, batch=settings.batch,
                ratios=settings.ratios, frames=settings.frames, repeats=settings.repeats, warmup=settings.warmup,
                device=settings.device, dtype=settings.dtype, seed=settings.seed)
        kit = make_kit(settings.backend, settings.device, settings.dtype)
        if settings.compile and settings.compile_backend not in kit.compile_backends():
            raise ValueError(f"--compile-backend {settings.compile_backend!r}: torch.compile knows "
                             f"{', '.join(sorted(kit.compile_backends()))}")
    except (ValueError, MissingBackend) as exc:
        return _fail(str(exc))
    if args.compare and settings.backend == "torch":
        from .references import load_tomesd_ref

        try:
            load_tomesd_ref()
        except RuntimeError as exc:
            return _fail(str(exc))

    if cp_settings is not None:
        return _context_parallel(cp_settings, _model_name(settings), args.json)
    if args.flops_only:
        return _flops_only(settings, args.json)
    n_configs = len(configurations(settings))
    cpu_memory = not kit.on_gpu() and not args.no_memory
    total = n_configs * (settings.warmup + settings.repeats + 1 + (1 if cpu_memory else 0) + (1 if settings.compile else 0))
    compiled = (f", torch.compile(backend={settings.compile_backend!r}"
                + (f", mode={settings.compile_mode!r})" if settings.compile_mode else ")") if settings.compile else "")

    arch = ARCHS[settings.config]
    model_name = _model_name(settings)
    size = f"{settings.res}x{settings.width or settings.res}"
    print(f"{model_name}, random weights, {size}, batch {settings.batch}, "
          f"{settings.dtype} on {kit.name}/{settings.device}{compiled}; {n_configs} configurations interleaved",
          file=sys.stderr)
    notes: List[str] = []
    with progress_bar(total, "UNet forwards") as bar:
        rows = run_unet(settings, bar.update, notes)
        if cpu_memory:
            bar.set_description("peak-memory probes")
            measure_cpu_memory(settings, rows, bar.update)
    fill_memory_reductions(rows)
    fill_flops(settings, rows)
    profiles = None
    if getattr(args, "profile", False):
        from . import profiling

        try:
            profiles = profiling.run(settings, kit)
        except Exception as exc:  # noqa: BLE001 - a profiler that cannot run here costs the profile, not the timings
            notes.append(f"--profile failed, the timings stand: {type(exc).__name__}: {str(exc)[:300]}")

    pipeline = None
    if args.model is not None:
        from . import pipeline as pipeline_mod

        configs = [c for c in configurations(settings) if c.method in ("baseline", "tome") and c.cache is None]
        try:
            pipeline = pipeline_mod.run(args.model, kit, configs, settings, prompts, args.seeds, args.steps or 20,
                                        settings.res, args.grid)
        except BadModelPath as exc:
            return _fail(str(exc))
        pipeline_mod.write_closeness_plot(pipeline, args.closeness_plot)
        pipeline["closeness_plot"] = os.path.abspath(args.closeness_plot)

    print(f"\n{model_name} at {size}, batch {settings.batch}, {settings.dtype}, "
          f"{kit.name} on {settings.device}{compiled}; median of {settings.repeats} "
          + (f"loops of {settings.steps} UNet calls (timesteps 999 down, per call shown)" if settings.steps > 1 else "forwards")
          + f" after {settings.warmup} warm-up")
    print(table(rows, kit.reference_name))
    print(verdict(rows, kit.reference_name, settings))
    for note in notes:
        print(f"note: {note}")
    if settings.compile:
        print("compiled: one compiled copy of the UNet per configuration (weights shared); tokens and output change "
              "from one eager forward of each copy; ToMe's own time is not separable inside a compiled graph")
    if any(row.flop_speedup is not None for row in rows):
        print("FLOPs ratio: the baseline's floating-point operations over the configuration's (one forward, counted "
              "on the meta device): the speed-up if time followed the matrix products alone. Not a bound: ToMe's "
              "gathers and sorts count nothing there (measured speed-ups fall short), nor does attention's softmax "
              "over every pair of tokens, which merging shrinks quadratically (they can exceed it)")
    if cpu_memory:
        print("peak memory: peak RSS of one forward in a fresh process (model weights included)")
    for cache in settings.caches:
        print(f"{cache}: diffusers' {caches.lookup(cache).title}, fresh for each timed loop; "
              f"output change is that of the loop's last call")
    if pipeline is not None:
        n_images = len(pipeline["prompts"]) * len(pipeline["seeds"])
        print(f"\npipeline {pipeline['model']}: {len(pipeline['prompts'])} prompts x {len(pipeline['seeds'])} seeds, "
              f"{pipeline['steps']} steps at {pipeline['res']}x{pipeline['res']}, {pipeline['dtype']} on {pipeline['device']}; "
              f"each setting after a {pipeline['warmup_steps']}-step warm-up, its {n_images} images from the "
              f"baseline's noise")
        print(pipeline_mod.closeness_table(pipeline))
        print(f"closeness: {pipeline['metrics']}")
        print(f"image grid: {pipeline['grid']}; closeness plot: {pipeline['closeness_plot']}")
    if args.json:
        write_json(args.json, settings, rows, kit, pipeline, notes, profiles)
        print(f"results: {args.json}")
    if args.plot:
        write_plot(args.plot, rows, kit.reference_name,
                   f"{model_name} {size} batch {settings.batch} ({kit.name}, {settings.device})")
        print(f"plot: {args.plot}")
    return 0


def _model_name(settings: Any) -> str:
    """The architecture as built: the depth used when cut, the frame count of a clip."""
    arch = ARCHS[settings.config]
    name = arch.name
    if settings.depth and arch.extra == "flux":
        name += (f" ({settings.depth} of {arch.full_depth} double-stream and {2 * settings.depth} of "
                 f"{arch.config['num_single_layers']} single-stream blocks)")
    elif settings.depth:
        name += f" ({settings.depth} of {arch.full_depth} blocks)"
    if arch.video:
        name += f", {settings.frames} frames"
    return name


def _flops_only(settings: Any, json_path: Optional[str]) -> int:
    from .flops import fill_flops
    from .report import label
    from .runner import Row, configurations

    rows = [Row(method=c.method, ratio=c.ratio, mode=c.mode, reuse_steps=c.reuse_steps, cache=c.cache)
            for c in configurations(settings)]
    fill_flops(settings, rows)
    print(f"{_model_name(settings)} at {settings.res}x{settings.width or settings.res}, batch {settings.batch}: "
          f"one forward's floating-point operations, counted on the meta device")
    print("| configuration | GFLOPs per forward | FLOPs ratio |\n|---|---|---|")
    for row in rows:
        flops = "-" if row.flops is None else f"{row.flops / 1e9:,.1f}"
        ratio = "-" if row.flop_speedup is None else f"{row.flop_speedup:.2f}x"
        print(f"| {label(row, '')} | {flops} | {ratio} |")
    if json_path:
        import json
        from dataclasses import asdict

        os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
        with open(json_path, "w") as f:
            json.dump({"settings": asdict(settings), "flops": [
                {"configuration": label(r, ""), "flops": r.flops, "flop_speedup": r.flop_speedup} for r in rows]},
                f, indent=2)
        print(f"results: {json_path}")
    return 0


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="tomesd-bench", description=__doc__)
    add_arguments(parser)
    sys.exit(run(parser.parse_args(argv)))
