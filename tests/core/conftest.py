"""The core's tests run on every framework that imports here, NumPy (the reference backend) always first.

Inputs are made with NumPy and handed to the core as each framework's tensors by the `fw` fixture; results
come back as NumPy arrays. Nothing here imports torch or paddle unless a test asks for it, so tests/core
runs with NumPy and pytest alone.
"""
import importlib
import importlib.util

import numpy as np
import pytest

import numpy_backend  # noqa: F401  (registers the NumPy backend with tome_core)
from tome_core import get_backend



def _installed(module: str) -> bool:
    """Whether `module` is an installed package; tests/torch and tests/paddle, on sys.path as namespace
    packages of the same names, are not."""
    spec = importlib.util.find_spec(module)
    return spec is not None and spec.origin not in (None, "namespace")


BACKENDS = ["numpy"] + [m for m in ("torch", "paddle") if _installed(m)]


class Framework:
    """One framework as the core's tests see it: numpy arrays in, tensors of the framework out, and back."""

    def __init__(self, name: str):
        self.name = name
        if name != "numpy":
            # The application registers its framework backends (lazily) when imported.
            importlib.import_module("tomesd")
        self.module = importlib.import_module(name)
        self.xp = get_backend(self.tensor(np.zeros(1)))  # the backend tome_core finds for this framework's tensors
        assert self.xp.name == name

    def tensor(self, a) -> object:
        a = np.array(a)  # a copy: the tensor shares no memory with the caller's array
        if self.name == "numpy":
            return a
        if self.name == "torch":
            return self.module.from_numpy(a)
        return self.module.to_tensor(a)

    def numpy(self, t) -> np.ndarray:
        if isinstance(t, (np.ndarray, np.generic)):
            return np.asarray(t)
        if self.name == "torch":
            return t.detach().cpu().numpy()
        return t.numpy()

    def __repr__(self) -> str:
        return self.name


@pytest.fixture(params=BACKENDS)
def fw(request) -> Framework:
    return Framework(request.param)
