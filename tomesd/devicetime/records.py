"""The recorded GPU runs the device-time model is fitted on: every bench JSON under docs/gpu/ that holds a device
profile (`bench --profile` on a CUDA GPU), one record per profiled configuration.

A profile lists one forward's aten ops by their own device time (the kernels each op launched), the 20 costliest
of them, and the total over all. Events that are not aten ops are left out of the total: "Command Buffer Full" is
the profiler's own stall, not a kernel (at SD1.5 2048² it adds 132 ms to a 308 ms baseline; the bench's wall-clock
speed-up, 1.63x, matches the total without it)."""
from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from .trace import CLASS_OF, CLASSES, CONV, ATTENTION, ELEMENTWISE

GPUS = {"h100": "H100", "h200": "H200"}  # the GPUs the model has rates for: key -> how the device names itself

# The profile's name of a kernel that the meta trace records under another (tomesd/devicetime/trace.py)
_PROFILE_CLASS = {"cudnn_convolution": CONV, "_cudnn_attention_forward": ATTENTION,
                  "_flash_attention_forward": ATTENTION, "_efficient_attention_forward": ATTENTION}


@dataclass(frozen=True)
class Record:
    """One profiled configuration of one recorded run."""
    path: str  # the bench JSON, relative to the repository
    gpu: str  # a key of GPUS
    settings: Tuple[Tuple[str, Any], ...]  # the run's bench settings, as sorted items
    label: str  # the configuration's label in the profile ("baseline", "ToMe (ours) r=0.5", ...)
    total_ms: float  # all aten ops' device time, one forward
    by_class: Tuple[Tuple[str, float], ...]  # the listed ops' device time per class (ms)
    calls: Tuple[Tuple[str, int], ...] = ()  # the listed aten ops' calls, by name without "aten::"

    def code_divergence(self, launches: List[Any]) -> float:
        """How far the kernels profiled are from those today's code launches: over the ops listed in both (but
        arange, fill_ and copy_, which the meta device names otherwise), the calls that differ over those
        profiled. A record of code since changed (Flux's merge before its flattened path: 397 products where
        today's code launches 181) is far from 0."""
        traced: Dict[str, int] = {}
        for launch in launches:
            traced[launch.op] = traced.get(launch.op, 0) + 1
        common = [(op, n) for op, n in self.calls if op in traced and op not in ("arange", "fill_", "copy_")]
        total = sum(n for _, n in common)
        return sum(abs(n - traced[op]) for op, n in common) / total if total else 0.0

    @property
    def model(self) -> str:
        """The group a leave-one-model-out fold holds out: the architecture at its size."""
        s = dict(self.settings)
        return f"{s['config']} {s['res']}"


def profile_class(op: str) -> Optional[str]:
    """The class a profile's op falls in, None for an event that is no aten op."""
    if not op.startswith("aten::"):
        return None
    name = op[len("aten::"):]
    return _PROFILE_CLASS.get(name) or CLASS_OF.get(name.rstrip("_")) or CLASS_OF.get(name, ELEMENTWISE)


def gpu_of(device: str) -> Optional[str]:
    return next((key for key, name in GPUS.items() if name in device), None)


def load(root: str) -> List[Record]:
    """Every profiled configuration under `root` (docs/gpu), in a fixed order."""
    records = []
    repo = os.path.dirname(os.path.dirname(os.path.abspath(root)))  # paths as the repository names them
    for path in sorted(glob.glob(os.path.join(root, "**", "*.json"), recursive=True)):
        with open(path) as f:
            data = json.load(f)
        if not isinstance(data, dict) or not data.get("profile"):
            continue
        gpu = gpu_of(str(data.get("machine", {}).get("device", "")))
        if gpu is None:
            continue
        settings = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in data["settings"].items()))
        for label, profile in data["profile"].items():
            if profile.get("clock") != "device":
                continue
            by_class: Dict[str, float] = {cls: 0.0 for cls in CLASSES}
            for op in profile["ops"]:
                cls = profile_class(op["op"])
                if cls is not None:
                    by_class[cls] += op["ms"]
            # the total counts every op, the listed 20 and the rest: the rest is aten ops (the profiler's own
            # events are among the listed ones wherever they cost anything)
            listed_other = sum(op["ms"] for op in profile["ops"] if profile_class(op["op"]) is None)
            total = profile["total_ms"] - listed_other
            calls = tuple((op["op"][len("aten::"):], int(op["calls"])) for op in profile["ops"]
                          if op["op"].startswith("aten::"))
            records.append(Record(os.path.relpath(path, repo), gpu, settings, label, total,
                                  tuple(sorted(by_class.items())), calls))
    return records
