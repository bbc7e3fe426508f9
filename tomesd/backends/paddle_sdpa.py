"""ppdiffusers' attention as a seam: proportional attention for merged keys on paddle, as torch_sdpa.py on torch.

ppdiffusers' processors compute attention one of two ways, and the seam takes both:

- `paddle.nn.functional.scaled_dot_product_attention_` (ppdiffusers defines it where paddle's fused kernels load: its
  SD3, PixArt and UNet processors on a GPU), inputs [B, S, heads, D]. As on torch, the bias rides as one more channel
  (queries a channel of ones, keys log(size) / scale, values a zero channel, the scale of the original head size),
  so the fused kernel ppdiffusers picks (flash, cutlass) runs as it came, with no mask.
- `Attention.get_attention_scores` (the classic processors, what ppdiffusers runs where those kernels do not load),
  which forms the scores [B * heads, S_q, S_k] itself and softmaxes them. There the bias is added to the scores
  through its own `attention_mask` argument: the scores are already a tensor in memory, there is no kernel to keep.

While a patch needs it, both are replaced by wrappers that pass every unarmed call through as it came; the merged
attention's hook arms the seam with its rows' sizes, the first call inside takes them, and the hook checks after
that one did (key_weights.py). The wrappers go when the last patch using them is removed (seam.py).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Optional

import paddle
import paddle.nn.functional as F

from .seam import Seam

_SDPA = "scaled_dot_product_attention_"
_SCORES = "get_attention_scores"


class PaddleKeyWeights:
    """One attention call's merged keys: `log_sizes` [B, M] (log of the tokens each merged key holds), first in the key
    sequence (`first`, SD3's [image, text]) or last; `uniform`: every merged key holds as many tokens."""

    __slots__ = ("log_sizes", "first", "uniform")

    def __init__(self, log_sizes: paddle.Tensor, first: bool, uniform: bool = False) -> None:
        self.log_sizes, self.first, self.uniform = log_sizes, first, uniform

    def _bias(self, length: int, batch: int, dtype: Any) -> paddle.Tensor:
        """[B', length] per key: the merged keys' log sizes, 0 for the text keys beside them (they weigh 1)."""
        merged = self.log_sizes.shape[-1]
        if length < merged or self.log_sizes.shape[0] not in (1, batch):
            raise ValueError(f"ToMe's proportional attention has weights for {self.log_sizes.shape[0]} samples of "
                             f"{merged} merged keys; the attention's keys are {length} per sample of {batch}; "
                             f"apply_patch with proportional_attention=False")
        sizes = self.log_sizes.astype(dtype)
        text = [paddle.zeros([sizes.shape[0], length - merged], dtype=dtype)] if length > merged else []
        return paddle.concat([sizes] + text if self.first else text + [sizes], axis=1)

    def sdpa(self, fn: Callable, query: paddle.Tensor, key: paddle.Tensor, value: paddle.Tensor,
             attn_mask: Optional[paddle.Tensor] = None, dropout_p: float = 0.0, is_causal: bool = False,
             scale: Optional[float] = None, **rest: Any) -> paddle.Tensor:
        """ppdiffusers' fused attention, inputs [B, S, heads, D], with one more query/key channel carrying the bias."""
        if attn_mask is not None or is_causal:
            raise ValueError("ToMe's proportional attention weighs merged keys inside ppdiffusers' "
                             "scaled_dot_product_attention_, which here got an attention mask (or is_causal); "
                             "apply_patch with proportional_attention=False")
        batch, length, heads = key.shape[0], key.shape[1], key.shape[2]
        if self.uniform and length == self.log_sizes.shape[-1]:
            return fn(query, key, value, dropout_p=dropout_p, scale=scale, **rest)
        size = query.shape[-1]
        scale = 1.0 / math.sqrt(size) if scale is None else scale
        pad = channels(size, query)
        bias = (self._bias(length, batch, key.dtype) / scale).reshape([-1, length, 1, 1])
        bias = bias.expand([batch, length, heads, 1])
        query = paddle.concat([query, paddle.ones_like(query[..., :1])] + _zeros(query, pad - 1), axis=-1)
        key = paddle.concat([key, bias] + _zeros(key, pad - 1), axis=-1)
        width = value.shape[-1]
        if width == size:
            value = paddle.concat([value] + _zeros(value, pad), axis=-1)
        out = fn(query, key, value, dropout_p=dropout_p, is_causal=False, scale=scale, **rest)
        return out[..., :width]

    def scores(self, fn: Callable, attn: Any, query: paddle.Tensor, key: paddle.Tensor,
               attention_mask: Optional[paddle.Tensor] = None) -> paddle.Tensor:
        """The classic processors' scores [B, heads, S_q, S_k] (or [B * heads, S_q, S_k]): the bias joins the scores
        through their mask."""
        processor = type(getattr(attn, "processor", None)).__name__
        if processor.startswith("Sliced"):  # one call per slice of the batch's heads: the arming serves one
            raise ValueError(f"ToMe's proportional attention weighs merged keys once per attention call, and "
                             f"{processor} computes the attention in slices; call set_attention_slice(None) or "
                             f"apply_patch with proportional_attention=False")
        heads, length = attn.heads, key.shape[-2]
        if len(key.shape) == 4:  # [B, heads, S_k, D] (head_to_batch_dim's default): the bias [B', 1, 1, S_k]
            bias = self._bias(length, key.shape[0], query.dtype).reshape([-1, 1, 1, length])
        else:  # [B * heads, S_k, D], ppdiffusers' rows sample-major: the bias [B * heads, 1, S_k]
            bias = self._bias(length, key.shape[0] // heads, query.dtype)
            bias = paddle.repeat_interleave(bias.expand([key.shape[0] // heads, length]), heads, axis=0).unsqueeze(1)
        mask = bias if attention_mask is None else attention_mask + bias
        return fn(attn, query, key, mask)


def _zeros(like: paddle.Tensor, count: int) -> list:
    return [paddle.zeros(like.shape[:-1] + [count], dtype=like.dtype)] if count > 0 else []


def channels(size: int, like: paddle.Tensor) -> int:
    """The channels added to a head of `size`: the bias channel, plus zeros up to the multiple of 8 the GPU's fused
    kernels take (torch_sdpa.channels' rule)."""
    return 8 - size % 8 if like.place.is_gpu_place() else 1


class PaddleSdpaSeam(Seam):
    """The process's wrapped ppdiffusers attention functions: one instance, shared by every paddle patch that weighs
    keys."""

    # What a refusal names when an armed attention made no call of it (key_weights.check_weighed)
    weighs_in = "ppdiffusers' attention (scaled_dot_product_attention_ or Attention.get_attention_scores)"
    remedy = "use one of ppdiffusers' own attention processors"
    bypasses = "its own softmax, a custom processor's kernel"

    def __reduce__(self) -> str:  # a copied patch shares the process's seam
        return "PADDLE_SDPA_SEAM"

    def _compiling(self) -> bool:
        return False  # to_static's SOT runs hooks eagerly; AST tracing is refused (paddle.py: PaddleHost)

    def _wrap(self) -> None:
        current = getattr(F, _SDPA, None)
        if current is not None and not isinstance(current, _Wrapped):
            setattr(F, _SDPA, _Wrapped(self, current, "sdpa"))
        attention = _attention_class()
        current = attention.__dict__.get(_SCORES)
        if current is not None and not isinstance(current, _WrappedMethod):
            setattr(attention, _SCORES, _WrappedMethod(self, current))

    def _unwrap(self) -> None:
        current = getattr(F, _SDPA, None)
        if isinstance(current, _Wrapped) and current.seam is self:
            setattr(F, _SDPA, current.fn)
        attention = _attention_class()
        current = attention.__dict__.get(_SCORES)
        if isinstance(current, _WrappedMethod) and current.seam is self:
            setattr(attention, _SCORES, current.fn)


def _attention_class() -> type:
    from ppdiffusers.models.attention_processor import Attention

    return Attention


class _Wrapped:
    """ppdiffusers' scaled_dot_product_attention_, weighing the keys of an armed call."""

    __slots__ = ("seam", "fn", "how", "__wrapped__", "__name__")

    def __init__(self, seam: PaddleSdpaSeam, fn: Callable, how: str) -> None:
        self.seam, self.fn, self.how = seam, fn, how
        self.__wrapped__ = fn
        self.__name__ = _SDPA

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        arming = self.seam.armed()
        if arming is None or not arming.take():
            return self.fn(*args, **kwargs)
        return arming.rewrite.sdpa(self.fn, *args, **kwargs)


class _WrappedMethod:
    """Attention.get_attention_scores, weighing the keys of an armed call (a descriptor, so `attn.` binds it)."""

    def __init__(self, seam: PaddleSdpaSeam, fn: Callable) -> None:
        self.seam, self.fn = seam, fn

    def __get__(self, attn: Any, owner: Any = None) -> Callable:
        if attn is None:
            return self
        return lambda query, key, attention_mask=None: self(attn, query, key, attention_mask)

    def __call__(self, attn: Any, query: paddle.Tensor, key: paddle.Tensor,
                 attention_mask: Optional[paddle.Tensor] = None) -> paddle.Tensor:
        arming = self.seam.armed()
        if arming is None or not arming.take():
            return self.fn(attn, query, key, attention_mask)
        return arming.rewrite.scores(self.fn, attn, query, key, attention_mask)


PADDLE_SDPA_SEAM = PaddleSdpaSeam()
