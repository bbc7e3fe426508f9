"""Bipartite soft matching over a token grid (2-D, or any rank given coordinates): which tokens merge into
which, returned as a TokenMerge (token_merge.py), from a partition of the grid into src and dst (partitions.py).
The merged layout is ToMe for SD's: unmerged src tokens in descending similarity order, then every dst token in
grid order.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Sequence, Tuple

from . import rng
from .backend import Backend, get_backend
from .images import own_image
from .partitions import coordinate_partition, grid_partition, num_cells
from .token_merge import TokenMerge


def do_nothing(x: Any, mode: Optional[str] = None) -> Any:
    return x


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
        if images is not None:  # a src token matches its own image's dst only
            # -inf as a one-element array kept in the memo (a Python float is made into an array at every block)
            key = f"-inf {xp.name} {getattr(scores, 'device', None) or getattr(scores, 'place', None)} {scores.dtype}"
            minus_inf = None if memo is None else memo.get(key)
            scores = own_image(xp, scores, images, self.num_src,
                               self._minus_infinity(scores, key) if minus_inf is None else minus_inf)
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
        return TokenMerge(xp, flat_rows, None, b, n, n - r, rows=flat_rows if b == 1 else None, memo=self.memo)

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
