"""torch's scaled_dot_product_attention as a seam: proportional attention for merged keys, with no mask.

A merged key stands for the tokens it holds; proportional attention (ToMe for ViTs) adds log(size) to its
attention scores, so attending to it weighs as attending to each of its tokens. An additive mask would move
SDPA off its fused kernels (FlashAttention takes no mask), so the bias rides as one more channel instead: the
queries get a channel of ones and the keys a channel of log(size) / scale, and with the scale of the original
head size the extra product adds exactly log(size) to each score. Values get a zero channel (the fused kernels
want one head size for all three), the output drops it. On CUDA the head size is padded to the multiple of 8
the fused kernels take; elsewhere one channel is added. The processors that call it (diffusers' UNet, SD3,
PixArt processors, and its attention dispatch's "native" backend, which Flux and Wan go through) run unchanged.

While a patch needs it, `torch.nn.functional.scaled_dot_product_attention` is replaced by a wrapper that passes
every unarmed call through as it came; the attention module's hook arms it for its own call (`arm`), the first
SDPA call inside takes the weights, and the module's post-hook checks that one did (`disarm`). The wrapper goes
when the last patch using it is removed (seam.py: users, the armed slot).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, Optional

import torch
import torch.nn.functional as F

from .torch_seam import Seam

_NAME = "scaled_dot_product_attention"


class KeyWeights:
    """One attention call's merged keys: `log_sizes` [B, M] (log of the tokens each merged key holds), which sit
    first in the key sequence (`first`, SD3's [image, text]) or last (alone, or after text: Flux's [text, image])."""

    __slots__ = ("log_sizes", "first", "uniform")

    def __init__(self, log_sizes: torch.Tensor, first: bool, uniform: bool = False) -> None:
        # uniform: every merged key holds as many tokens (full downsampling cells), so over those keys alone the
        # weights cancel in the softmax and the call runs as it came.
        self.log_sizes, self.first, self.uniform = log_sizes, first, uniform

    def bias(self, length: int, batch: int, scale: float, dtype: torch.dtype) -> torch.Tensor:
        """[B or 1, length]: log(size) / scale on the merged keys, 0 on the text keys beside them (they weigh 1)."""
        merged = self.log_sizes.shape[-1]
        if length < merged or self.log_sizes.shape[0] not in (1, batch):
            raise ValueError(f"ToMe's proportional attention has weights for {self.log_sizes.shape[0]} samples of "
                             f"{merged} merged keys; the attention has {length} keys per sample of {batch}; "
                             f"apply_patch with proportional_attention=False")
        return F.pad((self.log_sizes / scale).to(dtype), (0, length - merged) if self.first else (length - merged, 0))

    def _widened(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: Optional[float],
                 tokens: int) -> tuple:
        """(query, key, value with the bias channel and zeros up to the fused kernels' multiple, the scale of the
        original head size, the value's width); `tokens`: the keys' token axis (2 in [B, heads, S, D], 1 in
        [B, S, heads, D])."""
        if key.dim() != 4:
            raise ValueError(f"ToMe's proportional attention expects 4-D keys, got {list(key.shape)}; apply_patch "
                             f"with proportional_attention=False")
        size, length = query.shape[-1], key.shape[tokens]
        scale = 1.0 / math.sqrt(size) if scale is None else scale
        pad = channels(size, query.device)
        shape = [-1, 1, 1, 1]
        shape[tokens] = length
        bias = self.bias(length, key.shape[0], scale, key.dtype).reshape(shape).expand(*key.shape[:-1], 1)
        query = torch.cat([query, query.new_ones(*query.shape[:-1], 1), query.new_zeros(*query.shape[:-1], pad - 1)], -1)
        key = torch.cat([key, bias, key.new_zeros(*key.shape[:-1], pad - 1)], -1)
        width = value.shape[-1]
        return query, key, F.pad(value, (0, pad)) if width == size else value, scale, width

    def widened_for_default_scale(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                  pad: int) -> tuple:
        """For a kernel that takes no scale and divides the scores by the square root of the head size it is given
        (ComfyUI's attention functions), [B, heads, S, D] in: (query, key, value of D + `pad` channels, D). The
        query is stretched by sqrt((D + pad) / D), so the kernel's scale over the wider head is the original head's.
        The bias's product is split evenly between the query's channel and the key's (D ** 0.25 each way), so that
        neither stands far outside the head's range where a kernel quantizes queries and keys by blocks
        (SageAttention's int8)."""
        size, length = query.shape[-1], key.shape[2]
        stretch, even = math.sqrt((size + pad) / size), size ** 0.25
        bias = self.bias(length, key.shape[0], 1.0 / even, key.dtype)  # log(size) * D ** 0.25
        bias = bias[:, None, :, None].expand(*key.shape[:-1], 1)
        query = torch.cat([query * stretch, query.new_full((*query.shape[:-1], 1), stretch * even),
                           query.new_zeros(*query.shape[:-1], pad - 1)], -1)
        key = torch.cat([key, bias, key.new_zeros(*key.shape[:-1], pad - 1)], -1)
        width = value.shape[-1]
        return query, key, F.pad(value, (0, pad)) if width == size else value, width

    def __call__(self, fn: Callable, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attn_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0, is_causal: bool = False,
                 scale: Optional[float] = None, **rest: Any) -> torch.Tensor:
        if attn_mask is not None or is_causal:
            raise ValueError("ToMe's proportional attention weighs merged keys inside torch's "
                             "scaled_dot_product_attention, which here got an attention mask (or is_causal); "
                             "apply_patch with proportional_attention=False")
        if self.uniform and key.shape[-2] == self.log_sizes.shape[-1]:
            return fn(query, key, value, dropout_p=dropout_p, scale=scale, **rest)
        query, key, value, scale, width = self._widened(query, key, value, scale, 2)
        out = fn(query, key, value, dropout_p=dropout_p, is_causal=False, scale=scale, **rest)
        return out[..., :width]

    def around(self, fn: Callable, kwargs: Dict[str, Any]) -> Any:
        """diffusers' attention dispatch (torch_dispatch.py: a backend function called by keyword, [B, S, heads, D]):
        the same channels join the queries, keys and values before the backend runs, so under context parallelism
        they travel with the keys through its exchange between ranks (Ulysses' all-to-all, ring's passes) and every
        rank's keys carry their own sizes."""
        if kwargs.get("attn_mask") is not None or kwargs.get("is_causal"):
            raise ValueError("ToMe's proportional attention weighs merged keys at diffusers' attention dispatch, which "
                             "here got an attention mask (or is_causal); apply_patch with proportional_attention=False")
        if self.uniform and kwargs["key"].shape[1] == self.log_sizes.shape[-1]:  # every key alike: nothing to weigh
            return fn(**kwargs)
        query, key, value, scale, width = self._widened(
            kwargs["query"], kwargs["key"], kwargs["value"], kwargs.get("scale"), 1)
        out = fn(**dict(kwargs, query=query, key=key, value=value, scale=scale))
        if isinstance(out, tuple):  # (output, log-sum-exp): ring attention's partial results
            return (out[0][..., :width],) + tuple(out[1:])
        return out[..., :width]


class ShrunkKeys:
    """Downsampling inside a fused attention's one SDPA call (diffusers' FusedAttnProcessor2_0 and
    FusedJointAttnProcessor2_0 project queries, keys and values in one to_qkv, so no module takes the keys' input
    alone): the image's rows of its keys and values, [B, heads, S, D] with the image first (all of S on a UNet, the
    text after it on SD3), downsampled by `down`. A linear projection commutes with taking every n-th token and with
    a cell's mean, so this is what downsampling the projections' input gives, to round-off. With proportional
    attention `weights` (KeyWeights) then weigh the kept keys in the same call."""

    __slots__ = ("down", "weights")

    def __init__(self, down: Any, weights: Optional[KeyWeights]) -> None:
        self.down, self.weights = down, weights

    def __call__(self, fn: Callable, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attn_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0, is_causal: bool = False,
                 scale: Optional[float] = None, **rest: Any) -> torch.Tensor:
        down = self.down
        n = down.num_tokens
        if attn_mask is not None or is_causal:
            raise ValueError("mode='downsample' cannot shrink the keys of a fused attention given an attention mask "
                             "(the mask addresses every token); use mode='merge'")
        if key.dim() != 4 or key.shape[2] < n or value.shape[:3] != key.shape[:3]:
            raise ValueError(f"mode='downsample' expected the fused attention's keys and values to start with the {n} "
                             f"image tokens [B, heads, S, dim], got {list(key.shape)} and {list(value.shape)}; call "
                             f"unfuse_qkv_projections() first")
        k, v = key.transpose(1, 2), value.transpose(1, 2)  # [B, S, heads, D]: the tokens on downsampling's axis
        if k.shape[1] == n:
            k, v = down.shrink_tails(k, v)
        else:  # SD3's joint attention: [image, text]
            k = torch.cat([down.shrink_tail(k[:, :n]), k[:, n:]], 1)
            v = torch.cat([down.shrink_tail(v[:, :n]), v[:, n:]], 1)
        key, value = k.transpose(1, 2), v.transpose(1, 2)
        if self.weights is not None:
            return self.weights(fn, query, key, value, dropout_p=dropout_p, scale=scale, **rest)
        return fn(query, key, value, dropout_p=dropout_p, is_causal=False, scale=scale, **rest)


def channels(size: int, device: torch.device) -> int:
    """The channels added to a head of `size`: the bias channel, plus zeros up to the multiple of 8 CUDA's fused
    kernels take (on the CPU its flash kernel takes any size, and one channel costs least)."""
    return 8 - size % 8 if device.type == "cuda" else 1


class SdpaSeam(Seam):
    """The process's wrapped scaled_dot_product_attention: one instance, shared by every patch that weighs keys.
    An arming may be for several calls (a span whose merged tokens meet several attentions: SD3.5's second
    self-attention in ComfyUI's MMDiT)."""

    # What a refusal names when an armed attention made no call of it (key_weights.check_weighed)
    weighs_in = "torch's scaled_dot_product_attention (in ComfyUI: at its attention override, or in torch's SDPA)"
    bypasses = "its own softmax, xformers, sub-quadratic or sage attention, a flash-attn backend"
    remedy = ("run the attention through torch's SDPA (diffusers: an SDPA processor or the 'native' attention "
              "backend; ComfyUI, where this attention call bypassed ComfyUI's attention override: "
              "--use-pytorch-cross-attention)")

    def __reduce__(self) -> str:  # a copied patch shares the process's seam
        return "SDPA_SEAM"

    def _wrap(self) -> None:
        current = getattr(F, _NAME)
        if not isinstance(current, _Wrapped):
            setattr(F, _NAME, _Wrapped(self, current))

    def _unwrap(self) -> None:
        current = getattr(F, _NAME, None)
        if isinstance(current, _Wrapped) and current.seam is self:
            setattr(F, _NAME, current.fn)  # what is there now: code that wrapped it since keeps its own


class _Wrapped:
    """torch's scaled_dot_product_attention, weighing the keys of an armed call. Named as the function it wraps
    (torch's own tables, dynamo's among them, read the names of torch.nn.functional's members)."""

    __slots__ = ("seam", "fn", "__wrapped__", "__name__", "__qualname__")

    def __init__(self, seam: SdpaSeam, fn: Callable) -> None:
        self.seam, self.fn = seam, fn
        self.__wrapped__ = fn
        self.__name__ = self.__qualname__ = _NAME

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        arming = self.seam.armed()
        if arming is None or not arming.take():  # the attentions an arming is for: an IP-Adapter's extra stays
            return self.fn(*args, **kwargs)
        return arming.rewrite(self.fn, *args, **kwargs)


SDPA_SEAM = SdpaSeam()
