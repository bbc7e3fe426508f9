"""The bench command's options checked together and turned into what a run needs (Prepared: runner.Settings,
the framework's kit, the context-parallel settings, the prompts): every refusal comes before any work."""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from dataclasses import dataclass
from typing import Any, List, Optional

from .kits import caches
from .arguments import ARCH_NAMES
from .kits.configs import ARCHS
from .kits.pick import make_kit
from .pipeline import BadModelPath, read_prompts
from .measures.runner import Settings

BENCH_EXTRA = "pip install 'tomesd[bench]'"


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
        loaded = set(sys.modules)
        try:
            importlib.import_module(module)
        except ImportError:
            # An import that failed half-way (matplotlib without pillow) leaves submodules that hold the dropped
            # package, and a later import of it in this process would fail on them: they go too.
            for name in set(sys.modules) - loaded:
                if sys.modules.get(name.split(".")[0]) is None:
                    del sys.modules[name]
            missing.append(f"{option} needs {package}, which is not installed: {BENCH_EXTRA} (or pip install {package})")
    return missing


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
    bad = [m for m in modes if m not in ("merge", "merge-mlp", "merge-prop", "merge-restore", "downsample",
                                         "downsample-restore")]
    if not modes or bad:
        raise ValueError(f"--modes {text!r}: choose from merge, merge-mlp, merge-prop, merge-restore, downsample, "
                         f"downsample-restore")
    return modes


@dataclass
class Prepared:
    settings: Settings
    kit: Any
    cp_settings: Optional[Any] = None  # context_parallel.CPSettings, with --context-parallel
    prompts: Optional[List[str]] = None  # with --model


def prepare(args: argparse.Namespace) -> Prepared:
    """The options, checked (ValueError, MissingBackend: the message the command prints) and made settings; `args`
    is completed on the way (--res as (height, width), --config from --arch)."""
    prompts = None
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
    if ("merge-restore" in modes or "downsample-restore" in modes) and max(reuse) < 2:
        raise ValueError("--modes merge-restore and downsample-restore restore from the unreduced first step of each "
                         "--reuse-steps window: give --reuse-steps 3 (or 2) and --steps 6 or more")
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
    regional = getattr(args, "compile_regional", False)
    if regional and not args.compile:
        raise ValueError("--compile-regional goes with --compile")
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
    if height % arch.vae_factor or width % arch.vae_factor:
        raise ValueError(f"--res must be a multiple of {arch.vae_factor} for {arch.name} (its VAE's downsampling)")
    if arch.no_downsample and "downsample-restore" in modes:
        raise ValueError(f"--modes downsample-restore: {arch.no_downsample}; run --modes merge-restore")
    if arch.no_downsample and "downsample" in modes:
        if args.modes:  # asked for by name: refused with the family's reason
            raise ValueError(f"--modes downsample: {arch.no_downsample}; run --modes merge")
        modes.remove("downsample")  # the default's downsample row is not this family's
    if args.frames is not None and not arch.video:
        raise ValueError(f"--frames is for video architectures (animatediff, svd, wan, hunyuanvideo-1.5); {arch.name} "
                         "is an image model")
    if args.frames is not None and args.frames < 1:
        raise ValueError("--frames must be at least 1")
    if getattr(args, "predict", None) is not None:
        from ..devicetime.model import UnknownGPU, rates_for

        if args.backend != "torch" or args.model is not None or args.compile or args.flops_only \
                or getattr(args, "context_parallel", None):
            raise ValueError("--predict traces one eager forward with torch on the meta device: no --backend paddle, "
                             "--model, --compile, --flops-only or --context-parallel (the model prices eager kernels; "
                             "under whole-model compilation inductor fuses elementwise chains it does not know)")
        try:
            rates_for(args.predict)
        except UnknownGPU as exc:
            raise ValueError(f"--predict {args.predict}: {exc}") from None
        if getattr(args, "dtype_given", None) is None:
            from .forward_trace import gpu_dtype

            args.dtype = gpu_dtype(arch)
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
        compile_mode=None if compile_mode in (None, "default") else compile_mode, compile_regional=regional,
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
    return Prepared(settings, kit, cp_settings, prompts)
