"""`bench --profile`: where one forward's time goes, op by op (torch.profiler), the baseline beside ToMe.

Timing ToMe's pieces (`tome_parts`) says how long matching, merging and unmerging take; the profile says what
inside them costs: the sort and the scattered writes that ToMA (ICML 2025) blames for ToMe's small gain on
GPUs with fused attention, against the attention and matrix products that merging shrinks. On a GPU the
time is the device's (the kernels each aten op launched), elsewhere the host's. Eager forwards only.
"""
from __future__ import annotations

from typing import Any, Dict, List

TOP = 20  # ops kept per configuration, by time


def run(settings: Any, kit: Any) -> Dict[str, Any]:
    """{configuration label: {"total_ms", "ops": [{"op", "calls", "ms"}, ...]}} for the baseline, each ToMe
    merge setting and the reference (no caches), one profiled forward each after one untimed forward."""
    from torch.profiler import ProfilerActivity, profile

    from .report import label
    from .runner import configurations

    model = kit.build(settings.config, settings.seed, settings.depth)
    inputs = kit.inputs(settings.config, settings.batch, settings.res, settings.seed + 1, settings.frames,
                        settings.width or None)
    device = kit.on_gpu()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device else [])
    found: Dict[str, Any] = {}
    for cfg in configurations(settings):
        if cfg.cache is not None or cfg.mode not in ("merge", "merge-prop", "downsample") or cfg.reuse_steps > 1:
            continue
        with kit.method(model, cfg, settings):
            kit.forward(model, inputs)
            kit.sync()
            with profile(activities=activities) as prof:
                kit.forward(model, inputs)
                kit.sync()
        found[label(cfg, kit.reference_name)] = summary(prof.key_averages(), device)
    return found


def summary(events: Any, device: bool) -> Dict[str, Any]:
    """The host-side ops (aten::*, not the kernels, which would count twice) by their own time: on a
    device, the kernels each op launched itself; else the op's own host time."""
    ops: List[Dict[str, Any]] = []
    for event in events:
        if not str(event.device_type).endswith("CPU"):
            continue
        micros = event.self_device_time_total if device else event.self_cpu_time_total
        if micros > 0:
            ops.append({"op": event.key, "calls": int(event.count), "ms": micros / 1000})
    ops.sort(key=lambda op: -op["ms"])
    return {"clock": "device" if device else "host", "total_ms": sum(op["ms"] for op in ops), "ops": ops[:TOP]}


def markdown(title: str, profiles: Dict[str, Any], rows: int = 10) -> List[str]:
    """A table of the ops that cost most under ToMe, beside their cost in the baseline and under each other
    configuration profiled; attention ops are listed whatever they cost (which SDPA kernel each one ran)."""
    base = profiles.get("baseline")
    names = [k for k in profiles if k != "baseline"]
    tome = next((profiles[k] for k in names if k.startswith("ToMe")), None)
    if base is None or tome is None:
        return []
    costs = {name: {op["op"]: op for op in profiles[name]["ops"]} for name in ["baseline"] + names}
    shown = [op["op"] for op in tome["ops"][:rows]]
    shown += sorted({op for table in costs.values() for op in table if "attention" in op} - set(shown))
    lines = [f"{title}: {tome.get('clock', 'device')} time by op, one forward (ms)", "",
             "| op | baseline | " + " | ".join(names) + " |", "|---" * (len(names) + 2) + "|",
             "| all ops | " + " | ".join(f"{profiles[n]['total_ms']:.1f}" for n in ["baseline"] + names) + " |"]
    for op in shown:
        cells = []
        for name in ["baseline"] + names:
            found = costs[name].get(op)
            cells.append("-" if found is None else f"{found['ms']:.1f} ({found['calls']})")
        lines.append(f"| {op} | " + " | ".join(cells) + " |")
    return lines + [""]
