"""PaddlePaddle backend."""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Iterator, Optional, Sequence, Tuple

import paddle

from . import paddle_sdpa

try:
    from paddle.base.dygraph.base import in_to_static_mode
except ImportError:  # pragma: no cover - moved in some paddle release
    def in_to_static_mode() -> bool:
        return False

# Layer hooks with keyword arguments and always-called post-hooks arrived in paddle 3.2
# (PaddlePaddle/Paddle#71283, #74611); the runtime needs both.
MIN_PADDLE = "3.2"
if "always_call" not in inspect.signature(paddle.nn.Layer.register_forward_post_hook).parameters:
    raise ImportError(
        f"ToMe needs paddlepaddle>={MIN_PADDLE} (layer hooks with with_kwargs/always_call); "
        f"found paddlepaddle {paddle.__version__}: pip install 'paddlepaddle>={MIN_PADDLE}'"
    )
# CPU kernels for these scatters exist for float16/32/64 but not bfloat16.
_SCATTER_UPCAST = {paddle.bfloat16}


class LayerHook:
    """A forward hook as paddle stores it: `function(owner, *hook_args, *args)`.

    Why not the bound method (or functools.partial) itself: paddle's SOT translator (the default
    of paddle.jit.to_static) guards a layer's __dict__, hook tables included, and guards bound
    methods and partials by `value == <repr>`, which is not Python ("<bound method ...>"), so the
    conversion failed with a SyntaxError. A plain object is guarded by identity. The method is kept
    as (function, owner): SOT mis-binds a bound method read from an object's attribute. `func` is
    the bound method again, so remove_owned_hooks finds the owner; copies and pickles carry both.
    """

    __slots__ = ("function", "owner", "args")

    def __init__(self, hook: Callable):
        args: tuple = ()
        if isinstance(hook, functools.partial) and not hook.keywords:
            hook, args = hook.func, hook.args
        if inspect.ismethod(hook):
            self.function, self.owner = hook.__func__, hook.__self__
        else:
            self.function, self.owner = hook, None
        self.args = args

    @property
    def func(self) -> Callable:
        return self.function if self.owner is None else self.function.__get__(self.owner)

    def __call__(self, *call_args: Any) -> Any:
        if self.owner is None:
            return self.function(*self.args, *call_args)
        return self.function(self.owner, *self.args, *call_args)

    def __getstate__(self) -> tuple:
        return self.function, self.owner, self.args

    def __setstate__(self, state: tuple) -> None:
        self.function, self.owner, self.args = state


_NO_AST = (
    "ToMe cannot be traced by paddle.jit.to_static(full_graph=True) (AST mode): its hooks keep one "
    "call's merges in Python state, and a to_static of the patched model itself runs the model's own "
    "hooks outside the program. Use paddle.jit.to_static(model) (the default, SOT mode), which runs "
    "ToMe's hooks eagerly between compiled graphs, or call remove_tome()/remove_patch() before converting."
)


def _on(x: paddle.Tensor, like: paddle.Tensor) -> paddle.Tensor:
    """`x` on the device of `like` (paddle creates tensors on the global default device)."""
    return x if x.place == like.place else x.to(like.place)


class PaddleArrays:
    """tome_core's array namespace on paddle tensors (tome_core.backend.Backend)."""

    name = "paddle"

    def __reduce__(self) -> str:
        return "backend"  # copies and pickles of patched models share the module's one instance

    def no_grad(self):
        return paddle.no_grad()

    def grad_enabled(self) -> bool:
        return paddle.is_grad_enabled()

    def shape(self, x: paddle.Tensor) -> Tuple[int, ...]:
        return tuple(x.shape)

    def arange(self, n: int, like: paddle.Tensor, step: int = 1) -> paddle.Tensor:
        return _on(paddle.arange(0, n, step, dtype="int64"), like)

    def zeros(self, shape: Sequence[int], like: paddle.Tensor, integer: bool = False) -> paddle.Tensor:
        return _on(paddle.zeros(list(shape), dtype="int64" if integer else like.dtype), like)

    def reshape(self, x: paddle.Tensor, shape: Sequence[int]) -> paddle.Tensor:
        return paddle.reshape(x, list(shape))

    def concat(self, xs: Sequence[paddle.Tensor], axis: int) -> paddle.Tensor:
        return paddle.concat(list(xs), axis=axis)

    def unstack(self, x: paddle.Tensor) -> Sequence[paddle.Tensor]:
        return paddle.unbind(x, axis=0)

    def take(self, x: paddle.Tensor, indices: paddle.Tensor, axis: int) -> paddle.Tensor:
        return paddle.index_select(x, indices, axis=axis)

    def take_along(self, x: paddle.Tensor, indices: paddle.Tensor, axis: int) -> paddle.Tensor:
        return paddle.take_along_axis(x, indices, axis)

    def put_along(self, x: paddle.Tensor, indices: paddle.Tensor, axis: int) -> paddle.Tensor:
        return paddle.put_along_axis(paddle.zeros_like(x), indices, x, axis)

    def segment_mean(self, x: paddle.Tensor, segments: paddle.Tensor, count: int,
                     inv_counts: Optional[paddle.Tensor]) -> paddle.Tensor:
        # ppdiffusers' own merge: a sum, then times the inverse counts (its numerics, kept for parity with it)
        if inv_counts is None:
            inv_counts = (1.0 / self.counts(segments, count)).reshape([count, 1])
        if inv_counts.dtype != x.dtype:
            inv_counts = inv_counts.astype(x.dtype)
        return self.scatter_add(self.zeros([count, x.shape[1]], x), segments, x) * inv_counts

    def merge_matrix(self, rows: paddle.Tensor, batch: int, n: int, m: int, like: paddle.Tensor,
                     force: bool = False) -> Optional[paddle.Tensor]:
        if not force:
            return None  # ppdiffusers' numerics: its scatter, for parity with it
        local = rows.reshape([batch, 1, n]) - (paddle.arange(batch, dtype="int64") * m).reshape([batch, 1, 1])
        ones = paddle.ones([batch, 1, n], dtype=like.dtype)
        return paddle.put_along_axis(paddle.zeros([batch, m, n], dtype=like.dtype), local, ones, 1)

    def matrix_mean(self, matrix: paddle.Tensor, x: paddle.Tensor, inv_counts: paddle.Tensor) -> paddle.Tensor:
        b, m, n = matrix.shape
        total = paddle.bmm(matrix, x.reshape([b, n, -1])).reshape([b * m, -1])
        if inv_counts.dtype != x.dtype:
            inv_counts = inv_counts.astype(x.dtype)
        return total * inv_counts

    @staticmethod
    def prefers_kept_counts() -> bool:
        return True  # its mean is a sum times counts either way: counted once per merge, not at every site

    def scatter_add(self, target: paddle.Tensor, indices: paddle.Tensor, src: paddle.Tensor) -> paddle.Tensor:
        if target.dtype in _SCATTER_UPCAST:
            out = paddle.index_add(target.astype("float32"), indices, 0, src.astype("float32"))
            return out.astype(target.dtype)
        return paddle.index_add(target, indices, 0, src)

    def scatter_reduce(self, target: paddle.Tensor, indices: paddle.Tensor, src: paddle.Tensor, mode: str) -> paddle.Tensor:
        dtype = target.dtype
        if dtype in _SCATTER_UPCAST:
            target, src = target.astype("float32"), src.astype("float32")
        index = paddle.expand(indices.reshape([-1, 1]), src.shape)
        reduce = {"amax": "amax", "amin": "amin", "prod": "mul"}[mode]
        out = paddle.put_along_axis(target, index, src, 0, reduce=reduce, include_self=False)
        return out.astype(dtype)

    def argsort(self, x: paddle.Tensor, axis: int, descending: bool) -> paddle.Tensor:
        if x.dtype == paddle.bool:  # no boolean sort kernel
            x = x.astype("int64")
        return paddle.argsort(x, axis=axis, descending=descending, stable=True)

    def max_with_indices(self, x: paddle.Tensor, axis: int) -> Tuple[paddle.Tensor, paddle.Tensor]:
        # argmax gives the first of equal maxima, as torch's max does (an exact score tie goes to the first
        # dst on both); topk(k=1), which ppdiffusers uses, gives another one.
        return paddle.max(x, axis=axis), paddle.argmax(x, axis=axis)

    def matmul_transposed(self, a: paddle.Tensor, b: paddle.Tensor) -> paddle.Tensor:
        return paddle.matmul(a, b, transpose_y=True)

    def l2_normalize(self, x: paddle.Tensor, axis: int) -> paddle.Tensor:
        return x / x.norm(axis=axis, keepdim=True)

    def counts(self, x: paddle.Tensor, length: int) -> paddle.Tensor:
        ones = paddle.ones(x.shape, dtype="float32").to(x.place)
        return paddle.index_add(paddle.zeros([length], dtype="float32").to(x.place), x, 0, ones)

    def equal(self, a: paddle.Tensor, b: paddle.Tensor) -> paddle.Tensor:
        return paddle.equal(a, b)

    def broadcast_to(self, x: paddle.Tensor, shape: Sequence[int]) -> paddle.Tensor:
        return paddle.expand(x, list(shape))

    def where(self, cond: paddle.Tensor, a: paddle.Tensor, b: paddle.Tensor) -> paddle.Tensor:
        return paddle.where(cond, a, b)

    def bitwise_xor(self, a: paddle.Tensor, b: paddle.Tensor) -> paddle.Tensor:
        return paddle.bitwise_xor(a, b)

    def floor(self, x: paddle.Tensor) -> paddle.Tensor:
        return paddle.floor(x)

    def to_int64(self, x: paddle.Tensor) -> paddle.Tensor:
        return x.astype("int64")

    def astype_like(self, x: paddle.Tensor, like: paddle.Tensor) -> paddle.Tensor:
        return x.astype(like.dtype)

    def to_float32(self, x: paddle.Tensor) -> paddle.Tensor:
        return x.astype("float32")

    def randint_from(self, generator: Any, high: int, shape: Sequence[int], like: paddle.Tensor) -> paddle.Tensor:
        raise TypeError(
            "paddle draws cannot come from a generator object (paddle.randint takes none, and neither does "
            "ppdiffusers' bipartite_soft_matching_random2d): pass seed=<int> for a reproducible random dst"
        )


class PaddleHost:
    """What the runtime does to paddle modules beyond arrays: forward hooks, graph-compiler detection, the
    grad mode, and the one host read a bare model's reuse_steps needs."""

    name = "paddle"
    # Where a layer keeps its forward hooks, and the flag tables keyed by the same hook ids.
    hook_tables = (
        ("_forward_pre_hooks", ("_forward_pre_hooks_with_kwargs_flag",)),
        ("_forward_post_hooks", ("_forward_post_hooks_with_kwargs_flag", "_forward_post_hooks_always_called")),
    )

    def __reduce__(self) -> str:
        return "host"  # copies and pickles of patched models share the module's one instance

    asks_each_hook = True  # AST tracing runs a block's hooks in the program, its root's outside: each hook asks

    @staticmethod
    def compiled_blocks(blocks: Any) -> bool:
        """Never: paddle compiles no block apart from its root (to_static runs the root's hooks in the program)."""
        return False

    def is_compiling(self) -> bool:
        """Never: a hook that finds itself traced into a static program refuses (see _NO_AST).

        SOT mode (to_static's default) calls the hooks eagerly, in dynamic mode, so they run as
        in eager mode; only AST tracing and paddle.enable_static() reach the error.
        """
        if in_to_static_mode() or not paddle.in_dynamic_mode():
            raise RuntimeError(_NO_AST)
        return False

    def key_weight_seam(self) -> Any:
        """ppdiffusers' attention functions, where proportional attention weighs merged keys (paddle_sdpa.py)."""
        return paddle_sdpa.PADDLE_SDPA_SEAM

    def key_weights(self, inv_counts: paddle.Tensor, image_keys_first: bool, uniform: bool = False) -> Any:
        """One attention's weights: log of each merged row's token count ([B, M, 1] inverse counts)."""
        return paddle_sdpa.PaddleKeyWeights(-paddle.log(inv_counts[..., 0]), image_keys_first, uniform)

    def on_local_tokens(self, fn: Callable[[Any], Any], x: Any) -> Any:
        return fn(x)  # no distributed tensors reach a ppdiffusers denoiser's layers

    def context_split(self, root: Any) -> None:
        """ppdiffusers splits no model's tokens across processes (no context parallelism): always None."""
        return None

    def host_float(self, x: Any) -> float:
        """A scalar's value on the host (one device sync for a tensor on an accelerator)."""
        return float(x.detach().reshape([-1])[0]) if isinstance(x, paddle.Tensor) else float(x)

    def grad_enabled(self) -> bool:
        return paddle.is_grad_enabled()

    def reset_compiled(self) -> None:
        pass  # SOT guards layer dicts, hook tables included: a patch change re-traces by itself

    def named_modules(self, module: paddle.nn.Layer) -> Iterator[Tuple[str, paddle.nn.Layer]]:
        return module.named_sublayers(include_self=True)

    def on_device_of(self, x: paddle.Tensor, like: Any) -> paddle.Tensor:
        """`x` on the device of `like` (a tensor; anything else leaves `x` as it is)."""
        return _on(x, like) if isinstance(like, paddle.Tensor) else x

    def add_pre_hook(self, module: paddle.nn.Layer, hook: Callable) -> Any:
        return module.register_forward_pre_hook(LayerHook(hook), with_kwargs=True)

    def add_post_hook(self, module: paddle.nn.Layer, hook: Callable, always_call: bool = False) -> Any:
        return module.register_forward_post_hook(LayerHook(hook), always_call=always_call)


backend = PaddleArrays()
host = PaddleHost()
