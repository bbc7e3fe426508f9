"""The array operations the algorithm is written against, and how a tensor finds its backend.

The core never imports a framework. A backend is an object with the methods of `Backend`; the
ones this project ships are named here by module path and imported only when a tensor of that
framework first arrives.
"""
from __future__ import annotations

import importlib
from typing import Any, ContextManager, Protocol, Sequence, Tuple

Array = Any

# Top-level module of a tensor's class -> "module:attribute" of the backend instance serving it.
_KNOWN_BACKENDS = {
    "torch": "tomesd.backends.torch:backend",
    "paddle": "tomesd.backends.paddle:backend",
}
_LOADED: dict = {}


class Backend(Protocol):
    """Array-API-style operations; integer tensors are int64, indices address one axis.

    Nothing here may read a tensor's values on the host: the per-call path stays free of
    device syncs and traceable by graph compilers.
    """

    name: str

    def no_grad(self) -> ContextManager: ...
    def shape(self, x: Array) -> Tuple[int, ...]: ...
    def arange(self, n: int, like: Array, step: int = 1) -> Array:
        """int64 [0, step, 2*step, ...) below n."""
    def zeros(self, shape: Sequence[int], like: Array, integer: bool = False) -> Array: ...
    def reshape(self, x: Array, shape: Sequence[int]) -> Array: ...
    def concat(self, xs: Sequence[Array], axis: int) -> Array: ...
    def take(self, x: Array, indices: Array, axis: int) -> Array: ...
    def scatter_add(self, target: Array, indices: Array, src: Array) -> Array:
        """Out-of-place `target[indices[i]] += src[i]` along axis 0 (the op the array API lacks)."""
    def scatter_reduce(self, target: Array, indices: Array, src: Array, mode: str) -> Array:
        """Out-of-place reduction ("amax", "amin", "prod") of the src rows sent to each target row
        along axis 0; rows that receive nothing keep `target`'s values."""
    def argsort(self, x: Array, axis: int, descending: bool) -> Array:
        """Stable, so ties keep index order on every backend; x may be boolean."""
    def max_with_indices(self, x: Array, axis: int) -> Tuple[Array, Array]: ...
    def matmul_transposed(self, a: Array, b: Array) -> Array:
        """a @ b^T over the last two axes."""
    def l2_normalize(self, x: Array, axis: int) -> Array: ...
    def counts(self, x: Array, length: int) -> Array:
        """float32 occurrences of each value in [0, length) in the 1-D int64 `x`, as a fixed-shape
        scatter (a bincount's shape depends on values, which graph compilers cannot trace)."""
    def equal(self, a: Array, b: Array) -> Array: ...
    def broadcast_to(self, x: Array, shape: Sequence[int]) -> Array: ...
    def where(self, cond: Array, a: Array, b: Array) -> Array: ...
    def bitwise_xor(self, a: Array, b: Array) -> Array: ...
    def floor(self, x: Array) -> Array: ...
    def to_int64(self, x: Array) -> Array: ...
    def astype_like(self, x: Array, like: Array) -> Array: ...
    def to_float32(self, x: Array) -> Array: ...
    def randint_from(self, generator: Any, high: int, shape: Sequence[int], like: Array) -> Array:
        """Flat int64 draws in [0, high) of `shape` from a framework generator, on `like`'s device."""


def register_backend(module_name: str, target: str) -> None:
    """Serve tensors whose class lives in `module_name` by the backend at `target` ("module:attr")."""
    _KNOWN_BACKENDS[module_name] = target
    _LOADED.pop(module_name, None)


def backend_for_name(name: str) -> Backend:
    if name not in _LOADED:
        if name not in _KNOWN_BACKENDS:
            raise TypeError(f"no ToMe backend for '{name}' tensors; known: {sorted(_KNOWN_BACKENDS)}")
        module_path, attr = _KNOWN_BACKENDS[name].split(":")
        _LOADED[name] = getattr(importlib.import_module(module_path), attr)
    return _LOADED[name]


def get_backend(x: Array) -> Backend:
    """The backend serving tensor `x`, chosen by the package its class comes from."""
    return backend_for_name(type(x).__module__.split(".")[0])
