"""PyTorch backend."""
from __future__ import annotations

import hashlib
from typing import Any, Callable, Iterator, Sequence, Tuple

import torch


class TorchBackend:
    name = "torch"
    tensor_type = torch.Tensor
    module_type = torch.nn.Module

    # ---- array ops (tome_core.backend.Backend) ----
    def no_grad(self):
        return torch.no_grad()

    def shape(self, x: torch.Tensor) -> Tuple[int, ...]:
        return tuple(x.shape)

    def device_key(self, x: torch.Tensor) -> str:
        return str(x.device)

    def arange(self, n: int, like: torch.Tensor) -> torch.Tensor:
        return torch.arange(n, device=like.device, dtype=torch.int64)

    def zeros(self, shape: Sequence[int], like: torch.Tensor, integer: bool = False) -> torch.Tensor:
        return torch.zeros(shape, device=like.device, dtype=torch.int64 if integer else like.dtype)

    def ones(self, shape: Sequence[int], like: torch.Tensor, integer: bool = False) -> torch.Tensor:
        return torch.ones(shape, device=like.device, dtype=torch.int64 if integer else like.dtype)

    def reshape(self, x: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
        return x.reshape(shape)

    def concat(self, xs: Sequence[torch.Tensor], axis: int) -> torch.Tensor:
        return torch.cat(list(xs), dim=axis)

    def take(self, x: torch.Tensor, indices: torch.Tensor, axis: int) -> torch.Tensor:
        return torch.index_select(x, axis, indices)

    def take_along_axis(self, x: torch.Tensor, indices: torch.Tensor, axis: int) -> torch.Tensor:
        return torch.take_along_dim(x, indices, dim=axis)

    def scatter_add(self, target: torch.Tensor, indices: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        return target.index_add(0, indices, src)

    def argsort(self, x: torch.Tensor, axis: int, descending: bool) -> torch.Tensor:
        return torch.sort(x, dim=axis, descending=descending, stable=True).indices

    def max_with_indices(self, x: torch.Tensor, axis: int) -> Tuple[torch.Tensor, torch.Tensor]:
        values, indices = x.max(dim=axis)
        return values, indices

    def matmul_transposed(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a @ b.transpose(-1, -2)

    def l2_normalize(self, x: torch.Tensor, axis: int) -> torch.Tensor:
        return x / x.norm(dim=axis, keepdim=True)

    def cumsum(self, x: torch.Tensor, axis: int) -> torch.Tensor:
        return torch.cumsum(x, dim=axis)

    def where(self, cond: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.where(cond, a, b)

    def bitwise_xor(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.bitwise_xor(a, b)

    def astype_like(self, x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return x.to(device=like.device, dtype=like.dtype)

    def to_float32(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.float32)

    def global_seed(self) -> int:
        # Hash of the CPU generator's state: reading it leaves the sampler's noise untouched,
        # and torch.manual_seed(k) before a run makes the draws reproducible (as tomesd's fork did).
        digest = hashlib.blake2b(torch.get_rng_state().numpy().tobytes(), digest_size=8).digest()
        return int.from_bytes(digest, "little")

    # ---- module ops (tomesd.adapters) ----
    def is_module(self, obj: Any) -> bool:
        return isinstance(obj, torch.nn.Module)

    def named_modules(self, module: torch.nn.Module) -> Iterator[Tuple[str, torch.nn.Module]]:
        return module.named_modules()

    def add_pre_hook(self, module: torch.nn.Module, hook: Callable) -> Any:
        return module.register_forward_pre_hook(hook, with_kwargs=True)

    def add_post_hook(self, module: torch.nn.Module, hook: Callable, always_call: bool = False) -> Any:
        return module.register_forward_hook(hook, always_call=always_call)

    def hook_tables(self, module: torch.nn.Module) -> Tuple[dict, ...]:
        """Where this module keeps its hooks (for checks that a removal left nothing behind)."""
        return (module._forward_pre_hooks, module._forward_hooks)


backend = TorchBackend()
