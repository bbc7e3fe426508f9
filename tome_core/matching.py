"""Bipartite soft matching over a token grid (2-D, or any rank given coordinates): which tokens merge into
which, returned as a TokenMerge (token_merge.py). The merged layout is ToMe for SD's: unmerged src tokens in
descending similarity order, then every dst token in grid order.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, NamedTuple, Optional, Sequence, Tuple

from . import rng
from .backend import Backend, get_backend
from .token_merge import TokenMerge



def do_nothing(x: Any, mode: Optional[str] = None) -> Any:
    return x


def grid_partition(
    xp: Backend, like: Any, w: int, h: int, sx: int, sy: int, offsets: Optional[Any]
) -> Tuple[Any, Any]:
    """Split the h*w tokens into src and dst: one dst per sy-by-sx cell, at `offsets` in the cell.

    `offsets` holds one int in [0, sx*sy) per cell, row-major (None: the top-left token).
    Cells are laid over the top-left (h//sy*sy, w//sx*sx) region; tokens outside it are src, as
    in ToMe for SD. Returns (order, position): `order` holds the src token ids, then the dst ones, each
    ascending; `position[t]` is the place of token t in `order`.
    """
    order, position = grid_partitions(xp, like, w, h, sx, sy, None if offsets is None else xp.reshape(offsets, [1, -1]))
    return order[0], position[0]


def grid_partitions(
    xp: Backend, like: Any, w: int, h: int, sx: int, sy: int, offsets: Optional[Any]
) -> Tuple[Any, Any]:
    """grid_partition for K patterns at once: `offsets` [K, cells] (None: one pattern, the top-left token of each
    cell). Returns (order, position), [K, N] each: row k is grid_partition's for offsets[k]. A call draws every
    block's pattern in one table, so its partitions cost a few launches per call, not per block."""
    hsy, wsx = h // sy, w // sx
    n, num_dst = h * w, hsy * wsx
    if offsets is None:
        offsets = xp.zeros([1, num_dst], like, integer=True)
    k = xp.shape(offsets)[0]
    # The dst place of each cell, compared with every in-cell place laid out as (dy, dx): a 0/1
    # grid [K, hsy, sy, wsx, sx] in token order, built by a handful of kernels where per-token index
    # arithmetic would take a dozen.
    places = xp.reshape(xp.arange(sx * sy, like), [1, 1, sy, 1, sx])
    is_dst = xp.equal(xp.reshape(offsets, [k, hsy, 1, wsx, 1]), places)
    if hsy * sy < h or wsx * sx < w:
        is_dst = xp.to_int64(xp.reshape(is_dst, [k, hsy * sy, wsx * sx]))
        if hsy * sy < h:
            is_dst = xp.concat([is_dst, xp.zeros([k, h - hsy * sy, wsx * sx], like, integer=True)], 1)
        if wsx * sx < w:
            is_dst = xp.concat([is_dst, xp.zeros([k, h, w - wsx * sx], like, integer=True)], 2)
    order = xp.argsort(xp.reshape(is_dst, [k, n]), 1, False)  # stable: src then dst, each ascending
    position = xp.argsort(order, 1, False)  # the inverse permutation
    return order, position


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
        return _match(xp, metric, order, position, num_cells(w, h, sx, sy), r)[0]


def compute_merges(xp: Backend, metric: Any, w: int, h: int, sx: int, sy: int, rs: Sequence[int],
                   offsets: Optional[Any] = None, partition: Optional[Tuple[Any, Any]] = None,
                   memo: Optional[Dict[Any, Any]] = None) -> Optional[Dict[int, TokenMerge]]:
    """compute_merge for several r at once, from one matching: {r: merge} (None when nothing merges).
    Each merge equals compute_merge's for its r. `partition`: (order, position) of this grid and pattern, computed
    beforehand (grid_partitions: a call's every block at once), in place of `offsets`; `memo`: a dict keeping the
    index constants of each shape (Matching) across blocks and calls."""
    b, n, _ = xp.shape(metric)
    if max(rs) <= 0:
        return None
    if n != h * w:
        raise ValueError(f"metric has {n} tokens but the grid is {h}x{w} = {h * w}")
    if h // sy == 0 or w // sx == 0:
        return None
    if xp.grad_enabled():  # the matching records no gradients (hooks mostly run under no_grad already: no context)
        with xp.no_grad():
            return compute_merges(xp, metric, w, h, sx, sy, rs, offsets, partition, memo)
    order, position = partition if partition is not None else grid_partition(xp, metric, w, h, sx, sy, offsets)
    matching = Matching(xp, metric, order, position, (h // sy) * (w // sx), memo, shape=(b, n))
    if len(rs) == 1:
        return {rs[0]: matching.merge(rs[0])}
    return {r: matching.merge(r) for r in sorted(set(rs)) if r > 0}


class Matching:
    """The bipartite matching of a partition (order: src token ids, then dst ones; position: its inverse):
    each src token's best dst and its place in the most-similar-first order. Merging r tokens takes the
    first r edges of that order, so one matching serves every r (per-site ratios share it). `images`: each token's
    image in the partition's order ([N], src then dst; images.py), when the tokens hold several: a src token then
    matches its own image's dst only.

    Six kernels match and six more build a merge's index map; what depends only on the shapes (each sample's
    row offsets, the unmerged and dst rows' numbers) comes from `memo`, a dict the caller keeps across blocks
    and calls (None: built here)."""

    def __init__(self, xp: Backend, metric: Any, order: Any, position: Any, num_dst: int,
                 memo: Optional[Dict[Any, Any]] = None, images: Any = None, shape: Optional[Tuple[int, ...]] = None):
        b, n = (xp.shape(metric) if shape is None else shape)[:2]  # `shape`: the caller's reading of metric's
        self.xp, self.b, self.n, self.num_dst, self.num_src = xp, b, n, num_dst, n - num_dst
        self.order, self.position, self.like, self.memo = order, position, metric, memo
        unit = xp.take(xp.l2_normalize(metric, -1), order, 1)  # src tokens, then dst tokens
        scores = xp.matmul_transposed(unit[:, :self.num_src], unit[:, self.num_src:])
        if images is not None:  # own_image inline: a src token matches its own image's dst only
            num_src = self.num_src
            same = xp.equal(xp.reshape(images[:num_src], [num_src, 1]), xp.reshape(images[num_src:], [1, num_dst]))
            # -inf as a one-element array kept in the memo (a Python float is made into an array at every block)
            key = f"-inf {xp.name} {getattr(scores, 'device', None) or getattr(scores, 'place', None)} {scores.dtype}"
            minus_inf = None if memo is None else memo.get(key)
            scores = xp.where(same, scores, self._minus_infinity(scores, key) if minus_inf is None else minus_inf)
        node_max, self.node_idx = xp.max_with_indices(scores, -1)  # best dst for each src
        self.edge_order = xp.argsort(node_max, -1, True)  # src positions, most similar first

    def _minus_infinity(self, scores: Any, key: str) -> Any:
        """A one-element array of -inf like `scores`, kept in the memo under `key`."""
        value = self.xp.zeros([1], scores) + float("-inf")
        if self.memo is not None:
            self.memo[key] = value
        return value

    def _rows(self, r: int, key: Any) -> Tuple[Any, Any, Any]:
        """For merging r: each sample's first merged row plus the unmerged count [B, 1], the unmerged src tokens'
        rows [B, S - r] and the dst tokens' [B, D], each offset by its sample's first row in the flat merged
        batch; kept in the memo under `key`."""
        xp, b, num_dst = self.xp, self.b, self.num_dst
        m, num_unm = self.n - r, self.num_src - r
        first = xp.reshape(xp.arange(b * m, self.like, step=m), [b, 1])
        rows = (first + num_unm,
                xp.reshape(xp.arange(num_unm, self.like), [1, num_unm]) + first,
                xp.reshape(xp.arange(num_dst, self.like), [1, num_dst]) + (first + num_unm))
        if self.memo is not None:
            self.memo[key] = rows
        return rows

    def merge(self, r: int) -> TokenMerge:
        """The merge of the r most similar src tokens into their dst (r is capped at the src count). Merged rows:
        the unmerged src tokens in similarity order, then every dst token in partition order."""
        xp, b, n = self.xp, self.b, self.n
        r = min(r, self.num_src)
        # A string key: paddle's SOT translator cannot simulate a dict keyed by tuples
        device = getattr(self.like, "device", None) or getattr(self.like, "place", None)
        key = f"rows {xp.name} {device} {b} {n} {self.num_dst} {r}"
        rows = None if self.memo is None else self.memo.get(key)  # kept from an earlier block or call
        first, unmerged, dst = rows if rows is not None else self._rows(r, key)
        # Rows in similarity order: the first r src go to their dst's row, the rest to rows 0..S-r-1 in turn; the
        # inverse of edge_order puts them back in src order, and position in token order.
        merged = xp.take_along(self.node_idx, self.edge_order[:, :r], 1) + first
        src_rows = xp.put_along(xp.concat([merged, unmerged], 1), self.edge_order, 1)
        flat_rows = xp.reshape(xp.take(xp.concat([src_rows, dst], 1), self.position, 1), [b * n])
        return TokenMerge(xp, flat_rows, None, b, n, n - r, rows=flat_rows if b == 1 else None)

    def represented_merge(self, r: int) -> TokenMerge:
        """The merge of r tokens with each sample's representatives ([B, M]): the token each merged row
        stands for, its dst (where its src tokens merged in), or an unmerged src token itself. Rows: the
        unmerged src in similarity order, then the dst in partition order."""
        xp, b, num_src = self.xp, self.b, self.num_src
        merge = self.merge(r)
        kept = num_src - min(r, num_src)
        # One gather along each sample's row of src ids (a broadcast, no copy): taking from the flat order would
        # first copy the edge order's non-contiguous tail.
        src_ids = xp.broadcast_to(xp.reshape(self.order[:num_src], [1, num_src]), [b, num_src])
        unmerged = xp.take_along(src_ids, self.edge_order[:, num_src - kept:], 1)
        dst = xp.broadcast_to(xp.reshape(self.order[num_src:], [1, self.num_dst]), [b, self.num_dst])
        merge.representatives = xp.concat([unmerged, dst], 1)
        return merge

    def shared_merge(self, r: int, batch: int) -> TokenMerge:
        """For a matching computed on one summed metric (compute_shared_merge): the merge of r tokens, with
        each merged row's representative token ([M]), applied to every sample of a batch of `batch`."""
        merge = self.represented_merge(r)
        merge.representatives = merge.representatives[0]
        return merge.for_batch(batch)


def _match(xp: Backend, metric: Any, order: Any, position: Any, num_dst: int, r: int) -> Tuple[TokenMerge, Any]:
    """The merge of r tokens of a partition's matching, and edge_order (src positions, most similar first)."""
    matching = Matching(xp, metric, order, position, num_dst)
    return matching.merge(r), matching.edge_order


def coordinate_partition(xp: Backend, coords: Sequence[Any], strides: Sequence[int],
                         offsets: Optional[Any], band: Optional[Tuple[int, int]] = None) -> Tuple[Any, Any, int]:
    """Split tokens given by their grid coordinates into src and dst, on a grid of any rank, with no
    host read and shapes fixed by N alone.

    `coords`: one [N] int tensor per axis, outermost first ((rows, cols) for an image, as Flux's img_ids
    give them; (frames, rows, cols) for a video), tokens in any order; `strides`: the cell's extent on
    each axis ((sy, sx); (st, sy, sx)). One dst per complete cell, at `offsets[cell]` in it (cells and
    in-cell places numbered row-major; None: the cell's first token), as grid_partition does in 2-D.
    Every grid of N tokens whose sides divide by their strides has N // prod(strides) complete cells; for
    other grids the dst count must still be N // prod(strides), so it is filled with the src tokens that
    come last in token order (tokens outside complete cells first). Returns (order, position, num_dst) as
    grid_partition's, plus the dst count.

    `band`: (start, stop), the partition of tokens [start, stop) alone, cut from the whole grid's (bands.py):
    cells and dst places are the whole grid's, token ids in `order` count from `start`.
    """
    cells = coordinate_cells(xp, coords, strides)
    order, position, num_dst = coordinate_partitions(
        xp, cells, None if offsets is None else xp.reshape(offsets, [1, -1]), band)
    return order[0], position[0], num_dst


class Cells(NamedTuple):
    """Each token's cell on a coordinate grid (coordinate_cells): what a call's partitions share."""

    cell: Any  # [N] the token's cell, row-major over the complete cells
    place: Any  # [N] its place in the cell, row-major
    in_cell: Any  # [N] 1 where the token lies in a complete cell, else 0
    num_dst: int  # N // the cell's volume
    volume: int  # the tokens a cell spans (the strides' product)


def coordinate_cells(xp: Backend, coords: Sequence[Any], strides: Sequence[int]) -> Cells:
    """Each token's cell and place in it, for coordinate_partitions (see coordinate_partition): depends on the
    coordinates alone, so a call computes it once for all its blocks."""
    if len(coords) != len(strides) or not coords:
        raise ValueError(f"one stride per coordinate axis: got {len(coords)} axes and strides {tuple(strides)}")
    n = xp.shape(coords[0])[0]
    volume = 1
    for stride in strides:
        volume *= stride
    cell = place = in_cell = None
    for axis, stride in zip(coords, strides):
        axis = axis + xp.max_with_indices(-axis, 0)[0]  # from 0, wherever the ids start
        cells = (xp.max_with_indices(axis, 0)[0] + 1) // stride  # complete cells along this axis
        inside_axis = xp.to_int64(axis < cells * stride)
        in_cell = inside_axis if in_cell is None else in_cell * inside_axis
        cell = axis // stride if cell is None else cell * cells + axis // stride
        place = axis % stride if place is None else place * stride + axis % stride
    return Cells(cell, place, in_cell, n // volume, volume)


def coordinate_partitions(xp: Backend, cells: Cells, offsets: Optional[Any], band: Optional[Tuple[int, int]] = None
                          ) -> Tuple[Any, Any, int]:
    """coordinate_partition for K patterns at once: `offsets` [K, cells] (None: one pattern, each cell's first
    token). Returns (order, position) [K, n] (n: the band's tokens, or all) and the dst count."""
    n, num_dst = xp.shape(cells.cell)[0], cells.num_dst
    if offsets is None:
        is_dst = xp.reshape(cells.in_cell * xp.to_int64(xp.equal(cells.place, cells.place * 0)), [1, n])
    else:  # cells beyond the table (ids that do not fill a box) read cell 0 rather than out of range
        inside = xp.to_int64(cells.cell < num_dst) * cells.in_cell
        wanted = xp.take(offsets, xp.where(inside > 0, cells.cell, cells.cell * 0), 1)  # [K, N]
        is_dst = cells.in_cell * xp.to_int64(xp.equal(cells.place, wanted))
    if band is not None:
        is_dst = is_dst[:, band[0]:band[1]]
        num_dst = (band[1] - band[0]) // cells.volume
    order = xp.argsort(is_dst, 1, False)  # stable: src then dst, each in token order
    position = xp.argsort(order, 1, False)
    return order, position, num_dst


def compute_shared_merge(xp: Backend, metric: Any, coords: Sequence[Any], strides: Sequence[int], r: int,
                         offsets: Optional[Any] = None) -> Optional[TokenMerge]:
    """One matching for the whole batch of `metric` [B, N, C], on tokens at grid coordinates `coords`
    with cells of `strides` (see coordinate_partition), for hosts whose per-token tables have no batch
    axis (Flux's and Wan's rotary positions).

    The batch's samples score alike: similarity is taken between tokens' unit metrics averaged over
    the batch. Each merged row has a representative token (`representatives`, [N - r]): the dst token
    a row's src tokens merged into, or the unmerged token itself; per-token tables follow their
    tokens by taking the representative's row (TokenMerge.gather_rows).
    """
    if r <= 0:
        return None
    merges = compute_shared_merges(xp, metric, coords, strides, [r], offsets)
    return None if merges is None else merges[r]


def compute_shared_merges(xp: Backend, metric: Any, coords: Sequence[Any], strides: Sequence[int], rs: Sequence[int],
                          offsets: Optional[Any] = None, band: Optional[Tuple[int, int]] = None,
                          ) -> Optional[Dict[int, TokenMerge]]:
    """compute_shared_merge for several r at once, from one matching: {r: merge} (None when nothing merges).
    `band`: `metric` holds tokens [start, stop) of the grid `coords` describe (coordinate_partition)."""
    return compute_coordinate_merges(xp, metric, coords, strides, rs, offsets, band, per_sample=False)


def compute_coordinate_merges(xp: Backend, metric: Any, coords: Sequence[Any], strides: Sequence[int],
                              rs: Sequence[int], offsets: Optional[Any] = None, band: Optional[Tuple[int, int]] = None,
                              per_sample: bool = True, partition: Optional[Tuple[Any, Any, int]] = None,
                              memo: Optional[Dict[Any, Any]] = None, images: Any = None) -> Optional[Dict[int, TokenMerge]]:
    """{r: merge} of `metric` [B, N, C] on tokens at grid coordinates `coords` with cells of `strides`
    (coordinate_partition), from one matching (None when nothing merges); each merge has representatives.

    `per_sample`: each sample matched on its own, as compute_merges does on a grid (representatives [B, M]:
    per-token tables gain a batch axis); else one matching for the batch (compute_shared_merge: representatives
    [M], for tables that cannot take a batch axis). `band`: `metric` holds tokens [start, stop) of the grid.
    `partition`: (order, position, num_dst) computed beforehand (coordinate_partitions), in place of `offsets`;
    `memo`: as compute_merges'. `images`: [n] each of `metric`'s tokens' image, when they hold several (images.py:
    none merges into another's); in the partition's order where `partition` is given."""
    b, n, c = xp.shape(metric)
    volume = 1
    for stride in strides:
        volume *= stride
    if max(rs) <= 0 or n // volume == 0:
        return None
    if xp.grad_enabled():  # the matching records no gradients
        with xp.no_grad():
            return compute_coordinate_merges(xp, metric, coords, strides, rs, offsets, band, per_sample, partition,
                                             memo, images)
    if partition is None:
        partition = coordinate_partition(xp, coords, strides, offsets, band=band)
        if images is not None:  # each token's image in the partition's order
            images = xp.take(images, partition[0], 0)
    order, position, num_dst = partition
    if per_sample or b == 1:  # a batch of one is matched on its own metric either way
        matching = Matching(xp, metric, order, position, num_dst, memo, images, shape=(b, n))
        if len(rs) == 1:  # one r (no per-site ratios): no comprehension, a Python call of its own
            merges = {rs[0]: matching.represented_merge(rs[0])}
        else:
            merges = {r: matching.represented_merge(r) for r in sorted(set(rs)) if r > 0}
        if not per_sample:
            for merge in merges.values():
                merge.representatives = merge.representatives[0]
        return merges
    # The sum over the batch of each token's unit metric (its direction is the mean's): one scatter-add.
    token_of = xp.arange(b * n, metric) % n
    summed = xp.scatter_add(xp.zeros([n, c], metric), token_of, xp.reshape(xp.l2_normalize(metric, -1), [b * n, c]))
    matching = Matching(xp, xp.reshape(summed, [1, n, c]), order, position, num_dst, memo, images)
    return {r: matching.shared_merge(r, b) for r in sorted(set(rs)) if r > 0}


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
    """ToMe for SD's function: partition tokens into src/dst (one dst per sx-by-sy cell, random or
    top-left) and merge the r most similar src tokens into their dst.

    metric [B, N, C] (a tensor of a framework with a registered backend), N == h*w. The random dst
    comes from `generator` when one is given (a torch.Generator, drawn from as ToMe for SD does; a
    backend may take its own framework's generator), else from `seed` (default
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
