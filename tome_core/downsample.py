"""Token downsampling (ToDo): self-attention keys and values from a coarser copy of the token grid.

Queries keep every token, so attention still returns one output per token and nothing is
unmerged; only the keys/values shrink, by `factor` per side. Both methods are an index map over
the grid, like a merge: "nearest" keeps the top-left token of each factor-by-factor cell (what
nearest interpolation by 1/factor picks), "avg" is the mean of each cell (average pooling with
partial cells at the far edges averaged over the tokens they hold). A video's frames (one sequence of
`frames` grids, frame-major) are each downsampled on their own grid: no cell spans two frames.
"""
from __future__ import annotations

from typing import Any, Optional

from .backend import Backend
from .token_merge import TokenMerge


class KVDownsample:
    """A computed downsampling: maps a block's [B, frames*h*w, C] tokens to [B, frames*ceil(h/f)*ceil(w/f), C]."""

    def __init__(self, xp: Backend, keep: Optional[Any], pool: Optional[TokenMerge], n: int, m: int):
        self._xp = xp
        self._keep, self._pool = keep, pool
        self.num_tokens, self.num_kept = n, m

    def __call__(self, x: Any) -> Any:
        if self._pool is not None:
            return self._pool.merge(x)
        n = self._xp.shape(x)[1]
        if n != self.num_tokens:
            raise ValueError(f"downsampling expects {self.num_tokens} tokens, got {n}")
        return self._xp.take(x, self._keep, 1)


def compute_downsample(
    xp: Backend, like: Any, batch: int, w: int, h: int, factor: int, method: str, frames: int = 1
) -> Optional[KVDownsample]:
    """The downsampling of `frames` h-by-w grids (one after another) in each of `batch` sequences, or None
    when it keeps every token."""
    if factor <= 1 or (h <= 1 and w <= 1):
        return None
    hh, ww = -(-h // factor), -(-w // factor)
    n, m = frames * h * w, frames * hh * ww
    if method == "nearest":
        keep = xp.reshape(
            xp.reshape(xp.arange(frames * h * w, like, step=h * w), [frames, 1, 1])
            + xp.reshape(xp.arange(h, like, step=factor) * w, [1, hh, 1])
            + xp.reshape(xp.arange(w, like, step=factor), [1, 1, ww]),
            [m],
        )
        return KVDownsample(xp, keep, None, n, m)
    if method == "avg":
        cell = xp.reshape(
            xp.reshape(xp.arange(frames * hh * ww, like, step=hh * ww), [frames, 1, 1])
            + xp.reshape((xp.arange(h, like) // factor) * ww, [1, h, 1])
            + xp.reshape(xp.arange(w, like) // factor, [1, 1, w]),
            [1, n],
        )
        flat_rows = xp.reshape(cell + xp.reshape(xp.arange(batch * m, like, step=m), [batch, 1]), [batch * n])
        inv_counts = xp.reshape(1.0 / xp.counts(flat_rows, batch * m), [batch, m, 1])
        return KVDownsample(xp, None, TokenMerge(xp, flat_rows, inv_counts, batch, n, m), n, m)
    raise ValueError(f"unknown downsample method {method!r}")
