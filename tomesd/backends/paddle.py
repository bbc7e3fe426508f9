"""PaddlePaddle backend."""
from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence, Tuple

import paddle

# CPU kernels for these scatters exist for float16/32/64 but not bfloat16.
_SCATTER_UPCAST = {paddle.bfloat16}


def _on(x: paddle.Tensor, like: paddle.Tensor) -> paddle.Tensor:
    """`x` on the device of `like` (paddle creates tensors on the global default device)."""
    return x if x.place == like.place else x.to(like.place)


class PaddleBackend:
    name = "paddle"
    tensor_type = paddle.Tensor
    module_type = paddle.nn.Layer

    # ---- array ops (tome_core.backend.Backend) ----
    def no_grad(self):
        return paddle.no_grad()

    def shape(self, x: paddle.Tensor) -> Tuple[int, ...]:
        return tuple(x.shape)

    def device_key(self, x: paddle.Tensor) -> str:
        return str(x.place)

    def arange(self, n: int, like: paddle.Tensor) -> paddle.Tensor:
        return _on(paddle.arange(n, dtype="int64"), like)

    def zeros(self, shape: Sequence[int], like: paddle.Tensor, integer: bool = False) -> paddle.Tensor:
        return _on(paddle.zeros(list(shape), dtype="int64" if integer else like.dtype), like)

    def ones(self, shape: Sequence[int], like: paddle.Tensor, integer: bool = False) -> paddle.Tensor:
        return _on(paddle.ones(list(shape), dtype="int64" if integer else like.dtype), like)

    def reshape(self, x: paddle.Tensor, shape: Sequence[int]) -> paddle.Tensor:
        return paddle.reshape(x, list(shape))

    def concat(self, xs: Sequence[paddle.Tensor], axis: int) -> paddle.Tensor:
        return paddle.concat(list(xs), axis=axis)

    def take(self, x: paddle.Tensor, indices: paddle.Tensor, axis: int) -> paddle.Tensor:
        return paddle.index_select(x, indices, axis=axis)

    def take_along_axis(self, x: paddle.Tensor, indices: paddle.Tensor, axis: int) -> paddle.Tensor:
        return paddle.take_along_axis(x, indices, axis=axis)

    def scatter_add(self, target: paddle.Tensor, indices: paddle.Tensor, src: paddle.Tensor) -> paddle.Tensor:
        if target.dtype in _SCATTER_UPCAST:
            out = paddle.index_add(target.astype("float32"), indices, 0, src.astype("float32"))
            return out.astype(target.dtype)
        return paddle.index_add(target, indices, 0, src)

    def argsort(self, x: paddle.Tensor, axis: int, descending: bool) -> paddle.Tensor:
        return paddle.argsort(x, axis=axis, descending=descending, stable=True)

    def max_with_indices(self, x: paddle.Tensor, axis: int) -> Tuple[paddle.Tensor, paddle.Tensor]:
        values, indices = paddle.topk(x, k=1, axis=axis)
        return values.squeeze(axis), indices.squeeze(axis)

    def matmul_transposed(self, a: paddle.Tensor, b: paddle.Tensor) -> paddle.Tensor:
        return paddle.matmul(a, b, transpose_y=True)

    def l2_normalize(self, x: paddle.Tensor, axis: int) -> paddle.Tensor:
        return x / x.norm(axis=axis, keepdim=True)

    def cumsum(self, x: paddle.Tensor, axis: int) -> paddle.Tensor:
        return paddle.cumsum(x, axis=axis)

    def where(self, cond: paddle.Tensor, a: paddle.Tensor, b: paddle.Tensor) -> paddle.Tensor:
        return paddle.where(cond, a, b)

    def bitwise_xor(self, a: paddle.Tensor, b: paddle.Tensor) -> paddle.Tensor:
        return paddle.bitwise_xor(a, b)

    def astype_like(self, x: paddle.Tensor, like: paddle.Tensor) -> paddle.Tensor:
        return x.astype(like.dtype)

    def to_float32(self, x: paddle.Tensor) -> paddle.Tensor:
        return x.astype("float32")

    def global_seed(self) -> int:
        # The seed of the global generator, read without drawing from it: paddle.seed(k) before a
        # run makes the draws reproducible.
        return int(paddle.get_rng_state()[0].current_seed())

    # ---- module ops (tomesd.adapters) ----
    def is_module(self, obj: Any) -> bool:
        return isinstance(obj, paddle.nn.Layer)

    def named_modules(self, module: paddle.nn.Layer) -> Iterator[Tuple[str, paddle.nn.Layer]]:
        return module.named_sublayers(include_self=True)

    def add_pre_hook(self, module: paddle.nn.Layer, hook: Callable) -> Any:
        return module.register_forward_pre_hook(hook, with_kwargs=True)

    def add_post_hook(self, module: paddle.nn.Layer, hook: Callable, always_call: bool = False) -> Any:
        return module.register_forward_post_hook(hook, always_call=always_call)

    def hook_tables(self, module: paddle.nn.Layer) -> Tuple[dict, ...]:
        """Where this layer keeps its hooks (for checks that a removal left nothing behind)."""
        return (module._forward_pre_hooks, module._forward_post_hooks)


backend = PaddleBackend()
