"""A reference backend of tome_core in plain NumPy, registered for numpy arrays on import.

Written from tome_core.backend.Backend's contract, not from the framework backends: so the core's tests run
with NumPy alone, and the torch and paddle backends are checked against something that shares no code with
them. It is strict where the contract is: index tensors must be 1-D int64, every op is out of place, argsort
is stable in both directions. Speed is no concern.
"""
from __future__ import annotations

import contextlib
from typing import Any, Optional, Sequence, Tuple

import numpy as np

from tome_core.backend import register_backend

_REDUCERS = {"amax": np.maximum, "amin": np.minimum, "prod": np.multiply}


def _index(indices: np.ndarray, length: int = None) -> np.ndarray:
    """The contract's index tensor: 1-D int64 (what index_select / index_add take on every framework)."""
    assert isinstance(indices, np.ndarray) and indices.dtype == np.int64 and indices.ndim == 1, (
        f"indices must be a 1-D int64 array, got {type(indices).__name__} {getattr(indices, 'dtype', None)} "
        f"of shape {getattr(indices, 'shape', None)}"
    )
    if length is not None:
        assert indices.shape[0] == length, f"{indices.shape[0]} indices for {length} rows"
    return indices


def _along(indices: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The contract's index tensor along an axis: int64, of x's rank (what gather / scatter take everywhere)."""
    assert isinstance(indices, np.ndarray) and indices.dtype == np.int64 and indices.ndim == np.ndim(x), (
        f"indices must be an int64 array of rank {np.ndim(x)}, got {getattr(indices, 'dtype', None)} of shape "
        f"{getattr(indices, 'shape', None)}")
    return indices


def _identity(mode: str, dtype: np.dtype) -> Any:
    """The value a row that receives src rows starts from, so that only the src rows decide it."""
    if mode == "prod":
        return 1
    if np.issubdtype(dtype, np.floating):
        return -np.inf if mode == "amax" else np.inf
    info = np.iinfo(dtype)
    return info.min if mode == "amax" else info.max


class NumpyBackend:
    name = "numpy"

    def no_grad(self):
        return contextlib.nullcontext()  # nothing records gradients

    def grad_enabled(self) -> bool:
        return False

    def shape(self, x: np.ndarray) -> Tuple[int, ...]:
        return tuple(int(d) for d in np.shape(x))

    def arange(self, n: int, like: np.ndarray, step: int = 1) -> np.ndarray:
        return np.arange(0, n, step, dtype=np.int64)

    def zeros(self, shape: Sequence[int], like: np.ndarray, integer: bool = False) -> np.ndarray:
        return np.zeros(tuple(shape), dtype=np.int64 if integer else np.asarray(like).dtype)

    def reshape(self, x: np.ndarray, shape: Sequence[int]) -> np.ndarray:
        return np.reshape(x, tuple(shape))

    def concat(self, xs: Sequence[np.ndarray], axis: int) -> np.ndarray:
        return np.concatenate(list(xs), axis=axis)

    def unstack(self, x: np.ndarray) -> Sequence[np.ndarray]:
        return list(x)

    def take(self, x: np.ndarray, indices: np.ndarray, axis: int) -> np.ndarray:
        return np.take(x, _index(indices), axis=axis)

    def take_along(self, x: np.ndarray, indices: np.ndarray, axis: int) -> np.ndarray:
        return np.take_along_axis(np.asarray(x), _along(indices, x), axis=axis)

    def put_along(self, x: np.ndarray, indices: np.ndarray, axis: int) -> np.ndarray:
        out = np.empty_like(np.asarray(x))
        np.put_along_axis(out, _along(indices, x), x, axis=axis)
        return out

    def segment_mean(self, x: np.ndarray, segments: np.ndarray, count: int, inv_counts) -> np.ndarray:
        segments = _index(segments, np.shape(x)[0])
        total = np.zeros((count,) + np.shape(x)[1:], dtype=np.asarray(x).dtype)
        np.add.at(total, segments, x)
        if inv_counts is None:
            counts = np.bincount(segments, minlength=count).astype(total.dtype)
            return total / counts.reshape((count,) + (1,) * (total.ndim - 1))
        return (total * np.asarray(inv_counts)).astype(total.dtype)

    def merge_matrix(self, rows: np.ndarray, batch: int, n: int, m: int, like: np.ndarray,
                     force: bool = False) -> Optional[np.ndarray]:
        if not force:
            return None  # the reference adds as the scatter does
        local = np.asarray(rows).reshape(batch, n) - (np.arange(batch) * m)[:, None]
        matrix = np.zeros((batch, m, n), dtype=np.asarray(like).dtype)
        matrix[np.arange(batch)[:, None], local, np.arange(n)[None, :]] = 1
        return matrix

    def matrix_mean(self, matrix: np.ndarray, x: np.ndarray, inv_counts: np.ndarray) -> np.ndarray:
        b, m, n = matrix.shape
        x = np.asarray(x)
        total = np.matmul(matrix, x.reshape(b, n, -1)).reshape(b * m, -1)
        return (total * np.asarray(inv_counts)).astype(x.dtype)

    @staticmethod
    def prefers_kept_counts() -> bool:
        return True

    def scatter_add(self, target: np.ndarray, indices: np.ndarray, src: np.ndarray) -> np.ndarray:
        out = np.array(target, copy=True)
        np.add.at(out, _index(indices, np.shape(src)[0]), src)  # unbuffered: repeated indices accumulate
        return out

    def scatter_reduce(self, target: np.ndarray, indices: np.ndarray, src: np.ndarray, mode: str) -> np.ndarray:
        reducer = _REDUCERS[mode]
        indices = _index(indices, np.shape(src)[0])
        out = np.array(target, copy=True)
        out[np.unique(indices)] = _identity(mode, out.dtype)  # rows that receive: only src decides (no self)
        reducer.at(out, indices, src)
        return out

    def argsort(self, x: np.ndarray, axis: int, descending: bool) -> np.ndarray:
        x = np.asarray(x)
        if x.dtype == np.bool_:
            x = x.astype(np.int64)
        if not descending:
            return np.argsort(x, axis=axis, kind="stable").astype(np.int64)
        # Stable descending: sort the reversed axis ascending, reverse the result, map back. Ties keep
        # index order, as in a stable descending sort (negating would break on unsigned or extreme values).
        n = x.shape[axis]
        flipped = np.argsort(np.flip(x, axis=axis), axis=axis, kind="stable")
        return (n - 1 - np.flip(flipped, axis=axis)).astype(np.int64)

    def max_with_indices(self, x: np.ndarray, axis: int) -> Tuple[np.ndarray, np.ndarray]:
        indices = np.asarray(np.argmax(x, axis=axis)).astype(np.int64)  # the first of equal maxima
        values = np.take_along_axis(x, np.expand_dims(indices, axis), axis=axis).squeeze(axis)
        return values, indices

    def matmul_transposed(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return np.matmul(a, np.swapaxes(b, -1, -2))

    def l2_normalize(self, x: np.ndarray, axis: int) -> np.ndarray:
        return x / np.linalg.norm(x, axis=axis, keepdims=True)

    def counts(self, x: np.ndarray, length: int) -> np.ndarray:
        out = np.zeros(length, dtype=np.float32)  # the shape is `length`, whatever the values
        np.add.at(out, _index(x), np.float32(1))
        return out

    def equal(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return np.equal(a, b)

    def broadcast_to(self, x: np.ndarray, shape: Sequence[int]) -> np.ndarray:
        return np.broadcast_to(x, tuple(shape))

    def where(self, cond: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return np.where(cond, a, b)

    def bitwise_xor(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return np.bitwise_xor(a, b)

    def floor(self, x: np.ndarray) -> np.ndarray:
        return np.floor(x)

    def to_int64(self, x: np.ndarray) -> np.ndarray:
        return np.asarray(x).astype(np.int64)

    def astype_like(self, x: np.ndarray, like: np.ndarray) -> np.ndarray:
        return np.asarray(x).astype(np.asarray(like).dtype)

    def to_float32(self, x: np.ndarray) -> np.ndarray:
        return np.asarray(x).astype(np.float32)

    def randint_from(self, generator: np.random.Generator, high: int, shape: Sequence[int], like: np.ndarray) -> np.ndarray:
        if not isinstance(generator, np.random.Generator):
            raise TypeError(f"numpy draws come from a numpy.random.Generator, got {type(generator).__name__}")
        return generator.integers(0, high, size=(*shape, 1), dtype=np.int64).reshape(-1)


backend = NumpyBackend()
register_backend("numpy", backend)
