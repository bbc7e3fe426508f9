"""tomesd 0.1.3's `tomesd.utils`: the two helpers hosts import from it (kohya's training scripts, SD.Next's
DirectML hook), with tomesd's behaviour. Importing this module imports no framework."""
from __future__ import annotations

from typing import Any, Optional


def isinstance_str(x: object, cls_name: str) -> bool:
    """Whether a class *named* `cls_name` is in x's class's ancestry (no import of that class needed)."""
    return any(cls.__name__ == cls_name for cls in type(x).__mro__)


def init_generator(device: Any, fallback: Optional[Any] = None) -> Any:
    """A torch.Generator on `device` forked from that device's global RNG state (CPU and CUDA); on another
    device, `fallback`, or else a fork of the CPU's."""
    import torch

    device = torch.device(device)
    if device.type == "cpu":
        return torch.Generator(device="cpu").set_state(torch.get_rng_state())
    if device.type == "cuda":
        return torch.Generator(device=device).set_state(torch.cuda.get_rng_state(device))
    return init_generator(torch.device("cpu")) if fallback is None else fallback


def __getattr__(name: str) -> Any:
    if name == "torch":  # tomesd 0.1.3's module imported torch at its top; this one imports it when asked
        import torch

        return torch
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
