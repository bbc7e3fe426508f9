"""Bipartite soft matching over a 2-D token grid, and the merge/unmerge it induces.

A computed merge is one index map: token t of the input goes to row `rows[b, t]` of the merged
sequence. Merging is a scatter-add over that map times the inverse row counts (a mean);
unmerging is one gather. The merged layout is tomesd's: unmerged src tokens in descending
similarity order, then every dst token in grid order.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

from . import rng
from .backend import Backend, get_backend

# tomesd's merge passes `mode` to scatter_reduce; every reduction it accepts is served here.
MERGE_MODES = ("mean", "sum", "amax", "amin", "prod")


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
    dst_tokens = (cell // wsx) * (sy * w) + (cell % wsx) * sx
    if offsets is not None:
        dst_tokens = dst_tokens + (offsets // sx) * w + offsets % sx
    is_dst = xp.scatter_add(xp.zeros([n], like, integer=True), dst_tokens, xp.ones([num_dst], like, integer=True))
    num_src = n - num_dst
    position = xp.where(is_dst > 0, num_src + xp.cumsum(is_dst, 0) - 1, xp.cumsum(1 - is_dst, 0) - 1)
    order = xp.scatter_add(xp.zeros([n], like, integer=True), position, xp.arange(n, like))
    return order[:num_src], order[num_src:], position


def _inverse_permutation(xp: Backend, perm: Any) -> Any:
    """Row-wise inverse of a [B, n] batch of permutations (one pass, no sort)."""
    b, n = xp.shape(perm)
    base = xp.reshape(xp.arange(b, perm) * n, [b, 1])
    flat = xp.reshape(perm + base, [b * n])
    values = xp.reshape(xp.zeros([b, n], perm, integer=True) + xp.reshape(xp.arange(n, perm), [1, n]), [b * n])
    return xp.reshape(xp.scatter_add(xp.zeros([b * n], perm, integer=True), flat, values), [b, n])


class TokenMerge:
    """A computed merge: `merge` maps [B, N, C] to [B, N - r, C], `unmerge` maps back.

    Holds only tensors and ints, so it lives as long as the call (or the recompute) using it.
    """

    def __init__(self, xp: Backend, flat_rows: Any, inv_counts: Any, batch: int, n: int, m: int):
        self._xp = xp
        self._flat_rows = flat_rows  # [B*N] row of the flattened merged tensor for each token
        self._inv_counts = inv_counts  # [B, M, 1] float32, 1 / tokens in each merged row
        self.batch, self.num_tokens, self.num_merged = batch, n, m

    def _check(self, x: Any, expected: int, what: str) -> Tuple[int, int, int]:
        b, n, c = self._xp.shape(x)
        if b != self.batch or n != expected:
            raise ValueError(
                f"{what} expects [{self.batch}, {expected}, C] tokens, got {list(self._xp.shape(x))}"
            )
        return b, n, c

    def merge(self, x: Any, mode: str = "mean") -> Any:
        """Each merged row reduces its tokens (a dst and the src merged into it) with `mode`."""
        xp = self._xp
        if mode not in MERGE_MODES:
            raise ValueError(f"merge mode must be one of {MERGE_MODES}, got {mode!r}")
        b, n, c = self._check(x, self.num_tokens, "merge")
        flat = xp.reshape(x, [b * n, c])
        target = xp.zeros([b * self.num_merged, c], x)
        if mode in ("mean", "sum"):
            out = xp.reshape(xp.scatter_add(target, self._flat_rows, flat), [b, self.num_merged, c])
            return out if mode == "sum" else out * xp.astype_like(self._inv_counts, x)
        return xp.reshape(xp.scatter_reduce(target, self._flat_rows, flat, mode), [b, self.num_merged, c])

    def unmerge(self, x: Any) -> Any:
        xp = self._xp
        b, m, c = self._check(x, self.num_merged, "unmerge")
        return xp.reshape(xp.take(xp.reshape(x, [b * m, c]), self._flat_rows, 0), [b, self.num_tokens, c])


def random_offsets(xp: Backend, like: Any, w: int, h: int, sx: int, sy: int, key: rng.Key) -> Any:
    """The random dst place in each sy-by-sx cell, row-major, drawn from `key` (see tome_core.rng)."""
    return rng.randint(xp, like, (h // sy) * (w // sx), sx * sy, key)


def compute_merge(
    xp: Backend,
    metric: Any,
    w: int,
    h: int,
    sx: int,
    sy: int,
    r: int,
    offsets: Optional[Any] = None,
) -> Optional[TokenMerge]:
    """Match tokens of `metric` [B, N, C] and return the merge, or None when nothing merges.

    `offsets`: the dst place in each cell (`random_offsets`); None puts dst at each cell's top-left.
    """
    b, n, _ = xp.shape(metric)
    if r <= 0:
        return None
    if n != h * w:
        raise ValueError(f"metric has {n} tokens but the grid is {h}x{w} = {h * w}")
    if h // sy == 0 or w // sx == 0:
        return None  # grid smaller than one cell: no dst token exists
    with xp.no_grad():
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
    generator: Optional[Any] = None,
    *,
    seed: Optional[int] = None,
) -> Tuple[Callable, Callable]:
    """tomesd's function: partition tokens into src/dst (one dst per sx-by-sy cell, random or
    top-left) and merge the r most similar src tokens into their dst.

    metric [B, N, C] (torch or paddle), N == h*w. The random dst comes from `generator` when one is
    given (a torch.Generator, drawn from as tomesd does), else from `seed` (default
    tome_core.rng.DEFAULT_SEED): the same arguments give the same merge, and the global RNG is
    never read. Returns (merge, unmerge); merge(x, mode="mean") -> [B, N - r, C], unmerge -> [B, N, C].
    """
    xp = get_backend(metric)
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise TypeError(f"seed must be an int or None, got {type(seed).__name__}")
    offsets = None
    if not no_rand and h // sy > 0 and w // sx > 0:
        if generator is not None:
            offsets = xp.randint_from(generator, sx * sy, (h // sy, w // sx), metric)
        else:
            key = rng.block_key(xp, rng.DEFAULT_SEED if seed is None else seed, 0, 0)
            offsets = random_offsets(xp, metric, w, h, sx, sy, key)
    result = compute_merge(xp, metric, w, h, sx, sy, r, offsets)
    if result is None:
        return do_nothing, do_nothing
    return result.merge, result.unmerge
