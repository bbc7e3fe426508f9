"""The band rule: merging within contiguous bands of the token sequence, as context parallelism splits it.

diffusers' context parallelism (Ulysses, ring) gives each of P ranks one contiguous 1/P of a block's
tokens, its band, and every attention then moves each rank's tokens between the ranks. Merging within each
band alone lets every rank merge its own tokens with no communication, and every rank's token count shrink
alike (the shapes the collectives need must match).

The rule is the same on one process and on P: band k holds tokens [k * N/P, (k + 1) * N/P) of the sequence;
it merges r = int(ratio * N/P) of them, matched within the band; the dst pattern is the one global draw of
the whole grid (ToMe's cells and each cell's random place), sliced per band, so it does not depend on P. A
cell cut by a band boundary keeps its dst only in the band that holds it. One process joins the P bands'
merges into one (`join_bands`): band k's merged rows follow band k-1's, the order the ranks' rows take when
a collective gathers them. Attention is indifferent to the order of its keys, so P ranks compute what one
process does to round-off.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from .backend import Backend
from .matching import compute_coordinate_merges, compute_merges
from .token_merge import TokenMerge


def band_range(num_tokens: int, bands: int, index: int) -> Tuple[int, int]:
    """Band `index`'s tokens [start, stop) of `num_tokens` split in `bands` equal bands."""
    if bands < 1 or num_tokens % bands:
        raise ValueError(f"{num_tokens} tokens do not split into {bands} equal bands")
    size = num_tokens // bands
    return index * size, (index + 1) * size


def band_coordinate_merges(xp: Backend, metric: Any, coords: Sequence[Any], strides: Sequence[int], rs: Sequence[int],
                           offsets: Optional[Any], band: Tuple[int, int], per_sample: bool = True, images: Any = None,
                           ) -> Optional[Dict[int, TokenMerge]]:
    """compute_coordinate_merges for the tokens of one band: `metric` [B, n, C] holds tokens [start, stop) of a
    sequence whose every token's coordinates are `coords` ([N] each), and `offsets` is the whole grid's dst
    draw. Token ids of the merge (its rows, its representatives) count from the band's start. `images`: [N]
    each token's image, when the sequence holds several (images.py)."""
    n = xp.shape(metric)[1]
    start, stop = band
    if stop - start != n:
        raise ValueError(f"a band of tokens [{start}, {stop}) holds {stop - start} tokens, got {n}")
    return compute_coordinate_merges(xp, metric, coords, strides, rs, offsets, band=band, per_sample=per_sample,
                                     images=None if images is None else images[start:stop])


def banded_coordinate_merges(xp: Backend, metric: Any, coords: Sequence[Any], strides: Sequence[int],
                             rs: Sequence[int], offsets: Optional[Any], bands: int, per_sample: bool = True,
                             images: Any = None) -> Optional[Dict[int, TokenMerge]]:
    """The band rule on one process: `metric` [B, N, C] in `bands` bands, each matched on its own
    (band_coordinate_merges), joined into one merge per r."""
    n = xp.shape(metric)[1]
    per_band = []
    for index in range(bands):
        start, stop = band_range(n, bands, index)
        per_band.append(band_coordinate_merges(xp, metric[:, start:stop], coords, strides, rs, offsets, (start, stop),
                                               per_sample, images))
    return _join_each(xp, per_band)


def banded_grid_merges(xp: Backend, metric: Any, w: int, h: int, sx: int, sy: int, rs: Sequence[int],
                       offsets: Optional[Any], bands: int) -> Optional[Dict[int, TokenMerge]]:
    """The band rule on a patch grid of h rows (SD3, PixArt; each sample matched on its own): `bands` bands of
    h / bands rows, each a grid of whole sy-row cells matched on its own with its rows of the grid's draw."""
    rows = h // bands
    if h % bands or rows % sy or rows < sy:
        raise ValueError(f"a {h}x{w} patch grid does not split into {bands} bands of whole {sy}-row cells")
    cells = (rows // sy) * (w // sx)
    per_band = []
    for index in range(bands):
        start, stop = band_range(h * w, bands, index)
        own = None if offsets is None else offsets[index * cells:(index + 1) * cells]
        per_band.append(compute_merges(xp, metric[:, start:stop], w, rows, sx, sy, rs, own))
    return _join_each(xp, per_band)


def _join_each(xp: Backend, per_band: List[Optional[Dict[int, TokenMerge]]]) -> Optional[Dict[int, TokenMerge]]:
    if any(merges is None for merges in per_band):
        return None
    return {r: join_bands(xp, [merges[r] for merges in per_band]) for r in per_band[0]}


def join_bands(xp: Backend, merges: Sequence[TokenMerge]) -> TokenMerge:
    """One merge of a sequence from the merges of its consecutive bands: band k's tokens go to band k's
    rows, placed after the rows of the bands before it."""
    batch = merges[0].batch
    rows, inv_counts, representatives = [], [], []
    token_base = row_base = 0
    for merge in merges:
        rows.append(merge.sample_rows() + row_base)
        inv_counts.append(merge.inv_counts)
        if merge.representatives is not None:
            representatives.append(merge.representatives + token_base)
        token_base, row_base = token_base + merge.num_tokens, row_base + merge.num_merged
    joined = xp.concat(rows, 1)  # [B, N]
    flat_rows = xp.reshape(joined + xp.reshape(xp.arange(batch * row_base, joined, step=row_base), [batch, 1]),
                           [batch * token_base])
    shared = all(merge.shared for merge in merges)
    return TokenMerge(xp, flat_rows, xp.concat(inv_counts, 1), batch, token_base, row_base,
                      rows=joined[0] if shared else None,
                      representatives=_joined(xp, representatives) if len(representatives) == len(merges) else None)


def _joined(xp: Backend, representatives: List[Any]) -> Any:
    """Bands' representatives ([M] each, or [B, M] per sample) joined along their rows."""
    return xp.concat(representatives, len(xp.shape(representatives[0])) - 1)
