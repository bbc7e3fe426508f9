"""Each model's GPU setting, picked by predicted device time: `python -m tomesd.devicetime picks` writes
tomesd/devicetime/picks.json (read by frontier.GPU_PICKS, `tune --device cuda` and tomesd.recommend) and
docs/device-picks.md.

For each model at real width (the frontier's run in docs/, whose points carry each setting's yardstick PSNR), every
setting is traced on the meta device at the GPU's dtype and priced per denoiser call over a loop by the device-time
model (model.py): a setting that restores tokens runs one call in `reuse_steps` unmerged (the baseline's time) and
the others merged; a reused matching is priced as if matched every step (what it saves is left out: conservative).
The pick is the closest setting (yardstick PSNR) whose predicted device-time ratio reaches the model's goal; with no
yardstick (Flux), the mildest that does. Where none does, the best predicted setting is named with what holds it back:
the share of the baseline's device time in kernels it leaves unchanged, and ToMe's own kernels' share."""
from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from .model import Rates, predict, rates_for
from .trace import Launch, TraceRefused

PICKS_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "picks.json")
GPU = "h100"  # the picks' GPU; the H200's ratios differ little (docs/device-picks.md lists both)


@dataclass(frozen=True)
class Goal:
    arch: str  # bench's --arch
    config: str  # bench's --config
    frontier: str  # the frontier run whose settings and closeness are priced
    res: Tuple[int, int]
    frames: Optional[int]
    batch: int  # two for classifier-free guidance, one for Flux (guidance-distilled)
    goal: float  # the predicted device-time ratio to reach, set past the best peers' claims


GOALS = (
    Goal("sd1", "sd15", "docs/frontier-gpu-sd1-1024.json", (1024, 1024), None, 2, 1.3),
    Goal("sdxl", "sdxl", "docs/frontier-gpu-sdxl-1024.json", (1024, 1024), None, 2, 1.4),  # ToMA: about 1.3x
    Goal("sd3", "sd3", "docs/frontier-gpu-sd3-1024.json", (1024, 1024), None, 2, 1.55),  # SDTM: 1.55x
    Goal("flux", "flux", "docs/frontier-gpu-flux-1024.json", (1024, 1024), None, 1, 1.7),  # ToMA: about 1.3x
    Goal("wan", "wan", "docs/frontier-gpu-wan-81f.json", (480, 832), 81, 2, 1.5),
)


def _split(kwargs: Dict[str, Any]) -> Tuple[Dict[str, Any], int, bool]:
    """(the setting as one forward runs it, reuse_steps, restore_tokens)."""
    one = dict(kwargs)
    k = one.pop("reuse_steps", 1)
    restored = one.pop("restore_tokens", False)
    return one, k, restored


def unchanged_share(base: List[Launch], other: List[Launch], rates: Rates) -> float:
    """The share of the baseline's predicted device time in kernels `other` launches unchanged (same op, work and
    bytes): what no ratio of this setting can reduce."""
    left = Counter((l.op, l.flops, l.bytes) for l in other if not l.own)
    kept = 0.0
    for launch in base:
        key = (launch.op, launch.flops, launch.bytes)
        if left[key] > 0:
            left[key] -= 1
            kept += rates.kernel_ms(launch)
    return kept / sum(rates.kernel_ms(l) for l in base)


def price(goal: Goal, gpu: str = GPU) -> Dict[str, Any]:
    """Every setting of the goal's frontier run, priced on `gpu`, and the pick."""
    from ..bench.forward_trace import ForwardTracer, gpu_dtype
    from ..bench.kits.configs import ARCHS
    from ..bench.measures.runner import Config
    from ..frontier import gpu_pick

    with open(goal.frontier) as f:
        doc = json.load(f)
    config = goal.config
    rates = rates_for(gpu)
    tracer = ForwardTracer(dict(config=config, res=goal.res[0], width=goal.res[1], batch=goal.batch,
                                frames=goal.frames or 16, dtype=gpu_dtype(ARCHS[config]), ratios=()))
    base_launches = tracer.launches(Config("baseline"))
    base = predict(base_launches, rates)
    points = []
    for point in doc["points"]:
        if point.get("cache") or "ratio_schedule" in point["kwargs"]:
            continue
        one, k, restored = _split(point["kwargs"])
        entry = {"name": point["name"], "kwargs": point["kwargs"], "psnr": point.get("psnr"),
                 "flop_ratio": point.get("flop_ratio")}
        try:
            launches = tracer.launches(Config("tome", kwargs=json.dumps(one, sort_keys=True)))
        except (TraceRefused, ValueError) as exc:
            entry["refused"] = str(exc)
            points.append(entry)
            continue
        merged = predict(launches, rates)
        per_call = (base.total_ms + (k - 1) * merged.total_ms) / k if restored else merged.total_ms
        entry.update(device_ms=per_call, predicted_ratio=base.total_ms / per_call,
                     tome_own_share=merged.own_ms / merged.total_ms,
                     unchanged_share=unchanged_share(base_launches, launches, rates))
        points.append(entry)
    priced = [p for p in points if "predicted_ratio" in p]
    yardstick = doc.get("yardstick") if any(p["psnr"] is not None for p in priced) else None
    pick, rule = gpu_pick(priced, goal.goal, yardstick is not None, key="predicted_ratio")
    reaching = pick is not None
    if reaching and yardstick:
        rule = rule.replace("closest", f"closest on the {yardstick} yardstick")
    elif not reaching:
        pick = max(priced, key=lambda p: p["predicted_ratio"])
        rule = (f"nothing reaches {goal.goal}x: the fastest predicted, held back by the "
                f"{100 * pick['unchanged_share']:.0f}% of the baseline's device time it leaves unchanged and ToMe's "
                f"own kernels' {100 * pick['tome_own_share']:.0f}%")
    return {"arch": goal.arch, "res": list(goal.res), "frames": goal.frames, "batch": goal.batch, "gpu": gpu,
            "dtype": tracer.settings.dtype, "goal": goal.goal, "frontier": goal.frontier, "yardstick": yardstick,
            "baseline_device_ms": base.total_ms, "reached": bool(reaching), "rule": rule, "pick": pick["name"],
            "points": points}


def main(out: Optional[str] = None, report: str = "docs/device-picks.md") -> int:
    found = [price(goal) for goal in GOALS]
    with open(out or PICKS_PATH, "w") as f:
        json.dump({"gpu": GPU, "predicted": True, "models": found}, f, indent=1)
    lines = ["# Each model's GPU setting, picked by predicted device time", "",
             "Written by `python -m tomesd.devicetime picks` (tomesd/devicetime/picks.py says how; the figures are "
             f"predictions of the device-time model on an {GPU.upper()}, eager, [validated](device-model.md)).", ""]
    for m in found:
        pick = next(p for p in m["points"] if p["name"] == m["pick"])
        size = f"{m['res'][0]}x{m['res'][1]}" + (f", {m['frames']} frames" if m["frames"] else "")
        lines += [f"## {m['arch']} {size}, batch {m['batch']}, {m['dtype']}: goal {m['goal']}x", "",
                  f"Pick: **{m['pick']}** (`{json.dumps(pick['kwargs'])}`): {pick['predicted_ratio']:.2f}x predicted, "
                  f"FLOPs {pick['flop_ratio']:.2f}x, " + (f"{pick['psnr']:.1f} dB; " if pick["psnr"] else "")
                  + m["rule"] + ".", "",
                  "| setting | predicted device-time ratio | FLOPs ratio | PSNR | ToMe's own kernels | unchanged |",
                  "|---|---|---|---|---|---|"]
        for p in sorted(m["points"], key=lambda p: -p.get("predicted_ratio", 0)):
            if "refused" in p:
                lines.append(f"| {p['name']} | not traced: {p['refused'][:120]} | | | | |")
                continue
            psnr = "-" if p["psnr"] is None else f"{p['psnr']:.1f}"
            lines.append(f"| {p['name']} | {p['predicted_ratio']:.2f}x | {p['flop_ratio']:.2f}x | {psnr} | "
                         f"{100 * p['tome_own_share']:.1f}% | {100 * p['unchanged_share']:.0f}% |")
        lines.append("")
    with open(report, "w") as f:
        f.write("\n".join(lines))
    for m in found:
        print(f"{m['arch']}: {m['pick']} - {m['rule']}")
    return 0


def shipped() -> Dict[str, Any]:
    with open(PICKS_PATH) as f:
        return json.load(f)
