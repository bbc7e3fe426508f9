"""Bipartite soft matching over a 2-D token grid, and the merge/unmerge it induces.

A computed merge is one index map: token t of the input goes to row `rows[b, t]` of the merged
sequence. Merging is a scatter-add over that map times the inverse row counts (a mean);
unmerging is one gather. The merged layout is tomesd's: unmerged src tokens in descending
similarity order, then every dst token in grid order.
"""
from __future__ import annotations

import itertools
from typing import Any, Callable, Dict, Optional, Tuple

from . import rng
from .backend import Backend, get_backend

_draw_counter = itertools.count()  # for direct calls that bring no counter of their own
_GRID_CACHE: Dict[tuple, Tuple[Any, Any, Any]] = {}
_GRID_CACHE_SIZE = 32


def do_nothing(x: Any, mode: Optional[str] = None) -> Any:
    return x


def grid_partition(
    xp: Backend, like: Any, w: int, h: int, sx: int, sy: int, offsets: Optional[Any]
) -> Tuple[Any, Any, Any]:
    """Split the h*w tokens into src and dst: one dst per sy-by-sx cell, at `offsets` in the cell.

    `offsets` holds one int in [0, sx*sy) per cell, row-major (None: the top-left token).
    Cells are laid over the top-left (h//sy*sy, w//sx*sx) region; tokens outside it are src, as
    in tomesd. Returns (src_idx, dst_idx, position) with src and dst token ids in ascending order
    and `position[t]` the place of token t in concat(src_idx, dst_idx).
    """
    hsy, wsx = h // sy, w // sx
    n, num_dst = h * w, hsy * wsx
    cell = xp.arange(num_dst, like)
    if offsets is None:
        offsets = xp.zeros([num_dst], like, integer=True)
    dy, dx = offsets // sx, offsets % sx
    dst_tokens = ((cell // wsx) * sy + dy) * w + (cell % wsx) * sx + dx
    is_dst = xp.scatter_add(xp.zeros([n], like, integer=True), dst_tokens, xp.ones([num_dst], like, integer=True))
    num_src = n - num_dst
    position = xp.where(is_dst > 0, num_src + xp.cumsum(is_dst, 0) - 1, xp.cumsum(1 - is_dst, 0) - 1)
    order = xp.scatter_add(xp.zeros([n], like, integer=True), position, xp.arange(n, like))
    return order[:num_src], order[num_src:], position


def _cached_grid(xp: Backend, like: Any, w: int, h: int, sx: int, sy: int) -> Tuple[Any, Any, Any]:
    key = (xp.name, xp.device_key(like), w, h, sx, sy)
    grid = _GRID_CACHE.get(key)
    if grid is None:
        if len(_GRID_CACHE) >= _GRID_CACHE_SIZE:
            _GRID_CACHE.pop(next(iter(_GRID_CACHE)))
        grid = _GRID_CACHE[key] = grid_partition(xp, like, w, h, sx, sy, None)
    return grid


def _inverse_permutation(xp: Backend, perm: Any) -> Any:
    """Row-wise inverse of a [B, n] batch of permutations (one pass, no sort)."""
    b, n = xp.shape(perm)
    base = xp.reshape(xp.arange(b, perm) * n, [b, 1])
    flat = xp.reshape(perm + base, [b * n])
    values = xp.reshape(xp.zeros([b, n], perm, integer=True) + xp.reshape(xp.arange(n, perm), [1, n]), [b * n])
    return xp.reshape(xp.scatter_add(xp.zeros([b * n], perm, integer=True), flat, values), [b, n])


class TokenMerge:
    """A computed merge: `merge` maps [B, N, C] to [B, N - r, C], `unmerge` maps back."""

    def __init__(self, xp: Backend, flat_rows: Any, inv_counts: Any, batch: int, n: int, m: int):
        self._xp = xp
        self._flat_rows = flat_rows  # [B*N] row of the flattened merged tensor for each token
        self._inv_counts = inv_counts  # [B, M, 1] float32, 1 / tokens in each merged row
        self._inv_cache: Dict[Any, Any] = {}
        self.batch, self.num_tokens, self.num_merged = batch, n, m

    def _check(self, x: Any, expected: int, what: str) -> Tuple[int, int, int]:
        b, n, c = self._xp.shape(x)
        if b != self.batch or n != expected:
            raise ValueError(
                f"{what} expects [{self.batch}, {expected}, C] tokens, got {list(self._xp.shape(x))}"
            )
        return b, n, c

    def merge(self, x: Any, mode: str = "mean") -> Any:
        xp = self._xp
        b, n, c = self._check(x, self.num_tokens, "merge")
        if mode not in ("mean", "sum"):
            raise ValueError(f"merge mode must be 'mean' or 'sum', got {mode!r}")
        summed = xp.scatter_add(
            xp.zeros([b * self.num_merged, c], x), self._flat_rows, xp.reshape(x, [b * n, c])
        )
        summed = xp.reshape(summed, [b, self.num_merged, c])
        if mode == "sum":
            return summed
        dtype_key = str(getattr(x, "dtype", None))
        inv = self._inv_cache.get(dtype_key)
        if inv is None:
            inv = self._inv_cache[dtype_key] = xp.astype_like(self._inv_counts, x)
        return summed * inv

    def unmerge(self, x: Any) -> Any:
        xp = self._xp
        b, m, c = self._check(x, self.num_merged, "unmerge")
        return xp.reshape(xp.take(xp.reshape(x, [b * m, c]), self._flat_rows, 0), [b, self.num_tokens, c])


def compute_merge(
    xp: Backend,
    metric: Any,
    w: int,
    h: int,
    sx: int,
    sy: int,
    r: int,
    no_rand: bool,
    seed: int,
    counter: int,
) -> Optional[TokenMerge]:
    """Match tokens of `metric` [B, N, C] and return the merge, or None when nothing merges."""
    b, n, _ = xp.shape(metric)
    if r <= 0:
        return None
    if n != h * w:
        raise ValueError(f"metric has {n} tokens but the grid is {h}x{w} = {h * w}")
    if h // sy == 0 or w // sx == 0:
        return None  # grid smaller than one cell: no dst token exists
    with xp.no_grad():
        if no_rand:
            src_idx, dst_idx, position = _cached_grid(xp, metric, w, h, sx, sy)
        else:
            num_cells = (h // sy) * (w // sx)
            offsets = rng.randint(xp, metric, num_cells, sx * sy, seed, counter)
            src_idx, dst_idx, position = grid_partition(xp, metric, w, h, sx, sy, offsets)
        num_dst = xp.shape(dst_idx)[0]
        num_src = n - num_dst
        r = min(r, num_src)

        unit = xp.l2_normalize(metric, -1)
        scores = xp.matmul_transposed(xp.take(unit, src_idx, 1), xp.take(unit, dst_idx, 1))
        node_max, node_idx = xp.max_with_indices(scores, -1)  # best dst for each src
        edge_order = xp.argsort(node_max, -1, True)  # src positions, most similar first
        rank = _inverse_permutation(xp, edge_order)

        num_unm = num_src - r
        src_rows = xp.where(rank < r, node_idx + num_unm, rank - r)
        dst_rows = xp.zeros([b, num_dst], metric, integer=True) + xp.reshape(xp.arange(num_dst, metric) + num_unm, [1, num_dst])
        rows = xp.take(xp.concat([src_rows, dst_rows], 1), position, 1)  # [B, N]

        m = n - r
        flat_rows = xp.reshape(rows + xp.reshape(xp.arange(b, metric) * m, [b, 1]), [b * n])
        counts = xp.scatter_add(xp.zeros([b * m], metric, integer=True), flat_rows, xp.ones([b * n], metric, integer=True))
        inv_counts = xp.reshape(1.0 / xp.to_float32(counts), [b, m, 1])
    return TokenMerge(xp, flat_rows, inv_counts, b, n, m)


def bipartite_soft_matching_random2d(
    metric: Any,
    w: int,
    h: int,
    sx: int,
    sy: int,
    r: int,
    no_rand: bool = False,
    seed: Optional[int] = None,
    *,
    counter: Optional[int] = None,
) -> Tuple[Callable, Callable]:
    """tomesd's function: partition tokens into src/dst (one dst per sx-by-sy cell, random or
    top-left) and merge the r most similar src tokens into their dst.

    metric [B, N, C] (torch or paddle), N == h*w. Randomness comes from (seed, counter); without
    a seed one is derived from the framework's global RNG state, which is read, never advanced.
    Returns (merge, unmerge); merge(x, mode="mean") -> [B, N - r, C], unmerge -> [B, N, C].
    """
    xp = get_backend(metric)
    if not no_rand:
        seed = xp.global_seed() if seed is None else seed
        counter = next(_draw_counter) if counter is None else counter
    result = compute_merge(xp, metric, w, h, sx, sy, r, no_rand, seed or 0, counter or 0)
    if result is None:
        return do_nothing, do_nothing
    return result.merge, result.unmerge
