"""How a grid's tokens split into src and dst before matching (matching.py): one dst per cell of the grid, at a
place drawn per cell, on a 2-D token grid (grid_partition) or on tokens given by their coordinates on a grid of any
rank (coordinate_partition). The plural forms make every block's partition of a call at once, so a call pays for
its partitions in a few kernels, not a few per block.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional, Sequence, Tuple

from .backend import Backend


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
