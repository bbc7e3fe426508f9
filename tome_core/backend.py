"""The array operations the algorithm is written against, and how a tensor finds its backend.

The core never imports a framework, and knows none by name. A backend is an object with the
methods of `Backend`; whoever ships one registers it here under the top-level module name of
the tensors it serves ("torch" for `torch.Tensor`, "numpy" for `numpy.ndarray`), either as the
object itself or as a loader called once, when the first tensor of that framework arrives, so
registering imports no framework. An application registers its frameworks when it is imported.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, ContextManager, Dict, Optional, Protocol, Sequence, Tuple

Array = Any

# Top-level module of a tensor's class -> a zero-argument loader returning the backend serving it.
_LOADERS: Dict[str, Callable[[], "Backend"]] = {}
# Backends already loaded, by the same key: the per-call path is one dict lookup.
_LOADED: Dict[str, "Backend"] = {}
_LOCK = threading.Lock()


class Backend(Protocol):
    """Array-API-style operations; integer tensors are int64, indices address one axis.

    Nothing here may read a tensor's values on the host: the per-call path stays free of
    device syncs and traceable by graph compilers.
    """

    name: str

    def no_grad(self) -> ContextManager: ...
    def grad_enabled(self) -> bool:
        """Whether operations now record gradients (the matching enters no_grad only then)."""
    def shape(self, x: Array) -> Tuple[int, ...]: ...
    def arange(self, n: int, like: Array, step: int = 1) -> Array:
        """int64 [0, step, 2*step, ...) below n."""
    def zeros(self, shape: Sequence[int], like: Array, integer: bool = False) -> Array: ...
    def reshape(self, x: Array, shape: Sequence[int]) -> Array: ...
    def concat(self, xs: Sequence[Array], axis: int) -> Array: ...
    def unstack(self, x: Array) -> Sequence[Array]:
        """x's slices along axis 0, in order (views where the framework has them): a table made once per call
        handed to its blocks a row each, with no indexing at every block."""
    def take(self, x: Array, indices: Array, axis: int) -> Array: ...
    def take_along(self, x: Array, indices: Array, axis: int) -> Array:
        """x's values at `indices` (x's rank; any length along `axis`) along `axis` (the array API's take_along_axis)."""
    def put_along(self, x: Array, indices: Array, axis: int) -> Array:
        """The inverse of take_along for a permutation: an array like x whose values at `indices` along `axis` are
        x's (out[..., indices[..., k]] = x[..., k]); `indices` is x's shape, a permutation along `axis`."""
    def segment_mean(self, x: Array, segments: Array, count: int, inv_counts: Optional[Array]) -> Array:
        """[count, C]: the mean of the rows of x [R, C] with each segment id (`segments` [R] int64 in [0, count),
        every id present at least once). Given `inv_counts` [count, 1] (1 / each segment's rows, float32), their
        sum times it, in x's dtype: no counting. Without, the framework's own mean (fewest calls from the host)."""
    def merge_matrix(self, rows: Array, batch: int, n: int, m: int, like: Array, force: bool = False) -> Optional[Array]:
        """[batch, m, n] in `like`'s dtype: 1 where token t of sample k goes to its row, `rows` [batch * n] flat rows
        (sample k's in [k*m, (k+1)*m)), else 0; a mean merge is then a product (matrix_mean). None where the
        backend's scatter is the cheaper way for this map, dtype and device (the default: NumPy and paddle always;
        torch on an accelerator at half precision for small maps, where a GPU's scatter is slow). `force`: the
        matrix whatever the rule says."""
    def matrix_mean(self, matrix: Array, x: Array, inv_counts: Array) -> Array:
        """[B * M, C]: the mean merge of x [B * N, C] by merge_matrix's `matrix` [B, M, N], the product's sums
        times `inv_counts` [B * M, 1] (float32), in x's dtype: segment_mean's result to round-off."""
    def prefers_kept_counts(self) -> bool:
        """Whether a merge should count its rows once and take every mean as a sum times their inverse (fewest
        kernels) rather than the framework's own mean (fewest host calls): torch while a graph compiler traces,
        where host calls cost nothing at run time; paddle and NumPy always, their own mean counts at every call."""
    def scatter_add(self, target: Array, indices: Array, src: Array) -> Array:
        """Out-of-place `target[indices[i]] += src[i]` along axis 0 (the op the array API lacks)."""
    def scatter_reduce(self, target: Array, indices: Array, src: Array, mode: str) -> Array:
        """Out-of-place reduction ("amax", "amin", "prod") of the src rows sent to each target row
        along axis 0; rows that receive nothing keep `target`'s values."""
    def argsort(self, x: Array, axis: int, descending: bool) -> Array:
        """Stable, so ties keep index order on every backend; x may be boolean."""
    def max_with_indices(self, x: Array, axis: int) -> Tuple[Array, Array]:
        """The maxima along `axis` and their int64 indices: the first of equal maxima, so an exact score tie
        goes to the first dst on every backend."""
    def matmul_transposed(self, a: Array, b: Array) -> Array:
        """a [B, M, C] @ b [B, K, C]^T: [B, M, K] (batches of matrices, as the matching's scores are)."""
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


def register_backend(module_name: str, backend: Optional[Backend] = None, *,
                     loader: Optional[Callable[[], Backend]] = None) -> None:
    """Serve tensors whose class lives in the top-level module `module_name` by `backend`, or by the
    backend `loader()` returns (called once, when the first such tensor arrives). Exactly one of the
    two; a new registration for a name replaces the old one, loaded or not."""
    if (backend is None) == (loader is None):
        raise TypeError("register_backend takes a backend or a loader, not both and not neither")
    if loader is not None and not callable(loader):
        raise TypeError(f"loader must be a callable returning the backend, got {type(loader).__name__}")
    with _LOCK:
        _LOADERS[module_name] = loader if loader is not None else (lambda: backend)
        _LOADED.pop(module_name, None)
        if backend is not None:
            _LOADED[module_name] = backend


def registered_backends() -> Tuple[str, ...]:
    """The module names with a registered backend, loaded or not."""
    return tuple(sorted(_LOADERS))


def backend_for_name(name: str) -> Backend:
    """The backend registered for tensors of the top-level module `name`, loading it on first use."""
    backend = _LOADED.get(name)
    if backend is not None:
        return backend
    with _LOCK:
        if name not in _LOADED:
            if name not in _LOADERS:
                known = ", ".join(sorted(_LOADERS)) or "none"
                raise TypeError(
                    f"no ToMe backend is registered for '{name}' tensors (registered: {known}). Register one "
                    f"with tome_core.register_backend({name!r}, backend), or register_backend({name!r}, "
                    f"loader=...) to import it when the first such tensor arrives; a backend is an object "
                    f"with the methods of tome_core.Backend. An application using tome_core registers the "
                    f"backends of the frameworks it supports when it is imported: import it first."
                )
            _LOADED[name] = _LOADERS[name]()
        return _LOADED[name]


def get_backend(x: Array) -> Backend:
    """The backend serving tensor `x`, chosen by the package its class comes from."""
    return backend_for_name(type(x).__module__.split(".")[0])
