"""`bench --predict GPU`: each configuration's device time on a named GPU, predicted by the device-time model
(tomesd/devicetime) from one forward traced on the meta device at the run's width, size, batch and dtype. Nothing
is timed and no weights are allocated: it runs on any CPU in seconds. Every figure it prints is a prediction, and
says so beside the model's validation error."""
from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional

from ..devicetime.model import predict, rates_for, shipped
from ..devicetime.trace import TraceRefused
from .forward_trace import ForwardTracer
from .measures.report import label


def validation_note() -> str:
    v = shipped()["validation"]
    return (f"predicted by the device-time model (fitted on the profiles in docs/gpu/; leave-one-model-out error of "
            f"the device-time ratio: mean {100 * v['mean_abs_ratio_error']:.1f}%, worst "
            f"{100 * v['max_abs_ratio_error']:.1f}% over {v['configurations']} configurations; docs/device-model.md)")


def predictions(settings: Any, gpu: str) -> List[Dict[str, Any]]:
    """One row per configuration (the baseline first): FLOPs, predicted device ms, ToMe's own predicted ms and the
    predicted device-time and FLOPs ratios against the baseline. TraceRefused where the baseline cannot be traced;
    a configuration that cannot be traced gets a row saying why."""
    rates = rates_for(gpu)
    tracer = ForwardTracer(vars(settings))
    rows: List[Dict[str, Any]] = []
    for config in tracer.configs():
        name = label(config, tracer.kit.reference_name)
        try:
            launches = tracer.launches(config)
        except TraceRefused as exc:
            if config.method == "baseline":
                raise
            rows.append({"configuration": name, "refused": str(exc)})
            continue
        found = predict(launches, rates)
        flops = sum(l.flops for l in launches)
        rows.append({"configuration": name, "flops": flops, **found.as_dict()})
    base = rows[0]
    for row in rows:
        if "device_ms" in row:
            row["predicted_speedup"] = base["device_ms"] / row["device_ms"]
            row["flop_speedup"] = base["flops"] / row["flops"] if row["flops"] else None
            row["tome_own_share"] = row["tome_own_ms"] / row["device_ms"]
    return rows


def run(settings: Any, gpu: str, json_path: Optional[str]) -> int:
    try:
        rows = predictions(settings, gpu)
    except TraceRefused as exc:
        print(f"error: --predict {gpu}: {exc}")
        return 2
    depth = f" ({settings.depth} blocks)" if settings.depth else ""
    print(f"{settings.config}{depth} at {settings.res}x{settings.width or settings.res}, batch {settings.batch}, "
          f"{settings.dtype}, eager, on a {gpu.upper()}: {validation_note()}")
    print("| configuration | predicted device ms | predicted device-time ratio | FLOPs ratio | ToMe's own kernels |")
    print("|---|---|---|---|---|")
    for row in rows:
        if "refused" in row:
            print(f"| {row['configuration']} | - | - | - | {row['refused']} |")
            continue
        flops = "-" if row["flop_speedup"] is None else f"{row['flop_speedup']:.2f}x"
        print(f"| {row['configuration']} | {row['device_ms']:.1f} (predicted) | {row['predicted_speedup']:.2f}x "
              f"(predicted) | {flops} | {100 * row['tome_own_share']:.1f}% |")
    if json_path:
        os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
        with open(json_path, "w") as f:
            json.dump({"predicted": True, "gpu": gpu.lower(), "note": validation_note(), "settings": vars(settings),
                       "rows": rows}, f, indent=2, default=str)
        print(f"results: {json_path}")
    return 0
