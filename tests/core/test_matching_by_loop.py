"""tome_core's matching against a plain-Python loop written from the algorithm, not from the core's code.

Bipartite soft matching (Bolya & Hoffman 2023, as tomesd does it): one dst token per cell (sy x sx, or
st x sy x sx on a space-time grid) at the cell's chosen place, every other token a src; each src scores
its cosine similarity with every dst and keeps its best dst; the r src with the highest best score merge
into their dst, each merged row the mean of the tokens it holds; unmerging copies a row back to each of
its tokens. The conventions reproduced here are tome_core's (read from matching.py and schedule.py):

- r is the number of tokens merged away, capped at the src count: N tokens merge to N - min(r, src).
- Cells are laid from each axis's first coordinate; tokens outside the complete cells are src. An offset
  table holds one place per cell, cells and in-cell places both numbered row-major over the axes
  (outermost first; place = dy * sx + dx on an image, (dt * sy + dy) * sx + dx on a video); no table: the
  cell's first token.
- compute_merge matches each sample of the batch on its own metric, on a row-major h x w grid.
- compute_shared_merge(s) match once for the whole batch: a token's metric is the sum over the batch of
  its unit metrics (the mean's direction), and it works on coordinates (tokens in any order, ids starting
  anywhere). There are always N // prod(strides) dst: when complete cells give fewer, the src tokens last
  in token order fill the count. Each merged row stands for its dst (a lone unmerged src for itself).

The comparisons are order-free: unmerge(merge(x)) puts each token's group mean at the token's own place,
and the groups (with the token each shared row stands for) are compared as sets. Metrics are random with
scales that differ per token and sample (so summing raw metrics over the batch is not the same as summing
unit ones), and the loop asserts that no decision it makes is a near tie, so ties never decide a result.
The UNet path is also checked against tomesd 0.1.3 in tests/torch/test_core_vs_tomesd.py.
"""
import math
import zlib

import pytest
import torch

from tome_core import (
    compute_merge, compute_merges, compute_shared_merge, compute_shared_merges, get_backend, num_cells, rng,
)

TOL = 1e-6
GAP = 1e-9  # the least margin the loop accepts for a decision (best dst, the r-th edge)
XP = get_backend(torch.zeros(1))


# ----------------------------------------------------------------------------- the loop reference

def _norm(v):
    return math.sqrt(sum(a * a for a in v))


def _cosine(a, b):
    return sum(x * y for x, y in zip(a, b)) / (_norm(a) * _norm(b))


def loop_partition(coords, strides, offsets, fill_to=None):
    """(src, dst) token ids of tokens at `coords` (one tuple per token, outermost axis first), src ascending;
    dst in the order ties are broken in (fillers, then the cells' dst, each ascending).

    `offsets`: a list, the dst place of each complete cell (None: place 0). `fill_to`: the dst count to
    reach with the src tokens last in token order (the coordinate matching's rule), or None."""
    n, k = len(coords), len(strides)
    low = [min(c[a] for c in coords) for a in range(k)]
    rel = [tuple(c[a] - low[a] for a in range(k)) for c in coords]
    per_axis = [(max(c[a] for c in rel) + 1) // strides[a] for a in range(k)]  # complete cells per axis
    dst = []
    for t, c in enumerate(rel):
        if any(c[a] >= per_axis[a] * strides[a] for a in range(k)):
            continue  # outside every complete cell: a src
        cell = place = 0
        for a in range(k):
            cell = cell * per_axis[a] + c[a] // strides[a]
            place = place * strides[a] + c[a] % strides[a]
        if place == (0 if offsets is None else offsets[cell]):
            dst.append(t)
    fillers = []
    if fill_to is not None and len(dst) < fill_to:
        others = [t for t in range(n) if t not in dst]
        fillers = others[len(others) - (fill_to - len(dst)):]
    dst = fillers + dst
    return [t for t in range(n) if t not in dst], dst


def loop_match(vectors, src, dst, r, ties=False):
    """{frozenset(group): the token the group stands for}: each dst with the src merged into it, and each
    unmerged src alone. Ties go to the dst first in `dst`'s order and to the src first in token order;
    unless `ties`, no decision may be within GAP of a tie."""
    best = {}
    for s in src:
        top, top_dst, second = -math.inf, None, -math.inf
        for d in dst:
            score = _cosine(vectors[s], vectors[d])
            if score > top:
                top, top_dst, second = score, d, top
            elif score > second:
                second = score
        best[s] = (top, top_dst, top - second)
    ranked = sorted(src, key=lambda s: -best[s][0])  # most similar first; sorted() keeps ties in token order
    r = min(r, len(src))
    if 0 < r < len(src) and not ties:
        assert best[ranked[r - 1]][0] - best[ranked[r]][0] > GAP, "a near tie at the r-th edge: pick another seed"
    groups = {d: [d] for d in dst}
    for s in ranked[:r]:
        assert ties or best[s][2] > GAP, "a near tie between two dst: pick another seed"
        groups[best[s][1]].append(s)
    out = {frozenset(members): d for d, members in groups.items()}
    out.update({frozenset([s]): s for s in ranked[r:]})
    return out


def loop_shared_vectors(metric):
    """Each token's metric for the batch's one matching: the sum of its unit metrics over the samples."""
    b, n, c = metric.shape
    rows = metric.tolist()
    out = []
    for t in range(n):
        total = [0.0] * c
        for i in range(b):
            v = rows[i][t]
            size = _norm(v)
            total = [acc + a / size for acc, a in zip(total, v)]
        out.append(total)
    return out


def group_means(x, groups):
    """[N, C]: each token replaced by the mean of its group (every token weighing one), in token order."""
    rows = x.tolist()
    out = [None] * len(rows)
    for members in groups:
        mean = [sum(rows[t][j] for t in members) / len(members) for j in range(len(rows[0]))]
        for t in members:
            out[t] = mean
    return torch.tensor(out, dtype=x.dtype)


# ----------------------------------------------------------------------------- inputs and the core's result

def random_metric(gen, b, n, c=6):
    scale = torch.exp(torch.randn(b, n, 1, generator=gen, dtype=torch.float64))  # sizes 0.1x .. 10x
    return torch.randn(b, n, c, generator=gen, dtype=torch.float64) * scale


def seed_of(*case):
    return zlib.crc32(repr(case).encode())  # str hashes change between runs; this does not


def grid_coords(shape):
    """Tokens of a box of `shape` in row-major order, as coordinate tuples."""
    out = [()]
    for side in shape:
        out = [c + (i,) for c in out for i in range(side)]
    return out


def laid_out(shape, layout, gen):
    """(coordinate tuples, one [N] int64 tensor per axis): row-major from 0, or shuffled with ids from 3, 5, ..."""
    coords = grid_coords(shape)
    if layout == "shuffled":
        perm = torch.randperm(len(coords), generator=gen).tolist()
        coords = [tuple(v + 3 + 2 * a for a, v in enumerate(coords[p])) for p in perm]
    axes = [torch.tensor([c[a] for c in coords], dtype=torch.int64) for a in range(len(shape))]
    return coords, axes


def table(kind, cells, places, like, seed=0):
    if kind is None:
        return None, None
    t = rng.randint(XP, like, [cells], places, rng.call_key(XP, seed, None))
    assert len(set(t.tolist())) > 1  # the table does move dst away from the cells' first token
    return t, t.tolist()


def core_groups(merge, sample, batch):
    """{frozenset(group): merged row} of one sample, read through unmerge: no layout assumed."""
    m = merge.num_merged
    ids = torch.arange(m, dtype=torch.float64).reshape(1, m, 1).expand(batch, m, 1)
    rows = merge.unmerge(ids)[sample, :, 0].round().long().tolist()
    members = {}
    for t, row in enumerate(rows):
        members.setdefault(row, set()).add(t)
    assert sorted(members) == list(range(m)), "a merged row holds no token"
    return {frozenset(v): row for row, v in members.items()}


def assert_merge_equals_loop(merge, x, expected, samples):
    """`expected[b]`: the loop's groups of sample b. The merge's group means, group sets and row count."""
    b = x.shape[0]
    assert merge.num_merged == len(expected[0]) and merge.merge(x).shape == (b, len(expected[0]), x.shape[2])
    y = merge.unmerge(merge.merge(x))
    assert (y - x).abs().max().item() > 1000 * TOL  # merging changes x far beyond the tolerance
    for i in samples:
        assert set(core_groups(merge, i, b)) == set(expected[i])
        torch.testing.assert_close(y[i], group_means(x[i], expected[i]), rtol=0, atol=TOL)


def rs_for(n, num_src):
    return sorted({1, n // 4, n // 2, num_src - 1, n})  # n: more than the src count, capped


# ----------------------------------------------------------------------------- shared matching on coordinates

SHARED_CASES = [  # (box shape, strides)
    ((6, 8), (2, 2)), ((7, 9), (2, 2)), ((5, 6), (2, 2)), ((6, 8), (1, 2)), ((7, 9), (1, 2)), ((5, 7), (2, 1)),
    ((4, 4, 6), (1, 2, 2)), ((3, 5, 4), (1, 2, 2)), ((4, 4, 6), (2, 2, 2)), ((3, 5, 4), (2, 2, 2)),
    ((2, 4, 4), (2, 2, 2)),
]


def shared_expected(metric, coords, strides, offsets, r):
    src, dst = loop_partition(coords, strides, offsets, fill_to=len(coords) // math.prod(strides))
    return loop_match(loop_shared_vectors(metric), src, dst, r), len(src)


def assert_shared_equals_loop(merge, x, expected):
    b = x.shape[0]
    assert_merge_equals_loop(merge, x, [expected] * b, range(b))
    groups = core_groups(merge, 0, b)
    for i in range(1, b):
        assert core_groups(merge, i, b) == groups  # one map for the whole batch
    reps = merge.representatives.tolist()
    assert {g: reps[row] for g, row in groups.items()} == expected  # each row stands for its dst, or itself


@pytest.mark.parametrize("layout", ["row-major", "shuffled"])
@pytest.mark.parametrize("offsets", [None, "random"])
@pytest.mark.parametrize("shape,strides", SHARED_CASES)
def test_shared_merge_equals_the_loop(shape, strides, offsets, layout):
    gen = torch.Generator().manual_seed(seed_of((shape, strides, offsets, layout)))
    coords, axes = laid_out(shape, layout, gen)
    n, b = len(coords), 3
    metric, x = random_metric(gen, b, n), torch.randn(b, n, 5, generator=gen, dtype=torch.float64)
    volume = math.prod(strides)
    offs, offs_list = table(offsets, n // volume, volume, metric)
    for r in rs_for(n, n - n // volume):
        expected, num_src = shared_expected(metric, coords, strides, offs_list, r)
        merge = compute_shared_merge(XP, metric, axes, strides, r, offs)
        assert merge.num_merged == n - min(r, num_src)
        assert_shared_equals_loop(merge, x, expected)


@pytest.mark.parametrize("offsets", [None, "random"])
@pytest.mark.parametrize("shape,strides", [((7, 9), (2, 2)), ((4, 4, 6), (2, 2, 2)), ((3, 5, 4), (1, 2, 2))])
def test_shared_merges_equal_the_single_r_merge_and_the_loop_at_each_r(shape, strides, offsets):
    gen = torch.Generator().manual_seed(seed_of((shape, strides, offsets, "many")))
    coords, axes = laid_out(shape, "shuffled", gen)
    n, b = len(coords), 2
    metric, x = random_metric(gen, b, n), torch.randn(b, n, 5, generator=gen, dtype=torch.float64)
    volume = math.prod(strides)
    offs, offs_list = table(offsets, n // volume, volume, metric, seed=7)
    rs = rs_for(n, n - n // volume)
    merges = compute_shared_merges(XP, metric, axes, strides, rs + [0], offs)
    assert sorted(merges) == rs
    for r in rs:
        expected, _ = shared_expected(metric, coords, strides, offs_list, r)
        assert_shared_equals_loop(merges[r], x, expected)
        single = compute_shared_merge(XP, metric, axes, strides, r, offs)
        assert torch.equal(merges[r].unmerge(merges[r].merge(x)), single.unmerge(single.merge(x)))
        assert torch.equal(merges[r].representatives, single.representatives)


# ----------------------------------------------------------------------------- per-sample matching on an image grid

GRID_CASES = [  # (h, w, sy, sx)
    (6, 8, 2, 2), (7, 9, 2, 2), (5, 6, 2, 2), (6, 8, 1, 2), (7, 9, 1, 2), (5, 7, 2, 1), (7, 8, 3, 2),
]


def grid_expected(metric, h, w, sy, sx, offsets, r):
    coords = grid_coords((h, w))
    src, dst = loop_partition(coords, (sy, sx), offsets)
    return [loop_match(sample, src, dst, r) for sample in metric.tolist()], len(src)


@pytest.mark.parametrize("offsets", [None, "random"])
@pytest.mark.parametrize("h,w,sy,sx", GRID_CASES)
def test_per_sample_merge_equals_the_loop(h, w, sy, sx, offsets):
    gen = torch.Generator().manual_seed(seed_of((h, w, sy, sx, offsets)))
    n, b = h * w, 2
    metric, x = random_metric(gen, b, n), torch.randn(b, n, 5, generator=gen, dtype=torch.float64)
    cells = num_cells(w, h, sx, sy)
    offs, offs_list = table(offsets, cells, sx * sy, metric, seed=3)
    for r in rs_for(n, n - cells):
        expected, num_src = grid_expected(metric, h, w, sy, sx, offs_list, r)
        merge = compute_merge(XP, metric, w, h, sx, sy, r, offs)
        assert merge.num_merged == n - min(r, num_src)
        assert_merge_equals_loop(merge, x, expected, range(b))
        assert core_groups(merge, 0, b) != core_groups(merge, 1, b) or r >= num_src  # each sample its own


@pytest.mark.parametrize("offsets", [None, "random"])
@pytest.mark.parametrize("h,w,sy,sx", [(7, 9, 2, 2), (6, 8, 1, 2)])
def test_per_sample_merges_equal_the_single_r_merge_and_the_loop_at_each_r(h, w, sy, sx, offsets):
    gen = torch.Generator().manual_seed(seed_of((h, w, sy, sx, offsets, "many")))
    n, b = h * w, 2
    metric, x = random_metric(gen, b, n), torch.randn(b, n, 5, generator=gen, dtype=torch.float64)
    cells = num_cells(w, h, sx, sy)
    offs, offs_list = table(offsets, cells, sx * sy, metric, seed=5)
    rs = rs_for(n, n - cells)
    merges = compute_merges(XP, metric, w, h, sx, sy, rs + [0], offs)
    assert sorted(merges) == rs
    for r in rs:
        expected, _ = grid_expected(metric, h, w, sy, sx, offs_list, r)
        assert_merge_equals_loop(merges[r], x, expected, range(b))
        single = compute_merge(XP, metric, w, h, sx, sy, r, offs)
        assert torch.equal(merges[r].unmerge(merges[r].merge(x)), single.unmerge(single.merge(x)))


# ----------------------------------------------------------------------------- exact ties

def one_hot_metric(gen, b, n, c, same_across_batch):
    """Tokens pointing along one of c axes, at power-of-two lengths: every cosine (and the batch's summed unit
    metric) is exact, so equal scores are equal bit for bit and ties decide the matching."""
    axis = torch.randint(c, (1 if same_across_batch else b, n), generator=gen).expand(b, n)
    length = 2.0 ** torch.randint(-3, 4, (b, n), generator=gen).double()
    return torch.nn.functional.one_hot(axis, c).double() * length[..., None]


@pytest.mark.parametrize("case", ["grid", "shared-2d", "shared-3d"])
def test_exact_ties_go_to_the_first_dst_and_the_first_src(case):
    gen = torch.Generator().manual_seed(seed_of(case, "ties"))
    b = 2
    if case == "grid":
        h, w, sy, sx = 7, 9, 2, 2
        n = h * w
        metric = one_hot_metric(gen, b, n, 4, same_across_batch=False)
        offs, offs_list = table("random", num_cells(w, h, sx, sy), sx * sy, metric, seed=11)
    else:
        shape, strides = ((7, 9), (2, 2)) if case == "shared-2d" else ((3, 5, 4), (2, 2, 2))
        coords, axes = laid_out(shape, "shuffled", gen)
        n, volume = len(coords), math.prod(strides)
        metric = one_hot_metric(gen, b, n, 4, same_across_batch=True)
        offs, offs_list = table("random", n // volume, volume, metric, seed=11)
    x = torch.randn(b, n, 5, generator=gen, dtype=torch.float64)
    for r in (3, n // 4, n // 2):
        if case == "grid":
            src, dst = loop_partition(grid_coords((h, w)), (sy, sx), offs_list)
            expected = [loop_match(sample, src, dst, r, ties=True) for sample in metric.tolist()]
            assert_merge_equals_loop(compute_merge(XP, metric, w, h, sx, sy, r, offs), x, expected, range(b))
        else:
            src, dst = loop_partition(coords, strides, offs_list, fill_to=n // volume)
            expected = loop_match(loop_shared_vectors(metric), src, dst, r, ties=True)
            assert_shared_equals_loop(compute_shared_merge(XP, metric, axes, strides, r, offs), x, expected)


def test_nothing_merges_at_r_zero_or_below_one_cell():
    metric = torch.randn(2, 12, 4, dtype=torch.float64)
    axes = [torch.arange(12) // 4, torch.arange(12) % 4]
    assert compute_merge(XP, metric, 4, 3, 2, 2, 0) is None
    assert compute_merge(XP, metric, 12, 1, 2, 2, 5) is None  # one row: no 2 x 2 cell
    assert compute_shared_merge(XP, metric, axes, (2, 2), 0) is None
    assert compute_merges(XP, metric, 4, 3, 2, 2, [0, -1]) is None
    assert compute_shared_merges(XP, metric, axes, (2, 2), [0]) is None
