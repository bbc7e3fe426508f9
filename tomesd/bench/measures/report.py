"""Turning benchmark rows into the printed table, the JSON file and the plot."""
from __future__ import annotations

import json
import os
import platform
import statistics
from dataclasses import asdict
from typing import Any, Dict, List, Optional

SCHEMA = "tomesd-bench/2"


def _mib(n: Optional[int]) -> str:
    return "-" if not n else f"{n / 2**20:,.0f}"


def _pct(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:+.0%}" if x else "0%"


def label(row: Any, reference_name: str) -> str:
    cache = getattr(row, "cache", None)
    if row.method == "baseline":
        return "baseline" if cache is None else f"{cache} alone"
    if row.method == "reference":
        return f"{reference_name} r={row.ratio:g}"
    if row.mode in ("downsample", "downsample-restore"):
        name = "downsample (ours)" + (f" reuse {row.reuse_steps} restore" if row.mode == "downsample-restore" else "")
    else:
        name = f"ToMe (ours) r={row.ratio:g}" + (f" reuse {row.reuse_steps}" if row.reuse_steps > 1 else "")
        name += {"merge-mlp": " merge_mlp", "merge-prop": " prop", "merge-restore": " prop restore"}.get(row.mode, "")
    return name if cache is None else f"{name} + {cache}"


def _ratio(row: Any) -> str:
    ratio = getattr(row, "flop_speedup", None)
    return "-" if ratio is None else f"{ratio:.2f}x"


# apply_patch's defaults: arguments equal to them are left out of the printed call.
_DEFAULTS = dict(max_downsample=None, seed=0, reuse_steps=1, merge_mlp=False, downsample_factor=2,
                 downsample_method="nearest")


def spread(rows: List[Any]) -> Optional[float]:
    """This run's noise: the largest relative spread (max - min over the median) of any configuration's
    timed repeats; None with fewer than two repeats."""
    spreads = [(max(r.times_s) - min(r.times_s)) / statistics.median(r.times_s) for r in rows if len(r.times_s) >= 2]
    return max(spreads) if spreads else None


def verdict(rows: List[Any], reference_name: str, settings: Any) -> str:
    """One line: the setting of ours that paid most in this run, as the call that applies it, or that none
    paid more than the run's noise."""
    from .runner import Config

    ours = [r for r in rows if r.method == "tome" or (r.method == "baseline" and getattr(r, "cache", None))]
    if not ours:
        return "paid most here: nothing to compare (only the baseline ran)"
    best = max(ours, key=lambda r: r.speedup)
    noise = spread(rows)
    noise_text = "unknown with one repeat" if noise is None else f"{noise:.0%}"
    if noise is not None and best.speedup - 1 <= noise:
        return (f"paid most here: no setting is faster than the baseline by more than this run's noise "
                f"({noise_text} between repeats; the fastest, {label(best, reference_name)}, ran {best.speedup:.2f}x)")
    kwargs = Config(best.method, best.ratio, best.mode, best.reuse_steps).patch_kwargs(settings) \
        if best.method == "tome" else {}
    args = ", ".join(f"{k}={v!r}" for k, v in kwargs.items() if _DEFAULTS.get(k, object()) != v)
    call = f"tomesd.apply_patch(model{', ' + args if args else ''})" if best.method == "tome" else "no ToMe patch"
    cache = getattr(best, "cache", None)
    with_cache = f" with diffusers' {cache} cache" if cache else ""
    return (f"paid most here: {label(best, reference_name)}, {best.speedup:.2f}x ({call}{with_cache}; output "
            f"change {best.output_change:.3f}; repeats differed by up to {noise_text})")


def table(rows: List[Any], reference_name: str) -> str:
    compiled = any(getattr(row, "compile_s", None) is not None for row in rows)
    looped = any(getattr(row, "loop_change", None) is not None for row in rows)
    head = ("| configuration | time per UNet call (s) | speed-up | FLOPs ratio | peak memory (MiB) | memory saved | "
            "ToMe's own time | output change |" + (" mean change over the loop |" if looped else "")
            + " self-attn keys per level (without -> with) |")
    if compiled:
        head += " first call, compiling (s) |"
    lines = [head, "|" + "---|" * (9 + compiled + looped)]
    for row in rows:
        tokens = ", ".join(
            # level 0: a video transformer's sequence of every frame
            f"{f'L{level}' if level != '0' else 'all frames'}: {before}->{after}"
            for level, (before, after) in sorted(row.tokens.items(), key=lambda kv: int(kv[0])) if before != after
        ) or "none merged"
        saved = "-" if row.mem_reduction is None else f"{row.mem_reduction:.0%}"
        own = "-" if row.tome_fraction is None else f"{row.tome_fraction:.1%} of the UNet"
        line = (
            f"| {label(row, reference_name)} | {row.time_s:.3f} | {row.speedup:.2f}x | {_ratio(row)} | "
            f"{_mib(row.peak_mem_bytes)} | "
            f"{saved} | {own} | {row.output_change:.3f} |"
            + (f" {row.loop_change:.3f} |" if looped else "") + f" {tokens} |"
        )
        if compiled:
            line += " - |" if row.compile_s is None else f" {row.compile_s:.2f} |"
        lines.append(line)
    counted = [row for row in rows if getattr(row, "launches", None) is not None]
    if counted:
        lines += ["", "Host work of one eager forward (kernel launches = aten ops, views left out; Python calls = "
                  "functions called), and what ToMe adds per block it reduces:", "",
                  "| configuration | launches | Python calls | reduced blocks | + launches per block | "
                  "+ Python calls per block |", "|---|---|---|---|---|---|"]
        for row in counted:
            per = ("-", "-") if row.added_launches_per_block is None else (
                f"{row.added_launches_per_block:.1f}", f"{row.added_python_calls_per_block:.1f}")
            lines.append(f"| {label(row, reference_name)} | {row.launches:,} | {row.python_calls:,} | "
                         f"{row.reduced_blocks if row.reduced_blocks is not None else '-'} | {per[0]} | {per[1]} |")
    for row in rows:
        if getattr(row, "restore_sites", None):
            what = "downsampled attention" if row.mode == "downsample-restore" else "merging site"
            lines.append(f"\n{label(row, reference_name)} keeps {row.restore_bytes / 2**20:,.1f} MiB of residuals between its "
                         f"unreduced and reduced steps: {row.restore_sites} tensors (one per {what}, output and call "
                         f"of a step), {row.restore_bytes / row.restore_sites / 2**20:,.2f} MiB each")
    return "\n".join(lines)


def machine(kit: Any) -> Dict[str, Any]:
    info: Dict[str, Any] = {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()}
    if kit.name == "torch":
        info["torch"] = kit.torch.__version__
        info["device"] = kit.torch.cuda.get_device_name() if kit.on_gpu() else platform.processor() or "cpu"
    else:
        info["paddle"] = kit.paddle.__version__
        info["device"] = kit.paddle.device.get_device()
    return info


def write_json(path: str, settings: Any, rows: List[Any], kit: Any, pipeline: Optional[Dict[str, Any]] = None,
               notes: Optional[List[str]] = None, profiles: Optional[Dict[str, Any]] = None) -> None:
    doc: Dict[str, Any] = {
        "schema": SCHEMA,
        "machine": machine(kit),
        "settings": asdict(settings),
        "reference": kit.reference_name,
        "results": [asdict(row) for row in rows],
        "verdict": verdict(rows, kit.reference_name, settings),
    }
    if pipeline is not None:
        doc["pipeline"] = pipeline
    if notes:
        doc["notes"] = list(notes)
    if profiles:
        doc["profile"] = profiles  # profiling.run: the ops that cost most in one forward per configuration
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=2, default=float)


def write_plot(path: str, rows: List[Any], reference_name: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_speed, ax_mem) = plt.subplots(1, 2, figsize=(10, 4))
    series = [(("tome", "merge", 1), "ToMe (ours)", "o-"), (("reference", "merge", 1), reference_name, "s--")]
    series += [(("tome", "merge", k), f"ToMe (ours), reuse {k}", "^-")
               for k in sorted({r.reuse_steps for r in rows if r.reuse_steps > 1})]
    for key, name, style in series:
        sel = sorted((r for r in rows if (r.method, r.mode, r.reuse_steps) == key), key=lambda r: r.ratio)
        if not sel:
            continue
        ratios = [r.ratio for r in sel]
        ax_speed.plot(ratios, [r.speedup for r in sel], style, label=name)
        if all(r.mem_reduction is not None for r in sel):
            ax_mem.plot(ratios, [100 * r.mem_reduction for r in sel], style, label=name)
    for row in rows:  # no ratio: a level line
        if row.mode == "downsample":
            ax_speed.axhline(row.speedup, color="tab:green", ls=":", label="downsample (ours)")
            if row.mem_reduction is not None:
                ax_mem.axhline(100 * row.mem_reduction, color="tab:green", ls=":", label="downsample (ours)")
    ax_speed.axhline(1.0, color="grey", lw=0.8)
    ax_speed.set(xlabel="ratio", ylabel="speed-up vs baseline (x)", title="UNet forward speed-up")
    ax_mem.set(xlabel="ratio", ylabel="peak memory saved (%)", title="Peak memory saved")
    for ax in (ax_speed, ax_mem):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
