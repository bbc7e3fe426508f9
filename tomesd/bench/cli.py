"""`python -m tomesd bench` / `tomesd-bench`: what ToMe buys on this machine, no download needed."""
# This module runs the command: its options (arguments.py) checked into settings (options.py), the configurations
# timed (runner.py), the results printed and written (report.py); --preset (gpu_report.py), --host comfyui
# (comfyui.py), --context-parallel and --flops-only go their own ways from here.
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
from typing import Any, List, Optional

from .kits import caches
from .arguments import ARCH_NAMES, add_arguments
from .arguments import resolution as _resolution  # noqa: F401  (tune.py reads --res with it from here)
from .kits.configs import ARCHS
from .progress import progress_bar

__all__ = ["ARCH_NAMES", "add_arguments", "main", "progress_bar", "run"]


def _fail(message: str) -> int:
    print(f"tomesd bench: error: {message}", file=sys.stderr)
    return 2


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


def _attention_kernel(name: Optional[str], settings: Any, notes: List[str]) -> Any:
    """--attention-backend: diffusers' attention_backend context (the process-wide kernel, restored after), or a
    context that does nothing."""
    if name is None:
        return contextlib.nullcontext()
    if settings.backend != "torch":
        raise ValueError("--attention-backend picks a kernel of diffusers' attention dispatcher (torch)")
    try:
        from diffusers.models.attention_dispatch import AttentionBackendName, attention_backend
    except ImportError:
        raise ValueError("--attention-backend: this diffusers has no attention dispatcher (0.35 or later has)") \
            from None
    known = [b.value for b in AttentionBackendName]
    if name not in known:
        raise ValueError(f"--attention-backend {name!r}: diffusers knows {', '.join(known)}")
    notes.append(f"attention kernel: {name} (diffusers' dispatcher; processors that call torch's SDPA themselves, as "
                 f"the UNets' and SD3's do, keep it; peak-memory probes run in fresh processes without it)")
    return attention_backend(name)


def _bench(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(prog="tomesd-bench")
    add_arguments(parser)
    return run(parser.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    args.dtype_given = getattr(args, "dtype", None)  # --predict's default dtype is the GPU's, every other float32
    if args.dtype_given is None:
        args.dtype = "float32"
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
    from .measures.flops import fill_flops
    from .kits.kit_base import MissingBackend
    from .options import prepare
    from .pipeline import BadModelPath
    from .measures.report import table, verdict, write_json, write_plot
    from .measures.memory import measure_cpu_memory
    from .measures.runner import configurations, fill_memory_reductions, run_unet

    try:
        prepared = prepare(args)
    except (ValueError, MissingBackend) as exc:
        return _fail(str(exc))
    settings, kit, cp_settings, prompts = prepared.settings, prepared.kit, prepared.cp_settings, prepared.prompts
    if args.compare and settings.backend == "torch":
        from .kits.references import load_tomesd_ref

        try:
            load_tomesd_ref()
        except RuntimeError as exc:
            return _fail(str(exc))

    if cp_settings is not None:
        return _context_parallel(cp_settings, _model_name(settings), args.json)
    if args.flops_only:
        return _flops_only(settings, args.json)
    if getattr(args, "predict", None) is not None:
        from .predict import run as predict

        return predict(settings, args.predict, args.json)
    n_configs = len(configurations(settings))
    cpu_memory = not kit.on_gpu() and not args.no_memory
    total = n_configs * (settings.warmup + settings.repeats + 1 + (1 if cpu_memory else 0) + (1 if settings.compile else 0))
    compiled = ((", compile_repeated_blocks(" if settings.compile_regional else ", torch.compile(")
                + f"backend={settings.compile_backend!r}"
                + (f", mode={settings.compile_mode!r})" if settings.compile_mode else ")") if settings.compile else "")

    model_name = _model_name(settings)
    size = f"{settings.res}x{settings.width or settings.res}"
    print(f"{model_name}, random weights, {size}, batch {settings.batch}, "
          f"{settings.dtype} on {kit.name}/{settings.device}{compiled}; {n_configs} configurations interleaved",
          file=sys.stderr)
    notes: List[str] = []
    kernel = contextlib.ExitStack()
    try:  # diffusers checks the kernel's requirements (flash-attn, sageattention installed) as it enters
        kernel.enter_context(_attention_kernel(getattr(args, "attention_backend", None), settings, notes))
    except (ValueError, RuntimeError, ImportError) as exc:
        return _fail(f"--attention-backend: {exc}" if "--attention-backend" not in str(exc) else str(exc))
    with kernel, progress_bar(total, "UNet forwards") as bar:
        rows = run_unet(settings, bar.update, notes)
        if cpu_memory:
            bar.set_description("peak-memory probes")
            measure_cpu_memory(settings, rows, bar.update)
    fill_memory_reductions(rows)
    fill_flops(settings, rows)
    profiles = None
    if getattr(args, "profile", False):
        from .measures import profiling

        try:
            with _attention_kernel(getattr(args, "attention_backend", None), settings, []):
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
        from .measures.flops import where_counted

        print("FLOPs ratio: the baseline's floating-point operations over the configuration's (one forward, counted "
              f"{where_counted(settings)}): the speed-up if time followed the matrix products alone. Not a bound: "
              "ToMe's "
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
    if settings.depth and arch.singles_per_double:
        name += (f" ({settings.depth} of {arch.full_depth} double-stream and {arch.singles_per_double * settings.depth} of "
                 f"{arch.config['num_single_layers']} single-stream blocks)")
    elif settings.depth and arch.refiners_key:
        kept = min(settings.depth, arch.config[arch.refiners_key])
        name += (f" ({settings.depth} of {arch.full_depth} main blocks, {kept} of {arch.config[arch.refiners_key]} "
                 f"refiner blocks on each side)")
    elif settings.depth:
        name += f" ({settings.depth} of {arch.full_depth} blocks)"
    if arch.video:
        name += f", {settings.frames} frames"
    return name


def _flops_only(settings: Any, json_path: Optional[str]) -> int:
    from .measures.flops import fill_flops, where_counted
    from .measures.report import label
    from .measures.runner import Row, configurations

    rows = [Row(method=c.method, ratio=c.ratio, mode=c.mode, reuse_steps=c.reuse_steps, cache=c.cache)
            for c in configurations(settings)]
    fill_flops(settings, rows)
    print(f"{_model_name(settings)} at {settings.res}x{settings.width or settings.res}, batch {settings.batch}: "
          f"one forward's floating-point operations, counted {where_counted(settings)}")
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
