"""One forward traced on the meta device: every kernel it would launch on a GPU, with its class, its floating-point
operations and the bytes it moves. Nothing is computed and no weights are allocated, so a full-size model traces
in seconds on any CPU; a forward that reads a tensor's value on the host cannot run there and is refused by name.

Two layers see the forward. A function mode takes the calls a GPU runs as one fused kernel although the meta
device would decompose them (torch's fused attention, RMS norm), records one launch and returns an empty result of
the right shape. A dispatch mode records every other aten op that launches a kernel; views, aliases and empty
allocations launch none and are skipped."""
from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Tuple

# The classes the device-time model prices (model.py): the first three by floating-point operations, the rest by
# the bytes they read and write. Ops not named here are priced as elementwise (report lists them by name).
MATMUL, CONV, ATTENTION = "matmul", "conv", "attention"
NORM, ELEMENTWISE, COPY, GATHER, REDUCE = "norm", "elementwise", "copy", "gather_scatter", "sort_reduce"
CLASSES = (MATMUL, CONV, ATTENTION, NORM, ELEMENTWISE, COPY, GATHER, REDUCE)
BY_FLOPS = (MATMUL, CONV, ATTENTION)

_OPS = {
    MATMUL: ("mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "addbmm"),
    CONV: ("convolution", "cudnn_convolution", "_convolution", "convolution_overrideable", "cudnn_convolution_add_relu"),
    ATTENTION: ("scaled_dot_product_attention", "_cudnn_attention_forward", "_flash_attention_forward",
                "_efficient_attention_forward", "_scaled_dot_product_cudnn_attention",
                "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention"),
    NORM: ("native_group_norm", "native_layer_norm", "_fused_rms_norm", "rms_norm", "native_batch_norm",
           "_native_batch_norm_legit_no_training"),
    COPY: ("copy_", "_to_copy", "clone", "cat", "stack", "contiguous", "upsample_nearest2d", "upsample_nearest3d",
           "upsample_bilinear2d", "constant_pad_nd", "repeat", "index_select", "_unsafe_index", "roll", "flip",
           "repeat_interleave", "pixel_shuffle", "pixel_unshuffle", "avg_pool2d", "avg_pool3d"),
    GATHER: ("gather", "scatter", "scatter_", "scatter_add", "scatter_add_", "scatter_reduce", "scatter_reduce_",
             "index_add", "index_add_", "index", "index_put", "index_put_", "take_along_dim", "embedding",
             "masked_scatter", "index_copy", "index_copy_"),
    REDUCE: ("sort", "argsort", "topk", "max", "min", "amax", "amin", "argmax", "argmin", "sum", "mean",
             "linalg_vector_norm", "norm", "cumsum", "_softmax", "softmax", "var_mean", "var", "std", "prod", "any",
             "all", "logsumexp"),
}
CLASS_OF = {name: cls for cls, names in _OPS.items() for name in names}
# Within a class, kernels whose bytes cost differently get a byte rate of their own (model.Rates.byte_ms): group
# norm against layer and RMS norm, atomic scatters against gathers, sorts against reductions.
_TERM_OF = {"native_group_norm": "group_norm", "sort": "sort", "argsort": "sort", "topk": "sort",
            **{name: "scatter" for name in _OPS[GATHER] if name.startswith(("scatter", "index_add", "index_put",
                                                                             "index_copy", "masked_scatter"))}}
TERMS = tuple(CLASSES) + ("group_norm", "scatter", "sort")


def term_of(op: str, cls: str) -> str:
    """The byte rate a kernel of `op` pays: its class's, or a finer one (_TERM_OF)."""
    return _TERM_OF.get(op, cls)
# Ops that launch nothing on a GPU: allocations and metadata; views are found from the schema.
_NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh", "detach",
              "alias", "_unsafe_view", "view", "resize_", "set_", "_local_scalar_dense", "is_same_size", "sym_size",
              "sym_stride", "sym_numel", "sym_storage_offset", "_has_compatible_shallow_copy_type", "_reshape_alias",
              "zeros_like_meta_only"}


@dataclass(frozen=True)
class Launch:
    """One kernel a forward launches: its aten op, class, floating-point operations and bytes moved, and whether
    ToMe's own code asked for it (a merge's sort, gather and scatter) rather than the host's model."""
    op: str
    cls: str
    flops: float
    bytes: float
    own: bool = False
    scores: float = 0.0  # fused attention: query-key pairs, each an exponential and a softmax step
    padded_flops: float = 0.0  # fused attention: the FLOPs its kernel computes, heads padded (0: `flops`)

    @property
    def term(self) -> str:
        return term_of(self.op, self.cls)


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tomesd/
_OWN = (os.path.join(os.path.dirname(_PACKAGE), "tome_core", ""), os.path.join(_PACKAGE, ""))


def _asked_by_tome(skipped: Tuple[str, ...], modules: str) -> bool:
    """Whether the innermost caller outside torch and this tracer is ToMe's code (tome_core, tomesd). An op a
    torch module's forward launches (`modules`: torch/nn/modules/) is the host's even where ToMe's wrapper called
    that forward (a sub-layer ToMe seats itself in, as Flux's proj_mlp)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(modules):
            return False
        if not name.startswith(skipped):
            return name.startswith(_OWN)
        frame = frame.f_back
    return False


class TraceRefused(RuntimeError):
    """The forward cannot be traced on the meta device (it reads a tensor's value on the host)."""


def trace(forward: Callable[[], Any]) -> List[Launch]:
    """The launches of one `forward()` whose model and inputs live on the meta device."""
    import torch
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import flop_registry

    launches: List[Launch] = []
    skipped = (os.path.join(os.path.dirname(torch.__file__), ""), os.path.abspath(__file__), "<")
    modules = os.path.join(os.path.dirname(torch.__file__), "nn", "modules", "")

    class Fused(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = getattr(func, "__name__", "")
            if name == "scaled_dot_product_attention":
                q, k, v = (list(args[:3]) + [kwargs.get(n) for n in ("query", "key", "value")[len(args[:3]):]])
                out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
                heads = q.shape[-3] if q.dim() >= 3 else 1
                batch = math.prod(q.shape[:-3]) if q.dim() > 3 else 1
                scores = float(batch * heads * q.shape[-2] * k.shape[-2])
                flops = 2.0 * scores * (q.shape[-1] + v.shape[-1])
                padded = 2.0 * scores * (_padded_head(q.shape[-1]) + _padded_head(v.shape[-1]))
                moved = sum(_nbytes(t) for t in (q, k, v, out))
                mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
                if isinstance(mask, torch.Tensor):
                    moved += _nbytes(mask)
                # the host's attention, even where ToMe's seam hands it on (proportional attention's bias channel)
                launches.append(Launch(name, ATTENTION, flops, moved, False, scores, padded))
                return out
            if name == "rms_norm":
                x = args[0]
                out = torch.empty_like(x)
                launches.append(Launch(name, NORM, 0.0, 2.0 * _nbytes(x), _asked_by_tome(skipped, modules)))
                return out
            return func(*args, **kwargs)

    class Launches(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            name = func.overloadpacket.__name__
            if name in _NO_KERNEL or _is_view(func):
                return out
            cls = CLASS_OF.get(name, ELEMENTWISE)
            tensors = [t for t in _tensors((args, kwargs)) if t.device.type == "meta"]
            outs = [t for t in _tensors(out)]
            flops = 0.0
            counter = flop_registry.get(func.overloadpacket)
            if cls in (MATMUL, CONV) and counter is not None:
                flops = float(counter(*args, **kwargs, out_val=out))
            moved = sum(_nbytes(t) for t in tensors) + sum(_nbytes(t) for t in outs)
            if name in ("scatter", "scatter_") and "reduce" not in kwargs and len(args) > 3:
                # a plain scatter reads its index and source and writes the elements they name, not the whole
                # target (a merge's 0/1 matrix: N ones into a zeroed [B, M, N])
                index, src = args[2], args[3]
                moved = _nbytes(index) + (_nbytes(src) if isinstance(src, torch.Tensor) else 0.0) \
                    + index.numel() * args[0].element_size()
            if name == "native_group_norm":  # two passes over its input: the groups' statistics, then the output
                moved += _nbytes(args[0])
            own = _asked_by_tome(skipped, modules)
            launches.append(Launch(name, cls, flops, moved, own))
            if cls == CONV and len(args) > 2 and isinstance(args[2], torch.Tensor):
                # cuDNN adds a convolution's bias in a kernel of its own (add_, read and written in place)
                launches.append(Launch("add_", ELEMENTWISE, 0.0, 2 * sum(_nbytes(t) for t in outs), own))
            return out

    with Fused(), Launches():
        try:
            forward()
        except (NotImplementedError, RuntimeError) as exc:
            if "meta" in str(exc) or "item" in str(exc) or "data-dependent" in str(exc):
                raise TraceRefused(str(exc).splitlines()[0]) from exc
            raise
    return launches


def _padded_head(channels: int) -> int:
    """A head as the fused kernels compute it: flash and cuDNN attention are built for heads of 32, 64, 96, ...
    channels and pad the others up (SD1.5's 40 computes as 64; a proportional-attention head of 72 as 96)."""
    return -(-channels // 32) * 32


def _is_view(func: Any) -> bool:
    schema = func._schema
    return any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)


def _tensors(tree: Any) -> List[Any]:
    import torch
    from torch.utils._pytree import tree_leaves

    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _nbytes(t: Any) -> float:
    """What a kernel reads or writes of `t`: its elements, or its storage where that is smaller (an expanded index
    repeats a few values, which the kernel reads from cache)."""
    size = t.numel() * t.element_size()
    try:
        size = min(size, t.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):
        pass
    return float(size)


def totals(launches: List[Launch]) -> Dict[str, Tuple[int, float]]:
    """{class: (kernels, work)}: work is FLOPs for the compute classes, bytes for the others."""
    found: Dict[str, Tuple[int, float]] = {cls: (0, 0.0) for cls in CLASSES}
    for launch in launches:
        n, work = found[launch.cls]
        found[launch.cls] = (n + 1, work + (launch.flops if launch.cls in BY_FLOPS else launch.bytes))
    return found
