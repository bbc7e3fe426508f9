"""Proportional attention where the attention forms its own scores: the original LDM code's CrossAttention (CompVis'
`ldm.modules.attention`) projects queries and keys with `to_q` / `to_k`, splits them into heads and computes
softmax(q k^T * scale) itself, with `scale` a fixed attribute, so no SDPA call carries the weights (torch_sdpa.py).

The bias rides in the projections instead, as one more channel per head: `to_q`'s output gets a channel of ones, `to_k`'s
a channel of log(size) / scale, so the attention's own product adds exactly log(size) to each score; values keep their
width, and the output's does not change. The attention's hook arms the SDPA seam as for any attention; here `to_k`'s
hook takes the arming, so the hook's check after the attention holds exactly when the weights went in.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

import torch


def own_scores(attention: Any) -> bool:
    """Whether `attention` forms its scores itself from to_q / to_k with a fixed scale (so the weights go there): LDM's
    CrossAttention running LDM's own forward. The A1111 web UI replaces that forward with its optimizations' (SDPA,
    xformers, sub-quadratic, ...), which scale by the heads' width: one more channel would change their scale, so
    those are weighed at torch's SDPA as any attention, or refused at the first call that makes none."""
    cls = type(attention)
    return (cls.__name__ == "CrossAttention" and cls.__module__ == "ldm.modules.attention"
            and getattr(cls.forward, "__module__", None) == "ldm.modules.attention")


def projection_hooks(seam: Any, attention: Any, owner: Any) -> Optional[Tuple[Callable, Callable]]:
    """(post-hook for to_q, post-hook for to_k) weighing `attention`'s merged keys, or None where it calls SDPA. The
    hooks are methods of an object whose `patch` is `owner`, so that removing the patch's hooks takes them too."""
    if not own_scores(attention):
        return None
    weights = _ProjectionWeights(owner, seam, attention.heads, attention.scale)
    return weights.query, weights.key


class _ProjectionWeights:
    __slots__ = ("patch", "seam", "heads", "scale")

    def __init__(self, patch: Any, seam: Any, heads: int, scale: float) -> None:
        self.patch, self.seam, self.heads, self.scale = patch, seam, heads, scale

    def query(self, module: Any, args: tuple, out: torch.Tensor) -> torch.Tensor:
        arming = self.seam.armed()
        if arming is None or arming.left <= 0:
            return out
        return _per_head(out, self.heads, out.new_ones(1, 1, 1))

    def key(self, module: Any, args: tuple, out: torch.Tensor) -> torch.Tensor:
        arming = self.seam.armed()
        if arming is None or not arming.take():
            return out
        bias = arming.rewrite.bias(out.shape[1], out.shape[0], self.scale, out.dtype)  # torch_sdpa.KeyWeights
        return _per_head(out, self.heads, bias.unsqueeze(-1))


def _per_head(x: torch.Tensor, heads: int, extra: torch.Tensor) -> torch.Tensor:
    """[B, N, heads * D] -> [B, N, heads * (D + 1)], each head's channels followed by `extra` ([B or 1, N or 1, 1])."""
    batch, length = x.shape[:2]
    split = x.reshape(batch, length, heads, -1)
    extra = extra.unsqueeze(2).expand(batch, length, heads, 1)
    return torch.cat([split, extra], -1).reshape(batch, length, -1)
