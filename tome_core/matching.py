"""Bipartite soft matching over a token grid (2-D, or any rank given coordinates), and the merge/unmerge it induces.

A computed merge is one index map: token t of the input goes to row `rows[b, t]` of the merged
sequence. Merging is a scatter-add over that map times the inverse row counts (a mean);
unmerging is one gather. The merged layout is ToMe for SD's: unmerged src tokens in descending
similarity order, then every dst token in grid order.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Sequence, Tuple

from . import rng
from .backend import Backend, get_backend

# ToMe for SD's merge passes `mode` to scatter_reduce; every reduction it accepts is served here.
MERGE_MODES = ("mean", "sum", "amax", "amin", "prod")


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

    def __init__(self, xp: Backend, flat_rows: Any, inv_counts: Any, batch: int, n: int, m: int,
                 rows: Any = None, representatives: Any = None):
        self._xp = xp
        self._flat_rows = flat_rows  # [B*N] row of the flattened merged tensor for each token
        self._inv_counts = inv_counts  # [B, M, 1] float32, 1 / tokens in each merged row
        self.batch, self.num_tokens, self.num_merged = batch, n, m
        self._rows = rows  # [N] merged row of each token, when one map serves the whole batch
        # For each merged row, the token that stands for it (see compute_coordinate_merges): [M] when one map
        # serves the batch, [B, M] when each sample has its own.
        self.representatives = representatives

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

    # A sequence [B, S, C] whose last N tokens are the image (text in front, as in Flux's single blocks):
    # the image segment merges and unmerges, the tokens in front pass as they are.
    def merge_tail(self, x: Any) -> Any:
        s = self._xp.shape(x)[1]
        if s == self.num_tokens:
            return self.merge(x)
        return self._xp.concat([x[:, : s - self.num_tokens], self.merge(x[:, s - self.num_tokens:])], 1)

    def unmerge_tail(self, x: Any) -> Any:
        s = self._xp.shape(x)[1]
        if s == self.num_merged:
            return self.unmerge(x)
        return self._xp.concat([x[:, : s - self.num_merged], self.unmerge(x[:, s - self.num_merged:])], 1)

    def gather_rows(self, table: Any, axis: int = 0) -> Any:
        """Rows of a per-token table (rotary positions) along `axis`, whose last N rows are the image's and
        any rows before them the text's (Flux: [text + image, D]; Wan: [1, image, 1, D] with axis=1; ComfyUI's
        Flux: [B, 1, text + image, ...] with axis=2): text rows stay, the image rows become one row per merged
        token, its representative's. One index, one gather.

        With a representative per sample ([B, M]) the rows differ by sample: a table with axes before `axis`
        (its first of size 1 or B, any others of size 1) gives [B, ..., S', ...]; a table whose rows come
        first ([S, D]) gains a batch axis in front, [B, S', D]."""
        xp = self._xp
        s = xp.shape(table)[axis]
        if s < self.num_tokens:
            raise ValueError(f"a table with rows along axis {axis} must hold the image's {self.num_tokens} rows "
                             f"(after any text rows), got {s}")
        head = s - self.num_tokens
        if len(xp.shape(self.representatives)) == 1:
            if head == 0:
                return xp.take(table, self.representatives, axis)
            rows = xp.concat([xp.arange(head, self.representatives), self.representatives + head], 0)
            return xp.take(table, rows, axis)
        return self._gather_sample_rows(table, axis, head)

    def _gather_sample_rows(self, table: Any, axis: int, head: int) -> Any:
        xp, b = self._xp, self.batch
        shape = list(xp.shape(table))
        s, rest = shape[axis], shape[axis + 1:]
        rows = self.representatives + head  # [B, M]
        if head:
            text = xp.broadcast_to(xp.reshape(xp.arange(head, rows), [1, head]), [b, head])
            rows = xp.concat([text, rows], 1)
        kept = xp.shape(rows)[1]
        if axis == 0:
            return xp.reshape(xp.take(table, xp.reshape(rows, [b * kept]), 0), [b, kept] + rest)
        lead = shape[:axis]
        if lead[0] not in (1, b) or any(size != 1 for size in lead[1:]):
            raise ValueError(f"per-sample rows need a table [B or 1, 1.., S, ...] with rows along axis {axis}, got "
                             f"{shape} for a batch of {b}")
        flat = xp.reshape(xp.broadcast_to(table, [b] + lead[1:] + shape[axis:]), [b * s] + rest)
        rows = rows + xp.reshape(xp.arange(b * s, rows, step=s), [b, 1])  # sample k's rows start at k * s
        return xp.reshape(xp.take(flat, xp.reshape(rows, [b * kept]), 0), [b] + lead[1:] + [kept] + rest)

    @property
    def inv_counts(self) -> Any:
        """[B, M, 1]: 1 / the tokens in each merged row."""
        return self._inv_counts

    @property
    def shared(self) -> bool:
        """Whether one map serves every sample of the batch."""
        return self._rows is not None

    def sample_rows(self) -> Any:
        """[B, N]: the merged row of each token within its own sample's M rows."""
        xp, b, m = self._xp, self.batch, self.num_merged
        return xp.reshape(self._flat_rows, [b, self.num_tokens]) - xp.reshape(xp.arange(b * m, self._flat_rows, step=m), [b, 1])

    def with_passing_tail(self, tail: int) -> "TokenMerge":
        """This merge over N tokens followed by `tail` tokens that pass whole, each its own merged row after
        the M rows: a reference image's tokens joined after the target's (Flux Kontext) never merge with them.
        The same index map, extended: merge, unmerge and rotary rows need nothing else."""
        if tail <= 0:
            return self
        xp, b, n, m = self._xp, self.batch, self.num_tokens, self.num_merged
        n2, m2 = n + tail, m + tail
        own = xp.arange(tail, self._flat_rows) + m  # the tail's rows within a sample
        rows = xp.concat([self.sample_rows(), xp.broadcast_to(xp.reshape(own, [1, tail]), [b, tail])], 1)
        flat_rows = xp.reshape(rows + xp.reshape(xp.arange(b * m2, rows, step=m2), [b, 1]), [b * n2])
        ones = xp.zeros([b, tail, 1], self._inv_counts) + 1
        inv_counts = xp.concat([xp.broadcast_to(self._inv_counts, [b, m, 1]), ones], 1)
        shared = None if self._rows is None else xp.concat([self._rows, own], 0)
        reps, tail_reps = self.representatives, xp.arange(tail, self._flat_rows) + n
        if reps is not None and len(xp.shape(reps)) == 2:
            reps = xp.concat([reps, xp.broadcast_to(xp.reshape(tail_reps, [1, tail]), [b, tail])], 1)
        elif reps is not None:
            reps = xp.concat([reps, tail_reps], 0)
        return TokenMerge(xp, flat_rows, inv_counts, b, n2, m2, shared, reps)

    def for_batch(self, batch: int) -> "TokenMerge":
        """This merge (computed for one map) applied to every sample of a batch of `batch`."""
        xp, n, m = self._xp, self.num_tokens, self.num_merged
        if self._rows is None:
            raise ValueError("only a merge computed for the whole batch (compute_shared_merge) can be broadcast")
        offsets = xp.reshape(xp.arange(batch * m, self._rows, step=m), [batch, 1])
        flat_rows = xp.reshape(xp.reshape(self._rows, [1, n]) + offsets, [batch * n])
        inv_counts = xp.broadcast_to(self._inv_counts, [batch, m, 1])
        return TokenMerge(xp, flat_rows, inv_counts, batch, n, m, self._rows, self.representatives)


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
                   offsets: Optional[Any] = None) -> Optional[Dict[int, TokenMerge]]:
    """compute_merge for several r at once, from one matching: {r: merge} (None when nothing merges).
    Each merge equals compute_merge's for its r."""
    b, n, _ = xp.shape(metric)
    if max(rs) <= 0:
        return None
    if n != h * w:
        raise ValueError(f"metric has {n} tokens but the grid is {h}x{w} = {h * w}")
    if h // sy == 0 or w // sx == 0:
        return None
    with xp.no_grad():
        order, position = grid_partition(xp, metric, w, h, sx, sy, offsets)
        matching = Matching(xp, metric, order, position, num_cells(w, h, sx, sy))
        return {r: matching.merge(r) for r in sorted(set(rs)) if r > 0}


class Matching:
    """The bipartite matching of a partition (order: src token ids, then dst ones; position: its inverse):
    each src token's best dst and its place in the most-similar-first order. Merging r tokens takes the
    first r edges of that order, so one matching serves every r (per-site ratios share it)."""

    def __init__(self, xp: Backend, metric: Any, order: Any, position: Any, num_dst: int):
        b, n, _ = xp.shape(metric)
        self.xp, self.b, self.n, self.num_dst, self.num_src = xp, b, n, num_dst, n - num_dst
        self.order, self.position, self.like = order, position, metric
        unit = xp.take(xp.l2_normalize(metric, -1), order, 1)  # src tokens, then dst tokens
        scores = xp.matmul_transposed(unit[:, :self.num_src], unit[:, self.num_src:])
        node_max, self.node_idx = xp.max_with_indices(scores, -1)  # best dst for each src
        self.edge_order = xp.argsort(node_max, -1, True)  # src positions, most similar first
        self.rank = xp.argsort(self.edge_order, -1, False)  # each src's place in that order

    def merge(self, r: int) -> TokenMerge:
        """The merge of the r most similar src tokens into their dst (r is capped at the src count)."""
        xp, b, n, num_dst = self.xp, self.b, self.n, self.num_dst
        r = min(r, self.num_src)
        num_unm = self.num_src - r
        src_rows = xp.where(self.rank < r, self.node_idx + num_unm, self.rank - r)
        dst_rows = xp.broadcast_to(xp.reshape(xp.arange(num_dst, self.like) + num_unm, [1, num_dst]), [b, num_dst])
        rows = xp.take(xp.concat([src_rows, dst_rows], 1), self.position, 1)  # [B, N]
        m = n - r
        flat_rows = xp.reshape(rows + xp.reshape(xp.arange(b * m, self.like, step=m), [b, 1]), [b * n])
        inv_counts = xp.reshape(1.0 / xp.counts(flat_rows, b * m), [b, m, 1])
        return TokenMerge(xp, flat_rows, inv_counts, b, n, m, rows=flat_rows if b == 1 else None)

    def represented_merge(self, r: int) -> TokenMerge:
        """The merge of r tokens with each sample's representatives ([B, M]): the token each merged row
        stands for, its dst (where its src tokens merged in), or an unmerged src token itself. Rows: the
        unmerged src in similarity order, then the dst in partition order."""
        xp, b, num_src = self.xp, self.b, self.num_src
        merge = self.merge(r)
        kept = num_src - min(r, num_src)
        unmerged = xp.reshape(xp.take(self.order, xp.reshape(self.edge_order[:, num_src - kept:], [b * kept]), 0),
                              [b, kept])
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
    if len(coords) != len(strides) or not coords:
        raise ValueError(f"one stride per coordinate axis: got {len(coords)} axes and strides {tuple(strides)}")
    n = xp.shape(coords[0])[0]
    volume = 1
    for stride in strides:
        volume *= stride
    num_dst = n // volume
    cell = place = in_cell = None
    for axis, stride in zip(coords, strides):
        axis = axis + xp.max_with_indices(-axis, 0)[0]  # from 0, wherever the ids start
        cells = (xp.max_with_indices(axis, 0)[0] + 1) // stride  # complete cells along this axis
        inside_axis = xp.to_int64(axis < cells * stride)
        in_cell = inside_axis if in_cell is None else in_cell * inside_axis
        cell = axis // stride if cell is None else cell * cells + axis // stride
        place = axis % stride if place is None else place * stride + axis % stride
    if offsets is None:
        wanted = xp.zeros([n], coords[0], integer=True)
    else:  # cells beyond the table (ids that do not fill a box) read cell 0 rather than out of range
        inside = xp.to_int64(cell < num_dst) * in_cell
        wanted = xp.take(offsets, xp.where(inside > 0, cell, xp.zeros([n], coords[0], integer=True)), 0)
    is_dst = in_cell * xp.to_int64(xp.equal(place, wanted))
    if band is not None:
        is_dst = is_dst[band[0]:band[1]]
        num_dst = (band[1] - band[0]) // volume
    order = xp.argsort(is_dst, 0, False)  # stable: src then dst, each in token order
    position = xp.argsort(order, 0, False)
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
                              per_sample: bool = True) -> Optional[Dict[int, TokenMerge]]:
    """{r: merge} of `metric` [B, N, C] on tokens at grid coordinates `coords` with cells of `strides`
    (coordinate_partition), from one matching (None when nothing merges); each merge has representatives.

    `per_sample`: each sample matched on its own, as compute_merges does on a grid (representatives [B, M]:
    per-token tables gain a batch axis); else one matching for the batch (compute_shared_merge: representatives
    [M], for tables that cannot take a batch axis). `band`: `metric` holds tokens [start, stop) of the grid."""
    b, n, c = xp.shape(metric)
    volume = 1
    for stride in strides:
        volume *= stride
    if max(rs) <= 0 or n // volume == 0:
        return None
    with xp.no_grad():
        order, position, num_dst = coordinate_partition(xp, coords, strides, offsets, band=band)
        if per_sample or b == 1:  # a batch of one is matched on its own metric either way
            matching = Matching(xp, metric, order, position, num_dst)
            merges = {r: matching.represented_merge(r) for r in sorted(set(rs)) if r > 0}
            if not per_sample:
                for merge in merges.values():
                    merge.representatives = merge.representatives[0]
            return merges
        # The sum over the batch of each token's unit metric (its direction is the mean's): one scatter-add.
        token_of = xp.arange(b * n, coords[0]) % n
        summed = xp.scatter_add(xp.zeros([n, c], metric), token_of, xp.reshape(xp.l2_normalize(metric, -1), [b * n, c]))
        matching = Matching(xp, xp.reshape(summed, [1, n, c]), order, position, num_dst)
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
