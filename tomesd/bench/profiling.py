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
        if cfg.cache is not None or cfg.mode == "merge-mlp" or cfg.reuse_steps > 1:
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
    """A table of the ops that cost most under ToMe, beside their cost in the baseline."""
    base = profiles.get("baseline")
    tome = next((v for k, v in profiles.items() if k.startswith("ToMe")), None)
    if base is None or tome is None:
        return []
    before = {op["op"]: op["ms"] for op in base["ops"]}
    lines = [f"{title}: {tome.get('clock', 'device')} time by op, one forward (ms)", "",
             "| op | baseline | ToMe r=0.5 |", "|---|---|---|",
             f"| all ops | {base['total_ms']:.1f} | {tome['total_ms']:.1f} |"]
    for op in tome["ops"][:rows]:
        old = before.get(op["op"])
        lines.append(f"| {op['op']} ({op['calls']} calls) | {'-' if old is None else f'{old:.1f}'} | {op['ms']:.1f} |")
    return lines + [""]
