"""Token downsampling (ToDo): self-attention keys and values from a coarser copy of the token grid.

Queries keep every token, so attention still returns one output per token and nothing is
unmerged; only the keys/values shrink, by `factor` per side. Both methods are an index map over
the grid, like a merge: "nearest" keeps the top-left token of each factor-by-factor cell (what
nearest interpolation by 1/factor picks), "avg" is the mean of each cell (average pooling with
partial cells at the far edges averaged over the tokens they hold). A video's frames (one sequence of
`frames` grids, frame-major) are each downsampled on their own grid: no cell spans two frames.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

from .backend import Backend
from .token_merge import TokenMerge


class KVDownsample:
    """A computed downsampling: maps a block's [B, frames*h*w, C] tokens to [B, frames*ceil(h/f)*ceil(w/f), C]."""

    def __init__(self, xp: Backend, keep: Optional[Any], pool: Optional[TokenMerge], n: int, m: int,
                 grid: Tuple[Any, int, int, int, int]):
        self._xp = xp
        self._keep, self._pool = keep, pool
        self.num_tokens, self.num_kept = n, m
        self._grid = grid  # (a tensor on the device, h, w, factor, frames): each token's cell, when asked
        self._tail_index: dict = {}  # text rows before the image -> the kept rows of [text, image] (shrink_tail)

    @property
    def uniform(self) -> bool:
        """Whether every kept key stands for as many tokens (the grid divides into whole cells)."""
        _, h, w, factor, _ = self._grid
        return all(side % factor == 0 or side <= factor for side in (h, w))  # (one row of cells: all alike)

    @property
    def inv_counts(self) -> Any:
        """[1, m, 1]: 1 / the tokens each kept key stands for (its cell's; fewer in the far edges' cells), which
        proportional attention weighs it by."""
        xp = self._xp
        cells = xp.reshape(_cells(xp, *self._grid), [self.num_tokens])
        return xp.reshape(1.0 / xp.counts(cells, self.num_kept), [1, self.num_kept, 1])

    def __call__(self, x: Any) -> Any:
        if self._pool is not None:
            return self._pool.merge(x)
        n = self._xp.shape(x)[1]
        if n != self.num_tokens:
            raise ValueError(f"downsampling expects {self.num_tokens} tokens, got {n}")
        return self._xp.take(x, self._keep, 1)


    def shrink_tails(self, key: Any, value: Any) -> Tuple[Any, Any]:
        """shrink_tail of keys and values of one shape (an attention's), the index read once: (keys, values)."""
        xp = self._xp
        shape = xp.shape(key)
        s, n = shape[1], self.num_tokens
        if self._pool is not None or s < n or xp.shape(value)[:2] != shape[:2]:
            return self.shrink_tail(key), self.shrink_tail(value)
        index = self._tail_index.get(s - n)
        if index is None:
            index = self._keep if s == n else xp.concat([xp.arange(s - n, self._keep), self._keep + (s - n)], 0)
            self._tail_index[s - n] = index
        return xp.take(key, index, 1), xp.take(value, index, 1)

    def shrink_tail(self, x: Any) -> Any:
        """x [B, S, ...] whose last N rows along axis 1 are the image's (any before them text): the image's rows
        downsampled, the text's kept, in one gather for "nearest" (its index kept per text length)."""
        xp = self._xp
        shape = xp.shape(x)
        b, s, n = shape[0], shape[1], self.num_tokens
        if s < n:
            raise ValueError(f"downsampling expects a sequence ending with the {n} image tokens, got {s} tokens")
        if self._pool is None:
            index = self._tail_index.get(s - n)
            if index is None:
                index = self._keep if s == n else xp.concat([xp.arange(s - n, self._keep), self._keep + (s - n)], 0)
                self._tail_index[s - n] = index
            return xp.take(x, index, 1)
        rest = list(shape[2:])
        width = 1
        for d in rest:
            width *= d
        image = xp.reshape(self._pool.merge(xp.reshape(x[:, s - n:], [b, n, width])), [b, self.num_kept] + rest)
        return image if s == n else xp.concat([x[:, :s - n], image], 1)


def compute_downsample(
    xp: Backend, like: Any, batch: int, w: int, h: int, factor: int, method: str, frames: int = 1
) -> Optional[KVDownsample]:
    """The downsampling of `frames` h-by-w grids (one after another) in each of `batch` sequences, or None
    when it keeps every token."""
    if factor <= 1 or (h <= 1 and w <= 1):
        return None
    hh, ww = -(-h // factor), -(-w // factor)
    n, m = frames * h * w, frames * hh * ww
    grid = (like, h, w, factor, frames)
    if method == "nearest":
        keep = xp.reshape(
            xp.reshape(xp.arange(frames * h * w, like, step=h * w), [frames, 1, 1])
            + xp.reshape(xp.arange(h, like, step=factor) * w, [1, hh, 1])
            + xp.reshape(xp.arange(w, like, step=factor), [1, 1, ww]),
            [m],
        )
        return KVDownsample(xp, keep, None, n, m, grid)
    if method == "avg":
        cell = _cells(xp, *grid)
        flat_rows = xp.reshape(cell + xp.reshape(xp.arange(batch * m, like, step=m), [batch, 1]), [batch * n])
        inv_counts = xp.reshape(1.0 / xp.counts(flat_rows, batch * m), [batch, m, 1])
        return KVDownsample(xp, None, TokenMerge(xp, flat_rows, inv_counts, batch, n, m), n, m, grid)
    raise ValueError(f"unknown downsample method {method!r}")


def _cells(xp: Backend, like: Any, h: int, w: int, factor: int, frames: int) -> Any:
    """[1, frames*h*w]: each token's cell of the downsampled grid (frame-major, row-major)."""
    hh, ww = -(-h // factor), -(-w // factor)
    return xp.reshape(
        xp.reshape(xp.arange(frames * hh * ww, like, step=hh * ww), [frames, 1, 1])
        + xp.reshape((xp.arange(h, like) // factor) * ww, [1, h, 1])
        + xp.reshape(xp.arange(w, like) // factor, [1, 1, w]),
        [1, frames * h * w],
    )
