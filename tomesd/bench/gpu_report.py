"""`python -m tomesd bench --preset gpu` (`make bench-gpu`): the GPU report in one command.

A fixed list of loop-bench runs on one CUDA GPU in half precision with PyTorch's fused attention: SD1.5 at
512², 1024² and 2048², SDXL at 1024² (both beside tomesd 0.1.3), SD3 at 1024², Flux at 1024² (cut to
FLUX_DEPTH double-stream blocks, twice as many single-stream) and Wan at 480x832, eager and compiled (one of
them replayed as CUDA graphs, inductor's reduce-overhead mode), then diffusers' step caches stacked with ToMe
over a denoising loop. Each run writes its JSON; the report is one markdown table of them all (`report.md`)
and `report.json`, both rewritten after every run, so a run cut short still leaves what it measured.

The runs go in order of what a user asks first, under a wall-clock budget (default 540 s): a run whose
rough cost (`Entry.cost_s`, seconds on an H100) would take the report past the budget is listed as not run
and cheaper ones after it still go, so the command ends in time. A run that raises is reported with its
error and the next one starts on a released GPU. `--preset-config tiny` runs the same list on the tiny
configurations on CPU (a check of the plumbing, not a measurement).

Longer than most modules: the list of runs, their run under the budget and their report are one sequence whose
parts read the same Entry and JSON rows."""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

FLUX_DEPTH = 6  # of Flux.1-dev's 19 double-stream blocks (12 of 38 single-stream): the per-block cost is what
# ToMe changes, and the report's time is better spent on more runs than on 57 blocks.
STEPS = 8  # denoising steps in the cache runs
BUDGET_S = 540.0
EAGER = ("--repeats", "5", "--warmup", "2")
COMPILED = ("--repeats", "5", "--warmup", "1", "--modes", "merge")  # each configuration compiles: ToMe beside the baseline
REGIONAL = ("--repeats", "5", "--warmup", "1", "--ratios", "0.5,0.75", "--modes", "merge,merge-mlp,merge-prop,downsample")
LOOP = ("--steps", str(STEPS), "--modes", "merge", "--repeats", "3", "--warmup", "1")


@dataclass(frozen=True)
class Entry:
    title: str
    args: Tuple[str, ...]
    cost_s: float = 0.0  # rough seconds on an H100, model build and compilation included


def _run(title: str, cost_s: float, arch: str, res: str, dtype: str, *extra: str) -> Entry:
    return Entry(title, ("--arch", arch, "--res", res, "--dtype", dtype, *extra), cost_s)


def entries() -> List[Entry]:
    """The report's runs, in the order a user asks: eager first, then compiled (the CUDA-graph replay on the
    size where launches weigh most), the step caches, and the larger compiles last."""
    half, bf16 = "float16", "bfloat16"
    ref = ("--compare",)  # tomesd 0.1.3 beside ours (UNets)
    profiled = ("--profile",)  # one forward per configuration under torch.profiler: which ops cost
    flux = ("--depth", str(FLUX_DEPTH))
    flux_title = f"Flux 1024² (depth {FLUX_DEPTH})"
    runs = [
        _run("SD1.5 512²", 10, "sd1", "512", half, *EAGER, *ref),
        _run("SD1.5 1024²", 15, "sd1", "1024", half, *EAGER, *ref, *profiled),
        _run("SD1.5 2048²", 40, "sd1", "2048", half, *EAGER, *ref, *profiled),
        _run("SDXL 1024²", 20, "sdxl", "1024", half, *EAGER, *ref, *profiled),
        _run("SD3 1024²", 15, "sd3", "1024", half, *EAGER),
        _run(flux_title, 15, "flux", "1024", bf16, *flux, *EAGER, *profiled),
        _run("Wan 480x832, 17 frames", 20, "wan", "480x832", bf16, *EAGER),
        # Regional compilation, as diffusers recommends it (issue 59): each repeated block compiled on its own, beside
        # the whole-model compiles below; SD3 declares no repeated blocks. Merge and downsample, proportional attention.
        _run("SD1.5 1024² regional", 70, "sd1", "1024", half, "--compile", "--compile-regional", *REGIONAL),
        _run("SDXL 1024² regional", 90, "sdxl", "1024", half, "--compile", "--compile-regional", *REGIONAL),
        _run(f"{flux_title} regional", 70, "flux", "1024", bf16, *flux, "--compile", "--compile-regional", *REGIONAL),
        _run("Wan 480x832 regional", 70, "wan", "480x832", bf16, "--compile", "--compile-regional", *REGIONAL),
        _run("SD1.5 1024² compiled", 120, "sd1", "1024", half, "--compile", *COMPILED, *ref),
        _run("SD1.5 512² CUDA graphs", 110, "sd1", "512", half, "--compile", "--compile-mode", "reduce-overhead",
             *COMPILED),
        _run(f"{flux_title} compiled", 90, "flux", "1024", bf16, *flux, "--compile", *COMPILED),
    ]
    caches = [(flux_title, 20, ("flux", "1024", bf16, *flux), ("taylorseer", "fbc", "magcache", "pab")),
              ("SD3 1024²", 20, ("sd3", "1024", half), ("taylorseer", "fastercache", "pab", "magcache")),
              ("Wan 480x832", 35, ("wan", "480x832", bf16), ("taylorseer",))]
    for title, cost, model, names in caches:
        runs += [_run(f"{title} + {cache}", cost, model[0], model[1], model[2], *model[3:], *LOOP, "--cache", cache)
                 for cache in names]
    # The settings that cut more FLOPs (issue 52's item 4: r=0.75, merge_mlp, proportional attention's cost beside
    # plain ToMe) on the cut host path (docs/host-cost.md), eager.
    settings = ("--ratios", "0.5,0.75", "--modes", "merge,merge-mlp,merge-prop")
    runs[7:7] = [
        _run("SD3 1024² settings", 25, "sd3", "1024", half, *EAGER, *settings),
        _run(f"{flux_title} settings", 30, "flux", "1024", bf16, *flux, *EAGER, "--ratios", "0.3,0.5,0.75", *settings[2:]),
        _run("Wan 480x832 settings", 30, "wan", "480x832", bf16, *EAGER, *settings),
    ]
    runs += [
        _run("SDXL 1024² compiled", 160, "sdxl", "1024", half, "--compile", *COMPILED),
        _run("SD3 1024² compiled", 120, "sd3", "1024", half, "--compile", *COMPILED),
        _run("Wan 480x832 compiled", 110, "wan", "480x832", bf16, "--compile", *COMPILED),
    ]
    # Proportional attention beside plain ToMe (the same rows' speed-up, and which attention kernel runs).
    both = ("--modes", "merge,merge-prop")
    runs += [
        _run("SD1.5 1024² prop", 20, "sd1", "1024", half, *EAGER, *both, *profiled),
        _run("SD1.5 2048² prop", 45, "sd1", "2048", half, *EAGER, *both),
        _run("SDXL 1024² prop", 25, "sdxl", "1024", half, *EAGER, *both),
        _run("SD3 1024² prop", 20, "sd3", "1024", half, *EAGER, *both, *profiled),
        _run(f"{flux_title} prop", 20, "flux", "1024", bf16, *flux, *EAGER, *both, *profiled),
        _run("Wan 480x832, 17 frames prop", 25, "wan", "480x832", bf16, *EAGER, *both),
        _run("SD1.5 1024² compiled prop", 130, "sd1", "1024", half, "--compile", *COMPILED, *both),
        _run(f"{flux_title} compiled prop", 100, "flux", "1024", bf16, *flux, "--compile", *COMPILED, *both),
    ]
    # Proportional attention's channel under other kernels of diffusers' dispatcher, beside plain ToMe under the same
    # kernel (issue 60: at most 3% each); flash and sage run where their packages are on the machine
    runs += [_run(f"{flux_title} prop {kernel}", 20, "flux", "1024", bf16, *flux, *EAGER, *both,
                  "--attention-backend", kernel) for kernel in ("_native_cudnn", "flash", "sage")]
    return runs


# --preset-config tiny: each architecture's tiny stand-in, at a small size, float32 on CPU.
TINY = {"sd1": "tiny", "sdxl": "tiny", "sd3": "tiny-sd3", "flux": "tiny-flux", "wan": "tiny-wan"}


def tiny_args(args: Sequence[str]) -> List[str]:
    """An entry's arguments for the CPU check: tiny configurations, 64² (48x80 for Wan's 480x832), float32,
    compiled with the `eager` backend (no CUDA graphs), one timed forward."""
    out: List[str] = []
    it = iter(args)
    for arg in it:
        if arg == "--arch":
            out += ["--config", TINY[next(it)]]
        elif arg == "--res":
            out += ["--res", "48x80" if "x" in next(it) else "64"]
        elif arg == "--dtype":
            next(it)
            out += ["--dtype", "float32"]
        elif arg in ("--depth", "--compile-mode", "--repeats", "--warmup"):
            next(it)
        elif arg == "--compile":
            out += ["--compile", "--compile-backend", "eager"]
        elif arg == "--attention-backend":  # the GPU kernels: the CPU's math kernel stands in
            next(it)
            out += ["--attention-backend", "_native_math"]
        elif arg == "--steps":
            next(it)
            out += ["--steps", "3"]
        else:
            out.append(arg)
    return out


def slug(title: str) -> str:
    keep = "".join(c if c.isalnum() else "-" for c in title.lower().replace("²", "")).strip("-")
    return "-".join(part for part in keep.split("-") if part)


def pick(only: str) -> List[str]:
    """--only: run titles' slugs, comma-separated (a rerun of what failed); a ValueError names the known ones."""
    known = [slug(e.title) for e in entries()]
    wanted = [part.strip() for part in only.split(",") if part.strip()]
    unknown = [w for w in wanted if w not in known]
    if not wanted or unknown:
        raise ValueError(f"--only {only!r}: {', '.join(unknown) or 'nothing named'} is not a run of the preset; "
                         f"the runs are: {', '.join(known)}")
    return wanted


def release() -> None:
    """Between runs: compiled graphs, CUDA-graph pools and cached blocks of the last run go, so one run's
    leftovers (or its failure) neither fill the GPU nor slow the next."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def run(args: argparse.Namespace, bench: Callable[[List[str]], int], clock: Callable[[], float] = time.monotonic,
        between: Callable[[], None] = release) -> int:
    """Run the preset's entries through `bench` (the bench CLI on an argument list) into `args.out`, writing
    the report after each. `clock` and `between` are seams for tests."""
    tiny = args.preset_config == "tiny"
    out_dir = args.out or "bench-out/gpu-report"
    os.makedirs(out_dir, exist_ok=True)
    common = (["--device", "cpu", "--repeats", "1", "--warmup", "0", "--ratios", "0.5", "--no-memory"] if tiny else
              ["--device", args.device, "--ratios", "0.5"])
    todo = list(enumerate(entries()))
    if getattr(args, "only", None):
        todo = [(i, e) for i, e in todo if slug(e.title) in pick(args.only)]
    started = clock()
    done: List[Dict[str, Any]] = []
    for index, entry in todo:
        path = os.path.join(out_dir, f"{index:02d}-{slug(entry.title)}.json")
        elapsed = clock() - started
        if elapsed + (0.0 if tiny else entry.cost_s) > args.budget:
            done.append({"title": entry.title, "status": f"not run: it would pass the {args.budget:.0f} s budget "
                                                          f"({elapsed:.0f} s spent, about {entry.cost_s:.0f} s more)"})
            continue
        own = common if "--ratios" not in entry.args else [a for i, a in enumerate(common)  # the entry's own ratios
                                                            if "--ratios" not in common[max(i - 1, 0):i + 1]]
        argv = (tiny_args(entry.args) if tiny else list(entry.args)) + own + ["--json", path]
        print(f"[{elapsed:.0f} s] {entry.title}: bench {' '.join(argv)}", file=sys.stderr, flush=True)
        t0 = clock()
        record: Dict[str, Any] = {"title": entry.title, "args": argv}
        try:
            code = bench(argv)
        except Exception as exc:  # noqa: BLE001 - one run's failure is reported, the others still run
            code = None
            record["status"] = f"failed: {type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}"
            record["traceback"] = traceback.format_exc()[-4000:]
            print(record["traceback"], file=sys.stderr, flush=True)
        record["wall_s"] = clock() - t0
        if code is None:
            pass
        elif code != 0 or not os.path.exists(path):
            record["status"] = f"failed (exit {code})"
        else:
            record["status"] = "ok"
            with open(path) as f:
                record["result"] = json.load(f)
        done.append(record)
        between()
        _write(out_dir, args, done + [{"title": e.title, "status": "pending: not reached"} for _, e in todo[len(done):]],
               clock() - started)
    text = _write(out_dir, args, done, clock() - started)
    print(text)
    print(f"report: {os.path.join(out_dir, 'report.md')}")
    return 0 if all(r["status"] == "ok" for r in done if not r["status"].startswith("not run")) else 1


def _write(out_dir: str, args: argparse.Namespace, runs: List[Dict[str, Any]], total_s: float) -> str:
    report = {"preset": "gpu", "config": args.preset_config, "budget_s": args.budget, "total_s": total_s, "runs": runs}
    with open(os.path.join(out_dir, "report.json"), "w") as f:
        json.dump(report, f, indent=2, default=float)
    text = markdown(report)
    with open(os.path.join(out_dir, "report.md"), "w") as f:
        f.write(text)
    return text


def _machine(report: Dict[str, Any]) -> Optional[str]:
    for run in report["runs"]:
        if "result" in run:
            m = run["result"]["machine"]
            return f"{m.get('device', '?')}, torch {m.get('torch', '?')}"
    return None


def _own(row: Any) -> str:
    """ToMe's own work as a share of the forward it was timed in, and its host part (GPU runs)."""
    if row.method != "tome" or not row.tome_fraction:
        return "-"
    text = f"{row.tome_fraction:.0%}"
    if row.tome_host_s is not None and row.tome_time_s:
        text += f" ({row.tome_host_s / row.tome_time_s:.0%} of it on the host)"
    return text


def markdown(report: Dict[str, Any]) -> str:
    """One table: a row per configuration of each run, its time per forward and speed-up over the run's
    baseline (eager or compiled, as the run was)."""
    from .measures import profiling
    from .measures.report import label
    from .measures.runner import Row

    lines = [f"GPU report ({report['config']} configurations) on {_machine(report) or 'no run completed'}; "
             f"{report['total_s']:.0f} s of a {report['budget_s']:.0f} s budget", "",
             "| run | configuration | ms per forward | host ms (no sync) | speed-up | ToMe's own work | output change |",
             "|---|---|---|---|---|---|---|"]
    for run in report["runs"]:
        if "result" not in run:
            lines.append(f"| {run['title']} | {run['status']} | | | | | |")
            continue
        result = run["result"]
        fields = set(Row.__dataclass_fields__)
        for data in result["results"]:
            row = Row(**{k: v for k, v in data.items() if k in fields})
            lines.append(f"| {run['title']} | {label(row, result['reference'])} | {1000 * row.time_s:.1f} | "
                         f"{'-' if row.host_time_s is None else f'{1000 * row.host_time_s:.1f}'} | {row.speedup:.2f}x | {_own(row)} | {row.output_change:.3f} |")
    notes = [f"- {run['title']}: {note}" for run in report["runs"] for note in run.get("result", {}).get("notes", [])]
    if notes:
        lines += ["", "Notes:", *notes]
    for run in report["runs"]:
        if run.get("result", {}).get("profile"):
            lines += [""] + profiling.markdown(run["title"], run["result"]["profile"])
    return "\n".join(lines).rstrip("\n") + "\n"
