"""The yardstick's report: the table printed, the JSON (schema tomesd-quality/1) and the plot of quality
against speed-up."""
from __future__ import annotations

import json
import math
import os
import platform
from dataclasses import asdict
from typing import Any, Dict

SCHEMA = "tomesd-quality/1"


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
