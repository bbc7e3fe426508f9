"""The device-time model: a kernel's time on a named GPU from what it computes, per class of op (trace.py).

Each class has a floor, the time any kernel of it takes however small (launch, a wave of blocks, the tail), and a
rate: floating-point operations per millisecond for matrix products, convolutions and fused attention, bytes per
millisecond for the rest. A kernel's time is its floor plus its work over the rate, the roofline's two limits
added rather than maxed (a kernel that is neither tiny nor large pays some of both). The rates are fitted on the
device profiles recorded in docs/gpu/ (fit.py) and shipped in rates.json beside this module, with their
validation error.

What it assumes: eager execution, one kernel per aten op as the profiles saw it. Under whole-model compilation
inductor fuses chains of elementwise ops into one kernel, which this model does not know: compiled rows are
predicted as eager ones, and no recorded compiled run has a profile to check them on."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from .trace import CLASSES, Launch

RATES_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rates.json")


class UnknownGPU(ValueError):
    pass


@dataclass(frozen=True)
class Rates:
    """One GPU's rates: the floor (ms per kernel), and per class the time per FLOP and per byte moved (the compute
    classes pay both, the others bytes alone, at a rate of their class or a finer one: trace.term_of), and fused
    attention's time per query-key pair (its exponentials
    and softmax steps, which a short head does not hide behind its products)."""
    gpu: str
    floor_ms: float
    flop_ms: Dict[str, float]
    byte_ms: Dict[str, float]
    score_ms: float = 0.0

    def kernel_ms(self, launch: Launch) -> float:
        return self.floor_ms + self.compute_ms(launch) + launch.bytes * self.byte_ms.get(launch.term, 0.0)

    def compute_ms(self, launch: Launch) -> float:
        """The part of kernel_ms that follows the GPU's compute (FLOPs, attention's pairs)."""
        flops = launch.padded_flops or launch.flops
        return flops * self.flop_ms.get(launch.cls, 0.0) + launch.scores * self.score_ms

    def as_dict(self) -> Dict[str, Any]:
        return {"floor_ms": self.floor_ms, "flop_ms": self.flop_ms, "byte_ms": self.byte_ms, "score_ms": self.score_ms}


@dataclass
class Prediction:
    """One forward's predicted device time, in all and per class, and the part ToMe's own kernels take."""
    gpu: str
    total_ms: float
    by_class: Dict[str, float] = field(default_factory=dict)
    own_ms: float = 0.0
    kernels: int = 0

    def as_dict(self) -> Dict[str, Any]:
        return {"gpu": self.gpu, "device_ms": self.total_ms, "tome_own_ms": self.own_ms, "kernels": self.kernels,
                "by_class_ms": dict(self.by_class)}


def predict(launches: List[Launch], rates: Rates) -> Prediction:
    by_class = {cls: 0.0 for cls in CLASSES}
    own = 0.0
    for launch in launches:
        ms = rates.kernel_ms(launch)
        by_class[launch.cls] += ms
        if launch.own:
            own += ms
    return Prediction(rates.gpu, sum(by_class.values()), by_class, own, len(launches))


def shipped() -> Dict[str, Any]:
    """rates.json: {"gpus": {name: {"floor_ms", "unit_ms"}}, "validation": {...}}."""
    with open(RATES_PATH) as f:
        return json.load(f)


def known_gpus() -> List[str]:
    return sorted(shipped()["gpus"])


def rates_for(gpu: str, table: Optional[Dict[str, Any]] = None) -> Rates:
    """The shipped rates of `gpu` (h100, h200), or UnknownGPU naming the ones known."""
    table = table or shipped()
    key = gpu.lower()
    if key not in table["gpus"]:
        raise UnknownGPU(f"the device-time model has no rates for {gpu!r}; it knows {', '.join(sorted(table['gpus']))} "
                         f"(fitted on the profiles in docs/gpu/)")
    entry = table["gpus"][key]
    return Rates(key, entry["floor_ms"], dict(entry["flop_ms"]), dict(entry["byte_ms"]), entry["score_ms"])
