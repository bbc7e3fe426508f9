"""`python -m tomesd bench --preset gpu` (`make bench-gpu`): the GPU report in one command.

A fixed list of loop-bench runs on one CUDA GPU in half precision with PyTorch's fused attention: SD1.5 at
512², 1024² and 2048², SDXL at 1024² (both beside tomesd 0.1.3), SD3 at 1024², Flux at 1024² (cut to
FLUX_DEPTH double-stream blocks, twice as many single-stream) and Wan at 480x832, eager and compiled, then
each of diffusers' step caches stacked with ToMe over a denoising loop. Each run writes its JSON; the report
is one markdown table of them all (`report.md`) and `report.json`.

The runs go in order of what a user asks first, under a wall-clock budget (default 540 s): a run that would
start after it is listed as not run, so the command always ends in time. `--preset-config tiny` runs the same
list on the tiny configurations on CPU (a check of the plumbing, not a measurement).
"""
from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

FLUX_DEPTH = 6  # of Flux.1-dev's 19 double-stream blocks (12 of 38 single-stream): random weights at full
# width for 57 blocks take minutes to build; the per-block cost is what ToMe changes.
STEPS = 8  # denoising steps in the cache runs
BUDGET_S = 540.0


@dataclass(frozen=True)
class Entry:
    title: str
    args: Tuple[str, ...]


def _run(title: str, arch: str, res: str, dtype: str, *extra: str) -> Entry:
    return Entry(title, ("--arch", arch, "--res", res, "--dtype", dtype, *extra))


def entries() -> List[Entry]:
    """The report's runs, in order."""
    half, bf16 = "float16", "bfloat16"
    ref = ("--compare",)  # tomesd 0.1.3 beside ours (UNets)
    runs = [
        _run("SD1.5 512²", "sd1", "512", half, *ref),
        _run("SD1.5 1024²", "sd1", "1024", half, *ref),
        _run("SD1.5 2048²", "sd1", "2048", half, *ref),
        _run("SDXL 1024²", "sdxl", "1024", half, *ref),
        _run("SD3 1024²", "sd3", "1024", half),
        _run(f"Flux 1024² (depth {FLUX_DEPTH})", "flux", "1024", bf16, "--depth", str(FLUX_DEPTH)),
        _run("Wan 480x832, 17 frames", "wan", "480x832", bf16),
        _run("SD1.5 1024² compiled", "sd1", "1024", half, "--compile", *ref),
        _run("SDXL 1024² compiled", "sdxl", "1024", half, "--compile", *ref),
        _run("SD3 1024² compiled", "sd3", "1024", half, "--compile"),
        _run(f"Flux 1024² (depth {FLUX_DEPTH}) compiled", "flux", "1024", bf16, "--depth", str(FLUX_DEPTH), "--compile"),
        _run("Wan 480x832 compiled", "wan", "480x832", bf16, "--compile"),
    ]
    loop = ("--steps", str(STEPS), "--modes", "merge")
    for cache in ("taylorseer", "fbc", "magcache", "pab"):
        runs.append(_run(f"Flux 1024² (depth {FLUX_DEPTH}) + {cache}", "flux", "1024", bf16, "--depth",
                         str(FLUX_DEPTH), *loop, "--cache", cache))
    for cache in ("taylorseer", "fastercache", "pab", "magcache"):
        runs.append(_run(f"SD3 1024² + {cache}", "sd3", "1024", half, *loop, "--cache", cache))
    runs.append(_run("Wan 480x832 + taylorseer", "wan", "480x832", bf16, *loop, "--cache", "taylorseer"))
    return runs


# --preset-config tiny: each architecture's tiny stand-in, at a small size, float32 on CPU.
TINY = {"sd1": "tiny", "sdxl": "tiny", "sd3": "tiny-sd3", "flux": "tiny-flux", "wan": "tiny-wan"}


def tiny_args(args: Sequence[str]) -> List[str]:
    """An entry's arguments for the CPU check: tiny configurations, 64² (48x80 for Wan's 480x832), float32,
    compiled with the `eager` backend, one timed forward."""
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
        elif arg == "--depth":
            next(it)
        elif arg == "--compile":
            out += ["--compile", "--compile-backend", "eager"]
        elif arg == "--steps":
            next(it)
            out += ["--steps", "3"]
        else:
            out.append(arg)
    return out


def slug(title: str) -> str:
    keep = "".join(c if c.isalnum() else "-" for c in title.lower().replace("²", "")).strip("-")
    return "-".join(part for part in keep.split("-") if part)


def run(args: argparse.Namespace, bench: Callable[[List[str]], int], clock: Callable[[], float] = time.monotonic) -> int:
    """Run the preset's entries through `bench` (the bench CLI on an argument list) into `args.out`, then
    write the report. `clock` is a seam for tests."""
    tiny = args.preset_config == "tiny"
    out_dir = args.out or "bench-out/gpu-report"
    os.makedirs(out_dir, exist_ok=True)
    common = (["--device", "cpu", "--repeats", "1", "--warmup", "0", "--ratios", "0.5", "--no-memory"] if tiny else
              ["--device", args.device, "--repeats", "5", "--warmup", "2", "--ratios", "0.5"])
    started, done = clock(), []
    for index, entry in enumerate(entries()):
        path = os.path.join(out_dir, f"{index:02d}-{slug(entry.title)}.json")
        elapsed = clock() - started
        if elapsed > args.budget:
            done.append({"title": entry.title, "status": f"not run: the {args.budget:.0f} s budget was spent"})
            continue
        argv = (tiny_args(entry.args) if tiny else list(entry.args)) + common + ["--json", path]
        t0 = clock()
        code = bench(argv)
        record: Dict[str, Any] = {"title": entry.title, "args": argv, "wall_s": clock() - t0}
        if code != 0 or not os.path.exists(path):
            record["status"] = f"failed (exit {code})"
        else:
            record["status"] = "ok"
            with open(path) as f:
                record["result"] = json.load(f)
        done.append(record)
    report = {"preset": "gpu", "config": args.preset_config, "budget_s": args.budget,
              "total_s": clock() - started, "runs": done}
    with open(os.path.join(out_dir, "report.json"), "w") as f:
        json.dump(report, f, indent=2, default=float)
    text = markdown(report)
    with open(os.path.join(out_dir, "report.md"), "w") as f:
        f.write(text)
    print(text)
    print(f"report: {os.path.join(out_dir, 'report.md')}")
    return 0 if all(r["status"] == "ok" for r in done if not r["status"].startswith("not run")) else 1


def _machine(report: Dict[str, Any]) -> Optional[str]:
    for run in report["runs"]:
        if "result" in run:
            m = run["result"]["machine"]
            return f"{m.get('device', '?')}, torch {m.get('torch', '?')}"
    return None


def markdown(report: Dict[str, Any]) -> str:
    """One table: a row per configuration of each run, its time per forward and speed-up over the run's
    baseline (eager or compiled, as the run was)."""
    from .report import label
    from .runner import Row

    lines = [f"GPU report ({report['config']} configurations) on {_machine(report) or 'no run completed'}; "
             f"{report['total_s']:.0f} s of a {report['budget_s']:.0f} s budget", "",
             "| run | configuration | ms per forward | speed-up | output change |", "|---|---|---|---|---|"]
    for run in report["runs"]:
        if "result" not in run:
            lines.append(f"| {run['title']} | {run['status']} | | | |")
            continue
        result = run["result"]
        fields = set(Row.__dataclass_fields__)
        for data in result["results"]:
            row = Row(**{k: v for k, v in data.items() if k in fields})
            lines.append(f"| {run['title']} | {label(row, result['reference'])} | {1000 * row.time_s:.1f} | "
                         f"{row.speedup:.2f}x | {row.output_change:.3f} |")
    notes = [f"- {run['title']}: {note}" for run in report["runs"] for note in run.get("result", {}).get("notes", [])]
    if notes:
        lines += ["", "Notes:", *notes]
    return "\n".join(lines) + "\n"
