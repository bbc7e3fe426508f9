"""The benchmark's kit for a framework, picked by name (make_kit): what the benchmark needs from torch
(torch_kit.py) or paddle (paddle_kit.py), on the base they share (kit_base.py), whose names are handed on here."""
from __future__ import annotations

from typing import Any

from .kit_base import METHODS, MissingBackend, loop_timesteps, timed
from .paddle_kit import PaddleKit
from .torch_kit import TorchKit

__all__ = ["METHODS", "MissingBackend", "PaddleKit", "TorchKit", "loop_timesteps", "make_kit", "timed"]


def make_kit(backend: str, device: str, dtype: str) -> Any:
    kits = {"torch": TorchKit, "paddle": PaddleKit}
    if backend not in kits:
        raise MissingBackend(f"unknown backend {backend!r}: choose torch or paddle")
    return kits[backend](device, dtype)

