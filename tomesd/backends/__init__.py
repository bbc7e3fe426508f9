"""Framework implementations of tome_core's array ops and of the module hooks the runtime uses.

Importing this package (which importing `tomesd` does) registers the torch and paddle backends with
tome_core by loader: each submodule imports its framework, and is imported only when a tensor of that
framework first reaches tome_core (or the runtime asks for its module ops), never on registration.
"""
from __future__ import annotations

import importlib
from typing import Any, Callable

from tome_core.backend import register_backend

# Top-level module of the framework's tensors -> the submodule here whose `backend` serves them.
FRAMEWORKS = ("torch", "paddle")


def _loader(framework: str) -> Callable[[], Any]:
    def load() -> Any:
        return importlib.import_module(f"{__name__}.{framework}").backend

    load.__qualname__ = f"load_{framework}_backend"
    return load


for _framework in FRAMEWORKS:
    register_backend(_framework, loader=_loader(_framework))
del _framework
