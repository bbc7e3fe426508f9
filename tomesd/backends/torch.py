"""PyTorch backend."""
from __future__ import annotations

import contextlib
import operator
from typing import Any, Callable, Iterator, Optional, Sequence, Tuple

import torch

from . import torch_dispatch, torch_function_seam, torch_links, torch_parallel, torch_projections, torch_sdpa



# A mean merge as a product with its 0/1 matrix [B, M, N] (merge_matrix), in place of a scatter (index_add_ or
# scatter_reduce_), where the device-time model prices the product the cheaper (docs/device-time.md, "ToMe's own
# kernels"): a GPU's scatter moves a byte about five times slower than a copy (its atomics; rates.json's "scatter"
# against "copy"), while the product's FLOPs run on tensor cores. Per channel the product costs 2·M·N FLOPs and the
# scatter (2·M + N) elements, so the choice does not depend on C: with the fitted H100 rates at half precision they
# break even at M·N / (2·M + N) ≈ 2,200 (H200 alike). Below _PRODUCT_BREAK_EVEN (a margin for the model's error)
# and within _PRODUCT_BYTES of matrix, the product: Flux, SD3 and SDXL at 1024² (4,096 tokens), not SD1.5's 16,384
# nor Wan's 32,760 at their picks. On a CPU a product costs M times the scatter's adds, and float32 products run
# without tensor cores by default: both keep the scatter, as does torch in tests (the product is tested by force).
_PRODUCT_BREAK_EVEN = 1500.0
_PRODUCT_BYTES = 64 << 20
_HALF = (torch.float16, torch.bfloat16)
_PRODUCTS = [True]  # off inside scattered_merges()


def merge_pays_as_product(like: torch.Tensor, batch: int, n: int, m: int) -> bool:
    """Whether a mean merge of `batch` maps of n tokens into m rows, on `like`'s device and dtype, is priced cheaper
    as a product with its matrix than as a scatter (the meta device stands for the GPU it is traced for)."""
    return (_PRODUCTS[0] and like.device.type != "cpu" and like.dtype in _HALF
            and n * m < _PRODUCT_BREAK_EVEN * (2 * m + n) and batch * m * n * like.element_size() <= _PRODUCT_BYTES)


@contextlib.contextmanager
def scattered_merges() -> Iterator[None]:
    """Every mean merge as a scatter, as before products were taken (the device-time model's fit traces the recorded
    GPU runs so: they scattered)."""
    before = _PRODUCTS[0]
    _PRODUCTS[0] = False
    try:
        yield
    finally:
        _PRODUCTS[0] = before


class TorchArrays:
    """tome_core's array namespace on torch tensors (tome_core.backend.Backend).

    Every operation runs on each merged block of each step, so those whose arguments torch takes as they come are
    torch's own functions, bound as attributes (calling them runs no Python frame); the others are one small
    function each."""

    name = "torch"

    # Torch's functions, taking the protocol's arguments as they are.
    reshape = staticmethod(torch.reshape)
    concat = staticmethod(torch.cat)
    unstack = staticmethod(torch.unbind)
    max_with_indices = staticmethod(torch.max)
    equal = staticmethod(torch.eq)
    broadcast_to = staticmethod(torch.broadcast_to)
    where = staticmethod(torch.where)
    bitwise_xor = staticmethod(torch.bitwise_xor)
    floor = staticmethod(torch.floor)
    to_int64 = staticmethod(torch.Tensor.long)
    to_float32 = staticmethod(torch.Tensor.float)

    def __reduce__(self) -> str:
        return "backend"  # copies and pickles of patched models share the module's one instance

    no_grad = staticmethod(torch.no_grad)
    grad_enabled = staticmethod(torch.is_grad_enabled)

    @staticmethod
    def shape(x: torch.Tensor) -> Tuple[int, ...]:
        # Plain ints; under torch.compile int() specializes each size, so each resolution is one static graph
        # (a dynamic-shape trace would guard on the token count, an expression of the latent size that dynamo's
        # sympy takes minutes to simplify). In eager mode map and int run no Python frame.
        return tuple(map(int, x.shape))

    @staticmethod
    def arange(n: int, like: torch.Tensor, step: int = 1) -> torch.Tensor:
        return torch.arange(0, n, step, device=like.device, dtype=torch.int64)

    @staticmethod
    def zeros(shape: Sequence[int], like: torch.Tensor, integer: bool = False) -> torch.Tensor:
        return torch.zeros(shape, device=like.device, dtype=torch.int64 if integer else like.dtype)

    @staticmethod
    def take(x: torch.Tensor, indices: torch.Tensor, axis: int) -> torch.Tensor:
        return torch.index_select(x, axis, indices)

    @staticmethod
    def take_along(x: torch.Tensor, indices: torch.Tensor, axis: int) -> torch.Tensor:
        return torch.gather(x, axis, indices)

    @staticmethod
    def put_along(x: torch.Tensor, indices: torch.Tensor, axis: int) -> torch.Tensor:
        return torch.empty_like(x).scatter_(axis, indices, x)

    @staticmethod
    def segment_mean(x: torch.Tensor, segments: torch.Tensor, count: int,
                     inv_counts: Optional[torch.Tensor]) -> torch.Tensor:
        if inv_counts is None:  # one call from the host, seven kernels on CUDA (docs/host-cost.md)
            out = torch.empty((count, x.shape[1]), device=x.device, dtype=x.dtype)
            return out.scatter_reduce_(0, segments.unsqueeze(1).expand(x.shape), x, "mean", include_self=False)
        # Three kernels, and inductor lowers them (it runs scatter_reduce_'s mean as an aten fallback). float32
        # counts: a half-precision sum is scaled in float32 and rounded once
        return torch.zeros((count, x.shape[1]), device=x.device, dtype=x.dtype).index_add_(0, segments, x).mul_(inv_counts)

    @staticmethod
    def merge_matrix(rows: torch.Tensor, batch: int, n: int, m: int, like: torch.Tensor,
                     force: bool = False) -> Optional[torch.Tensor]:
        # Built once per merge, for every merging site of its block (merge_pays_as_product says when)
        if not force and not merge_pays_as_product(like, batch, n, m):
            return None
        local = rows.reshape(batch, 1, n) - torch.arange(0, batch * m, m, device=rows.device).view(batch, 1, 1)
        return torch.zeros((batch, m, n), device=like.device, dtype=like.dtype).scatter_(1, local, 1.0)

    @staticmethod
    def matrix_mean(matrix: torch.Tensor, x: torch.Tensor, inv_counts: torch.Tensor) -> torch.Tensor:
        b, m, n = matrix.shape
        if matrix.dtype != x.dtype:  # a site of another dtype than the merge's first (not seen in a host)
            matrix = matrix.to(x.dtype)
        # The product accumulates in float32 (tensor cores) and rounds once; times the float32 counts, once more,
        # as the scatter's sum times them does
        # reshape, not view: a site's tokens may come strided (a view of the host's), copied then as a scatter reads
        return torch.bmm(matrix, x.reshape(b, n, -1)).view(b * m, -1).mul_(inv_counts)

    # A Python function bound as is: the merge asks once per merge, not per site
    prefers_kept_counts = staticmethod(torch.compiler.is_compiling)

    @staticmethod
    def scatter_add(target: torch.Tensor, indices: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        return target.index_add(0, indices, src)

    @staticmethod
    def scatter_reduce(target: torch.Tensor, indices: torch.Tensor, src: torch.Tensor, mode: str) -> torch.Tensor:
        return target.index_reduce(0, indices, src, mode, include_self=False)

    @staticmethod
    def argsort(x: torch.Tensor, axis: int, descending: bool) -> torch.Tensor:
        return torch.sort(x, dim=axis, descending=descending, stable=True).indices

    @staticmethod
    def matmul_transposed(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        # bmm itself: matmul reaches the same kernel through two expands, two views and an _unsafe_view, five
        # dispatcher calls more at every block
        return torch.bmm(a, b.transpose(1, 2))

    @staticmethod
    def l2_normalize(x: torch.Tensor, axis: int) -> torch.Tensor:
        return x / torch.linalg.vector_norm(x, dim=axis, keepdim=True)  # Tensor.norm's own kernel, without its Python

    @staticmethod
    def counts(x: torch.Tensor, length: int) -> torch.Tensor:
        ones = torch.ones(x.shape, device=x.device, dtype=torch.float32)
        return torch.zeros(length, device=x.device, dtype=torch.float32).index_add_(0, x, ones)

    @staticmethod
    def astype_like(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return x.to(device=like.device, dtype=like.dtype)

    @staticmethod
    def randint_from(generator: torch.Generator, high: int, shape: Sequence[int], like: torch.Tensor) -> torch.Tensor:
        # tomesd's draw, so a generator in the same state gives tomesd's pattern.
        draws = torch.randint(high, size=(*shape, 1), device=generator.device, generator=generator)
        return draws.reshape(-1).to(like.device)


class TorchHost:
    """What the runtime does to torch modules beyond arrays: forward hooks, graph-compiler detection, the
    grad mode, and the one host read a bare model's reuse_steps needs."""

    name = "torch"
    # Where a module keeps its forward hooks, and the flag tables keyed by the same hook ids.
    hook_tables = (
        ("_forward_pre_hooks", ("_forward_pre_hooks_with_kwargs",)),
        ("_forward_hooks", ("_forward_hooks_with_kwargs", "_forward_hooks_always_called")),
    )

    def __reduce__(self) -> str:
        return "host"  # copies and pickles of patched models share the module's one instance

    # A method, not torch's function bound as an attribute: bound so, a refusal raised while dynamo traced
    # (mode='downsample' on Flux, compiled: test_downsample_dispatch.py) fell back to eager instead of reaching
    # the caller.
    def is_compiling(self) -> bool:
        return torch.compiler.is_compiling()

    grad_enabled = staticmethod(torch.is_grad_enabled)

    def host_float(self, x: Any) -> float:
        """A scalar's value on the host (one device sync for a tensor on an accelerator)."""
        return float(x.detach().reshape(-1)[0]) if isinstance(x, torch.Tensor) else float(x)

    def reset_compiled(self) -> None:
        torch.compiler.reset()

    @staticmethod
    def compiled_blocks(blocks: Sequence[torch.nn.Module]) -> bool:
        """Whether any of `blocks` is compiled on its own (`Module.compile`, as diffusers' compile_repeated_blocks
        does): its hooks are then traced apart from its root's, which run eagerly."""
        for block in blocks:
            if block.__dict__.get("_compiled_call_impl") is not None:
                return True
        return False

    @staticmethod
    def index_tensor(index: int, like: torch.Tensor) -> torch.Tensor:
        """`index` as an int64 [1] on `like`'s device, at an address CUDA graphs may keep (made once per device)."""
        import torch._dynamo  # loaded already where blocks are compiled

        tensor = torch.tensor([index], dtype=torch.int64, device=like.device)
        torch._dynamo.mark_static_address(tensor, guard=False)  # guarded by address, every block would be a graph
        return tensor

    def named_modules(self, module: torch.nn.Module) -> Iterator[Tuple[str, torch.nn.Module]]:
        return module.named_modules()

    # Read inline on the hot path, with no Python frame (runtime.ToMePatch): the attribute naming a tensor's device,
    # compared before asking on_device_of, and the tensor type on_local_tokens passes through as it is
    device_attr = "device"
    plain_tensor = torch.Tensor

    def on_device_of(self, x: torch.Tensor, like: Any) -> torch.Tensor:
        """`x` on the device of `like` (a tensor; anything else leaves `x` as it is)."""
        device = getattr(like, "device", None)
        return x if device is None or x.device == device else x.to(device)

    def add_pre_hook(self, module: torch.nn.Module, hook: Callable) -> Any:
        return module.register_forward_pre_hook(hook, with_kwargs=True)

    def add_post_hook(self, module: torch.nn.Module, hook: Callable, always_call: bool = False) -> Any:
        return module.register_forward_hook(hook, always_call=always_call)

    def add_inner_hooks(self, module: torch.nn.Module, pre: Optional[Callable], post: Optional[Callable],
                        owner: Any) -> Any:
        """`pre` and `post` (forward-hook signatures) innermost in the module's forward chain, inside
        diffusers' and accelerate's wrappers (torch_links.py)."""
        return torch_links.seat(module, pre, post, owner)

    def add_inner_wrapper(self, module: torch.nn.Module, wrap: Callable, owner: Any) -> Any:
        """`wrap(module, inner, args, kwargs)` innermost in the module's forward chain (as add_inner_hooks): it
        calls the rest of the chain itself."""
        return torch_links.seat(module, None, None, owner, wrap)

    def remove_inner_hooks(self, module: torch.nn.Module, owns: Callable[[Any], bool]) -> None:
        torch_links.unseat(module, owns)

    def inner_hook_owners(self, module: torch.nn.Module) -> list:
        return torch_links.owners(module)

    def attention_seam(self) -> Any:
        """diffusers' attention dispatch, where keys arrive rotated (torch_dispatch.py)."""
        return torch_dispatch.SEAM

    def key_weight_seam(self) -> Any:
        """torch's scaled_dot_product_attention, where proportional attention weighs merged keys (torch_sdpa.py)."""
        return torch_sdpa.SDPA_SEAM

    def projection_hooks(self, seam: Any, attention: torch.nn.Module,
                         owner: Any) -> Optional[Tuple[Callable, Callable]]:
        """Hooks on an attention's to_q / to_k weighing its keys there, where it forms its scores itself (the original
        LDM code's CrossAttention: torch_projections.py); None where it calls SDPA."""
        return torch_projections.projection_hooks(seam, attention, owner)

    def function_seam(self, path: str) -> Any:
        """A function a block calls by its module-level name, "module:name" (torch_function_seam.py)."""
        return torch_function_seam.function_seam(path)

    def key_weights(self, inv_counts: torch.Tensor, image_keys_first: bool, uniform: bool = False) -> Any:
        """One attention's weights: log of each merged row's token count ([B, M, 1] inverse counts)."""
        return torch_sdpa.KeyWeights(-torch.log(inv_counts[..., 0]), image_keys_first, uniform)

    @staticmethod
    def shrunk_keys(down: Any, weights: Any) -> Any:
        """A fused attention's SDPA call with its image keys and values downsampled (key_weight_seam's rewrite)."""
        return torch_sdpa.ShrunkKeys(down, weights)

    # `fn` (a merge or unmerge along the tokens) on `x`, or on a DTensor's local tensor (tensor parallelism)
    on_local_tokens = staticmethod(torch_parallel.on_local_tokens)

    def context_split(self, root: torch.nn.Module) -> Optional[torch_parallel.ContextSplit]:
        """This process's band of `root`'s tokens under diffusers' context parallelism, or None."""
        return torch_parallel.context_split(root)

    # (identity rows for the processor, or None without `identity`; the dispatch's rewrite rotating by per-sample
    # `rows`): torch_dispatch.rotation_at_dispatch(how, rows, image_first=False, identity=True), bound as it is (every
    # rotating site of every block calls it)
    rotation_at_dispatch = staticmethod(torch_dispatch.rotation_at_dispatch)

    def dispatches(self, processor: Any) -> bool:
        """Whether `processor` calls diffusers' attention dispatch (so the seam sees its keys)."""
        return torch_dispatch.available() and torch_dispatch.dispatches(processor)


class EagerTorchArrays(TorchArrays):
    """TorchArrays for a call no graph compiler traces (the runtime picks it per call: CallState.xp). `shape` is
    the tensor's own torch.Size, a tuple of plain ints in eager mode, read by a C getter: no Python frame for the
    op the hot path calls most. (Traced, sizes may be symbolic: TorchArrays.shape makes them ints.)"""

    shape = operator.attrgetter("shape")
    # Never traced, so never under a graph compiler: False, from a C call (bool() is False) with no Python frame,
    # where torch.compiler.is_compiling runs two (once for each merge built: every merged block of every step)
    prefers_kept_counts = staticmethod(bool)

    def __reduce__(self) -> str:
        return "eager_backend"


backend = TorchArrays()
eager_backend = backend.eager = EagerTorchArrays()  # `eager`: the backend's variant for calls never traced
eager_backend.eager = eager_backend
host = TorchHost()
