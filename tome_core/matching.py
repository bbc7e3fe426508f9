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
) -> Tuple[Any, Any]:
    """Split the h*w tokens into src and dst: one dst per sy-by-sx cell, at `offsets` in the cell.

    `offsets` holds one int in [0, sx*sy) per cell, row-major (None: the top-left token).
    Cells are laid over the top-left (h//sy*sy, w//sx*sx) region; tokens outside it are src, as
    in tomesd. Returns (order, position): `order` holds the src token ids, then the dst ones, each
    ascending; `position[t]` is the place of token t in `order`.
    """
    hsy, wsx = h // sy, w // sx
    n, num_dst = h * w, hsy * wsx
    if offsets is None:
        offsets = xp.zeros([num_dst], like, integer=True)
    # The dst place of each cell, compared with every in-cell place laid out as (dy, dx): a 0/1
    # grid [hsy, sy, wsx, sx] in token order, built by a handful of kernels where per-token index
    # arithmetic would take a dozen.
    places = xp.reshape(xp.arange(sx * sy, like), [1, sy, 1, sx])
    is_dst = xp.equal(xp.reshape(offsets, [hsy, 1, wsx, 1]), places)
    if hsy * sy < h or wsx * sx < w:
        is_dst = xp.to_int64(xp.reshape(is_dst, [hsy * sy, wsx * sx]))
        if hsy * sy < h:
            is_dst = xp.concat([is_dst, xp.zeros([h - hsy * sy, wsx * sx], like, integer=True)], 0)
        if wsx * sx < w:
            is_dst = xp.concat([is_dst, xp.zeros([h, w - wsx * sx], like, integer=True)], 1)
    order = xp.argsort(xp.reshape(is_dst, [n]), 0, False)  # stable: src then dst, each ascending
    position = xp.argsort(order, 0, False)  # the inverse permutation
    return order, position


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


def num_cells(w: int, h: int, sx: int, sy: int) -> int:
    return (h // sy) * (w // sx)


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

    `offsets`: the dst place in each cell (from `rng.randint`); None puts dst at each cell's top-left.
    """
    b, n, _ = xp.shape(metric)
    if r <= 0:
        return None
    if n != h * w:
        raise ValueError(f"metric has {n} tokens but the grid is {h}x{w} = {h * w}")
    if h // sy == 0 or w // sx == 0:
        return None  # grid smaller than one cell: no dst token exists
    with xp.no_grad():
        order, position = grid_partition(xp, metric, w, h, sx, sy, offsets)
        num_dst = num_cells(w, h, sx, sy)
        num_src = n - num_dst
        r = min(r, num_src)

        unit = xp.take(xp.l2_normalize(metric, -1), order, 1)  # src tokens, then dst tokens
        scores = xp.matmul_transposed(unit[:, :num_src], unit[:, num_src:])
        node_max, node_idx = xp.max_with_indices(scores, -1)  # best dst for each src
        edge_order = xp.argsort(node_max, -1, True)  # src positions, most similar first
        rank = xp.argsort(edge_order, -1, False)  # each src's place in that order

        num_unm = num_src - r
        src_rows = xp.where(rank < r, node_idx + num_unm, rank - r)
        dst_rows = xp.broadcast_to(xp.reshape(xp.arange(num_dst, metric) + num_unm, [1, num_dst]), [b, num_dst])
        rows = xp.take(xp.concat([src_rows, dst_rows], 1), position, 1)  # [B, N]

        m = n - r
        flat_rows = xp.reshape(rows + xp.reshape(xp.arange(b * m, metric, step=m), [b, 1]), [b * n])
        inv_counts = xp.reshape(1.0 / xp.counts(flat_rows, b * m), [b, m, 1])
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
            key = rng.call_key(xp, rng.DEFAULT_SEED if seed is None else seed, None)
            offsets = rng.randint(xp, metric, [num_cells(w, h, sx, sy)], sx * sy, key)
    result = compute_merge(xp, metric, w, h, sx, sy, r, offsets)
    if result is None:
        return do_nothing, do_nothing
    return result.merge, result.unmerge
