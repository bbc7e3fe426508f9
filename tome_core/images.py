"""Several images in one token sequence, told apart on the device: a target image's tokens and reference images'
after them (Flux Kontext, Flux.2 and others mark each image by the first axis of their position ids). Merging keeps
the images apart in two ways, with no host read and shapes fixed by the token count alone:

- cells (`image_cells`): each cell of the dst partition is a complete sy-by-sx block of one image's own tokens, so
  no cell spans two images, an image whose grid differs in size from another's or has odd sides keeps every
  complete cell of its own, and an image's partial cells hold no dst;
- matching (`own_image`): a src token's best dst is searched among its own image's dst only. Cells alone would not
  do it: the bipartite matching weighs every src against every dst.

Together: every image that holds at least one complete cell has dst tokens of its own (there are never more dst
candidates than the N // (sy * sx) dst places, as each complete cell holds sy * sx tokens: the partition fills its
dst count with src tokens and never turns a cell's dst into a src), and every src that merges merges into a dst of
its own image. An image smaller than one cell (fewer than sy of its rows or sx of its columns) has no dst of its
own: its tokens are matched last, after every token that has one, so they merge (into another image's dst) only at
a ratio that merges every other src token too. Under the band rule (bands.py) the cells are the whole sequence's,
cut by the band boundaries as on one image: a band can hold more dst candidates than its dst places (cut cells whose
dst it holds) and turn its first ones into src, and a band's piece of an image can hold none of its dsts (a sliver
at the band's edge); such a piece is, in that band, an image with no dst of its own.
"""
from __future__ import annotations

from typing import Any, Tuple

from .backend import Backend


def _from_zero(xp: Backend, axis: Any) -> Any:
    return axis + xp.max_with_indices(-axis, 0)[0]


def image_cells(xp: Backend, images: Any, rows: Any, cols: Any, sy: int, sx: int) -> Tuple[Any, Any]:
    """Coordinates on which coordinate_partition (partitions.py) with strides (sy, sx) makes each image's complete
    sy-by-sx blocks its cells, and no other: ([N] rows, [N] cols), int64.

    `images`, `rows`, `cols`: each token's image (any int, equal for one image's tokens), row and column ([N]
    each, tokens in any order, one image's tokens at distinct (row, col)). Blocks are aligned to the smallest row
    and column over all tokens, as coordinate_partition aligns them.

    The returned coordinates lay each complete cell out as its own sy-by-sx block in a column one cell wide, the
    cells numbered in (image, row, column) order, so the partition's cells are numbered 0 .. C-1 with no gap
    (every cell's dst place is drawn), and put every other token outside the grid. On one image whose tokens fill
    a box, the cells, their numbers and the in-cell places are the ones coordinate_partition gives the image's own
    (row, col): the same partition.
    """
    n = xp.shape(rows)[0]
    volume = sy * sx
    images, rows, cols = _from_zero(xp, images), _from_zero(xp, rows), _from_zero(xp, cols)
    cell_row, cell_col = rows // sy, cols // sx
    place = (rows % sy) * sx + cols % sx
    # Each token's cell as one int, (image, cell row, cell col) from the outermost, every part below the span of
    # the next (device scalars: no host read).
    cell = (images * (xp.max_with_indices(cell_row, 0)[0] + 1) + cell_row) * (xp.max_with_indices(cell_col, 0)[0] + 1) \
        + cell_col
    # Tokens sorted by (cell, place): a complete cell is a run of `volume` tokens of one cell whose places are
    # 0 .. volume-1, so the token at sorted position q and place p lies in one when positions q - p and
    # q - p + volume - 1 exist and hold its cell.
    order = xp.argsort(cell * volume + place, 0, False)
    cell, place = xp.take(cell, order, 0), xp.take(place, order, 0)
    first = xp.arange(n, rows) - place
    last = first + (volume - 1)
    inside = xp.to_int64(first >= 0) * xp.to_int64(last < n)
    zero = first * 0
    first, last = xp.where(inside > 0, first, zero), xp.where(inside > 0, last, zero)
    complete = inside * xp.to_int64(xp.equal(xp.take(cell, first, 0), cell)) \
        * xp.to_int64(xp.equal(xp.take(cell, last, 0), cell))
    # Cells numbered by their first token's rank among the first tokens of complete cells (a stable sort puts
    # those first, in order; its inverse gives each its rank).
    starts = complete * xp.to_int64(xp.equal(place, zero))
    rank = xp.argsort(xp.argsort(1 - starts, 0, False), 0, False)
    number = xp.take(rank, first, 0)
    row, col = number * sy + place // sx, place % sx
    if sx > 1:  # outside the grid: a column past the cell's, which no complete cell reaches
        row, col = xp.where(complete > 0, row, zero), xp.where(complete > 0, col, zero + sx)
    elif sy > 1:  # a row past the last cell's
        beyond = xp.max_with_indices(xp.where(complete > 0, row, zero - 1), 0)[0] + 1
        row = xp.where(complete > 0, row, zero + beyond)
    # Back to token order (`order` is a permutation: each token receives its own value).
    row = xp.scatter_add(xp.zeros([n], rows, integer=True), order, row)
    col = xp.scatter_add(xp.zeros([n], rows, integer=True), order, col)
    return row, col


def own_image(xp: Backend, scores: Any, ordered: Any, num_src: int, minus_inf: Any = None) -> Any:
    """`scores` [B, S, D] of a partition's src against its dst, with every pair of tokens of different images
    (`ordered` [N]: each token's image in the partition's order, src then dst) set to -inf: a src token's best dst
    is one of its own image's, when it has any. `minus_inf`: -inf as a one-element array like `scores`, which a
    caller keeps across blocks (None: a Python float, made into an array at each call)."""
    num_dst = xp.shape(ordered)[0] - num_src
    same = xp.equal(xp.reshape(ordered[:num_src], [num_src, 1]), xp.reshape(ordered[num_src:], [1, num_dst]))
    return xp.where(same, scores, float("-inf") if minus_inf is None else minus_inf)
