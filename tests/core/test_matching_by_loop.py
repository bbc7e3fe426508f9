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

Every test runs on each backend (`fw`, tests/core/conftest.py): the NumPy reference one always, torch and
paddle where they import. Inputs are NumPy arrays (so each backend sees the same values) handed to the core
as the framework's tensors.
"""
import math
import zlib

import numpy as np
import pytest

from tome_core import (
    MERGE_MODES, bipartite_soft_matching_random2d, compute_downsample, compute_merge, compute_merges,
    compute_coordinate_merges, compute_shared_merge, compute_shared_merges, num_cells, rng,
)

TOL = 1e-6
GAP = 1e-9  # the least margin the loop accepts for a decision (best dst, the r-th edge)


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
    return np.array(out, dtype=x.dtype)


# ----------------------------------------------------------------------------- inputs and the core's result

def random_metric(gen, b, n, c=6):
    scale = np.exp(gen.standard_normal((b, n, 1)))  # sizes 0.1x .. 10x
    return gen.standard_normal((b, n, c)) * scale


def generator(*case):
    return np.random.default_rng(zlib.crc32(repr(case).encode()))  # str hashes change between runs; crc32 not


def grid_coords(shape):
    """Tokens of a box of `shape` in row-major order, as coordinate tuples."""
    out = [()]
    for side in shape:
        out = [c + (i,) for c in out for i in range(side)]
    return out


def laid_out(fw, shape, layout, gen):
    """(coordinate tuples, one [N] int64 tensor per axis): row-major from 0, or shuffled with ids from 3, 5, ..."""
    coords = grid_coords(shape)
    if layout == "shuffled":
        perm = gen.permutation(len(coords)).tolist()
        coords = [tuple(v + 3 + 2 * a for a, v in enumerate(coords[p])) for p in perm]
    axes = [fw.tensor(np.array([c[a] for c in coords], dtype=np.int64)) for a in range(len(shape))]
    return coords, axes


def table(fw, kind, cells, places, like, seed=0):
    if kind is None:
        return None, None
    t = rng.randint(fw.xp, like, [cells], places, rng.call_key(fw.xp, seed, None))
    values = fw.numpy(t).tolist()
    assert len(set(values)) > 1  # the table does move dst away from the cells' first token
    return t, values


def core_groups(fw, merge, sample, batch):
    """{frozenset(group): merged row} of one sample, read through unmerge: no layout assumed."""
    m = merge.num_merged
    ids = fw.tensor(np.broadcast_to(np.arange(m, dtype=np.float64).reshape(1, m, 1), (batch, m, 1)))
    rows = np.rint(fw.numpy(merge.unmerge(ids))[sample, :, 0]).astype(np.int64).tolist()
    members = {}
    for t, row in enumerate(rows):
        members.setdefault(row, set()).add(t)
    assert sorted(members) == list(range(m)), "a merged row holds no token"
    return {frozenset(v): row for row, v in members.items()}


def round_trip(fw, merge, x):
    """unmerge(merge(x)) of the numpy array x, on fw, as a numpy array."""
    return fw.numpy(merge.unmerge(merge.merge(fw.tensor(x))))


def assert_merge_equals_loop(fw, merge, x, expected, samples):
    """`expected[b]`: the loop's groups of sample b. The merge's group means, group sets and row count."""
    b = x.shape[0]
    merged = fw.numpy(merge.merge(fw.tensor(x)))
    assert merge.num_merged == len(expected[0]) and merged.shape == (b, len(expected[0]), x.shape[2])
    y = round_trip(fw, merge, x)
    assert y.dtype == x.dtype and np.abs(y - x).max() > 1000 * TOL  # merging changes x far beyond the tolerance
    for i in samples:
        assert set(core_groups(fw, merge, i, b)) == set(expected[i])
        np.testing.assert_allclose(y[i], group_means(x[i], expected[i]), rtol=0, atol=TOL)


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


def assert_shared_equals_loop(fw, merge, x, expected):
    b = x.shape[0]
    assert_merge_equals_loop(fw, merge, x, [expected] * b, range(b))
    groups = core_groups(fw, merge, 0, b)
    for i in range(1, b):
        assert core_groups(fw, merge, i, b) == groups  # one map for the whole batch
    reps = fw.numpy(merge.representatives).tolist()
    assert {g: reps[row] for g, row in groups.items()} == expected  # each row stands for its dst, or itself


@pytest.mark.parametrize("layout", ["row-major", "shuffled"])
@pytest.mark.parametrize("offsets", [None, "random"])
@pytest.mark.parametrize("shape,strides", SHARED_CASES)
def test_shared_merge_equals_the_loop(fw, shape, strides, offsets, layout):
    gen = generator(shape, strides, offsets, layout)
    coords, axes = laid_out(fw, shape, layout, gen)
    n, b = len(coords), 3
    metric, x = random_metric(gen, b, n), gen.standard_normal((b, n, 5))
    volume = math.prod(strides)
    offs, offs_list = table(fw, offsets, n // volume, volume, fw.tensor(metric))
    for r in rs_for(n, n - n // volume):
        expected, num_src = shared_expected(metric, coords, strides, offs_list, r)
        merge = compute_shared_merge(fw.xp, fw.tensor(metric), axes, strides, r, offs)
        assert merge.num_merged == n - min(r, num_src)
        assert_shared_equals_loop(fw, merge, x, expected)


@pytest.mark.parametrize("offsets", [None, "random"])
@pytest.mark.parametrize("shape,strides", [((7, 9), (2, 2)), ((4, 4, 6), (2, 2, 2)), ((3, 5, 4), (1, 2, 2))])
def test_shared_merges_equal_the_single_r_merge_and_the_loop_at_each_r(fw, shape, strides, offsets):
    gen = generator(shape, strides, offsets, "many")
    coords, axes = laid_out(fw, shape, "shuffled", gen)
    n, b = len(coords), 2
    metric, x = random_metric(gen, b, n), gen.standard_normal((b, n, 5))
    volume = math.prod(strides)
    offs, offs_list = table(fw, offsets, n // volume, volume, fw.tensor(metric), seed=7)
    rs = rs_for(n, n - n // volume)
    merges = compute_shared_merges(fw.xp, fw.tensor(metric), axes, strides, rs + [0], offs)
    assert sorted(merges) == rs
    for r in rs:
        expected, _ = shared_expected(metric, coords, strides, offs_list, r)
        assert_shared_equals_loop(fw, merges[r], x, expected)
        single = compute_shared_merge(fw.xp, fw.tensor(metric), axes, strides, r, offs)
        assert np.array_equal(round_trip(fw, merges[r], x), round_trip(fw, single, x))
        assert np.array_equal(fw.numpy(merges[r].representatives), fw.numpy(single.representatives))


@pytest.mark.parametrize("layout", ["row-major", "shuffled"])
@pytest.mark.parametrize("offsets", [None, "random"])
@pytest.mark.parametrize("shape,strides", [((7, 9), (2, 2)), ((6, 8), (1, 2)), ((4, 4, 6), (2, 2, 2)), ((3, 5, 4), (1, 2, 2))])
def test_per_sample_coordinate_merges_equal_the_loop_on_each_sample(fw, shape, strides, offsets, layout):
    """compute_coordinate_merges(per_sample=True): each sample matched on its own metric (as a UNet's grid
    is), on the same partition; each sample's representatives are its rows' dst tokens, or the tokens themselves."""
    gen = generator(shape, strides, offsets, layout, "per-sample")
    coords, axes = laid_out(fw, shape, layout, gen)
    n, b = len(coords), 3
    metric, x = random_metric(gen, b, n), gen.standard_normal((b, n, 5))
    volume = math.prod(strides)
    offs, offs_list = table(fw, offsets, n // volume, volume, fw.tensor(metric))
    src, dst = loop_partition(coords, strides, offs_list, fill_to=n // volume)
    rs = rs_for(n, len(src))
    merges = compute_coordinate_merges(fw.xp, fw.tensor(metric), axes, strides, rs, offs, per_sample=True)
    for r in rs:
        expected = [loop_match(metric[i].tolist(), src, dst, r) for i in range(b)]
        assert expected[0] != expected[1]  # the samples do match apart
        assert_merge_equals_loop(fw, merges[r], x, expected, range(b))
        reps = fw.numpy(merges[r].representatives).tolist()
        assert len(reps) == b
        for i in range(b):
            groups = core_groups(fw, merges[r], i, b)
            assert {g: reps[i][row] for g, row in groups.items()} == expected[i]


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
def test_per_sample_merge_equals_the_loop(fw, h, w, sy, sx, offsets):
    gen = generator(h, w, sy, sx, offsets)
    n, b = h * w, 2
    metric, x = random_metric(gen, b, n), gen.standard_normal((b, n, 5))
    cells = num_cells(w, h, sx, sy)
    offs, offs_list = table(fw, offsets, cells, sx * sy, fw.tensor(metric), seed=3)
    for r in rs_for(n, n - cells):
        expected, num_src = grid_expected(metric, h, w, sy, sx, offs_list, r)
        merge = compute_merge(fw.xp, fw.tensor(metric), w, h, sx, sy, r, offs)
        assert merge.num_merged == n - min(r, num_src)
        assert_merge_equals_loop(fw, merge, x, expected, range(b))
        assert core_groups(fw, merge, 0, b) != core_groups(fw, merge, 1, b) or r >= num_src  # each sample its own


@pytest.mark.parametrize("offsets", [None, "random"])
@pytest.mark.parametrize("h,w,sy,sx", [(7, 9, 2, 2), (6, 8, 1, 2)])
def test_per_sample_merges_equal_the_single_r_merge_and_the_loop_at_each_r(fw, h, w, sy, sx, offsets):
    gen = generator(h, w, sy, sx, offsets, "many")
    n, b = h * w, 2
    metric, x = random_metric(gen, b, n), gen.standard_normal((b, n, 5))
    cells = num_cells(w, h, sx, sy)
    offs, offs_list = table(fw, offsets, cells, sx * sy, fw.tensor(metric), seed=5)
    rs = rs_for(n, n - cells)
    merges = compute_merges(fw.xp, fw.tensor(metric), w, h, sx, sy, rs + [0], offs)
    assert sorted(merges) == rs
    for r in rs:
        expected, _ = grid_expected(metric, h, w, sy, sx, offs_list, r)
        assert_merge_equals_loop(fw, merges[r], x, expected, range(b))
        single = compute_merge(fw.xp, fw.tensor(metric), w, h, sx, sy, r, offs)
        assert np.array_equal(round_trip(fw, merges[r], x), round_trip(fw, single, x))


# ----------------------------------------------------------------------------- exact ties

def one_hot_metric(gen, b, n, c, same_across_batch):
    """Tokens pointing along one of c axes, at power-of-two lengths: every cosine (and the batch's summed unit
    metric) is exact, so equal scores are equal bit for bit and ties decide the matching."""
    axis = np.broadcast_to(gen.integers(0, c, size=(1 if same_across_batch else b, n)), (b, n))
    length = 2.0 ** gen.integers(-3, 4, size=(b, n)).astype(np.float64)
    return np.eye(c)[axis] * length[..., None]


@pytest.mark.parametrize("case", ["grid", "shared-2d", "shared-3d"])
def test_exact_ties_go_to_the_first_dst_and_the_first_src(fw, case):
    gen = generator(case, "ties")
    b = 2
    if case == "grid":
        h, w, sy, sx = 7, 9, 2, 2
        n = h * w
        metric = one_hot_metric(gen, b, n, 4, same_across_batch=False)
        offs, offs_list = table(fw, "random", num_cells(w, h, sx, sy), sx * sy, fw.tensor(metric), seed=11)
    else:
        shape, strides = ((7, 9), (2, 2)) if case == "shared-2d" else ((3, 5, 4), (2, 2, 2))
        coords, axes = laid_out(fw, shape, "shuffled", gen)
        n, volume = len(coords), math.prod(strides)
        metric = one_hot_metric(gen, b, n, 4, same_across_batch=True)
        offs, offs_list = table(fw, "random", n // volume, volume, fw.tensor(metric), seed=11)
    x = gen.standard_normal((b, n, 5))
    for r in (3, n // 4, n // 2):
        if case == "grid":
            src, dst = loop_partition(grid_coords((h, w)), (sy, sx), offs_list)
            expected = [loop_match(sample, src, dst, r, ties=True) for sample in metric.tolist()]
            merge = compute_merge(fw.xp, fw.tensor(metric), w, h, sx, sy, r, offs)
            assert_merge_equals_loop(fw, merge, x, expected, range(b))
        else:
            src, dst = loop_partition(coords, strides, offs_list, fill_to=n // volume)
            expected = loop_match(loop_shared_vectors(metric), src, dst, r, ties=True)
            merge = compute_shared_merge(fw.xp, fw.tensor(metric), axes, strides, r, offs)
            assert_shared_equals_loop(fw, merge, x, expected)


def test_nothing_merges_at_r_zero_or_below_one_cell(fw):
    metric = fw.tensor(np.random.default_rng(0).standard_normal((2, 12, 4)))
    axes = [fw.tensor(np.arange(12, dtype=np.int64) // 4), fw.tensor(np.arange(12, dtype=np.int64) % 4)]
    assert compute_merge(fw.xp, metric, 4, 3, 2, 2, 0) is None
    assert compute_merge(fw.xp, metric, 12, 1, 2, 2, 5) is None  # one row: no 2 x 2 cell
    assert compute_shared_merge(fw.xp, metric, axes, (2, 2), 0) is None
    assert compute_merges(fw.xp, metric, 4, 3, 2, 2, [0, -1]) is None
    assert compute_shared_merges(fw.xp, metric, axes, (2, 2), [0]) is None


# ----------------------------------------------------------------------------- reductions other than the mean

LOOP_REDUCE = {"sum": sum, "amax": max, "amin": min, "prod": math.prod}


@pytest.mark.parametrize("shared", [False, True], ids=["per-sample", "shared"])
@pytest.mark.parametrize("mode", [m for m in MERGE_MODES if m != "mean"])
def test_each_merge_mode_reduces_each_group_as_the_loop(fw, mode, shared):
    """merge(x, mode) reduces the tokens of each of the loop's groups (a dst and the src merged into it)."""
    gen = generator(mode, shared, "modes")
    h, w, sy, sx, b = 6, 8, 2, 2, 2
    n, r = h * w, h * w // 2  # 24 of the 36 src merge into 12 dst: groups of up to several tokens
    metric, x = random_metric(gen, b, n), gen.standard_normal((b, n, 5))
    if shared:
        coords, axes = laid_out(fw, (h, w), "shuffled", gen)
        offs, offs_list = table(fw, "random", n // 4, 4, fw.tensor(metric), seed=13)
        expected = [shared_expected(metric, coords, (sy, sx), offs_list, r)[0]] * b
        merge = compute_shared_merge(fw.xp, fw.tensor(metric), axes, (sy, sx), r, offs)
    else:
        offs, offs_list = table(fw, "random", num_cells(w, h, sx, sy), 4, fw.tensor(metric), seed=13)
        expected = grid_expected(metric, h, w, sy, sx, offs_list, r)[0]
        merge = compute_merge(fw.xp, fw.tensor(metric), w, h, sx, sy, r, offs)
    out = fw.numpy(merge.merge(fw.tensor(x), mode=mode))
    assert out.shape == (b, n - r, 5) and out.dtype == x.dtype
    for i in range(b):
        groups = core_groups(fw, merge, i, b)
        assert set(groups) == set(expected[i]) and max(len(g) for g in groups) >= 3
        for members, row in groups.items():
            want = [LOOP_REDUCE[mode](x[i, t, j] for t in sorted(members)) for j in range(x.shape[2])]
            np.testing.assert_allclose(out[i, row], want, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="merge mode"):
        merge.merge(fw.tensor(x), mode="median")


# ----------------------------------------------------------------------------- token downsampling (ToDo)

@pytest.mark.parametrize("method", ["nearest", "avg"])
@pytest.mark.parametrize("h,w,factor,frames", [(6, 8, 2, 1), (7, 9, 2, 1), (5, 7, 3, 1), (1, 6, 2, 1), (8, 8, 4, 1),
                                               (5, 7, 2, 3), (4, 6, 3, 2)])
def test_downsample_keeps_each_cells_first_token_or_its_mean_as_the_loop(fw, method, h, w, factor, frames):
    """Each factor x factor cell (partial at the far edges) of each frame's grid gives one key/value token: its
    top-left token ("nearest") or the mean of the tokens it holds ("avg"), frames then cells in row-major order."""
    gen = generator(h, w, factor, method, "downsample", frames)
    b = 2
    x = gen.standard_normal((b, frames * h * w, 5))
    hh, ww = -(-h // factor), -(-w // factor)
    expected = np.zeros((b, frames * hh * ww, 5))
    sizes = [0] * (frames * hh * ww)
    for f in range(frames):
        for cy in range(hh):
            for cx in range(ww):
                cell = [f * h * w + y * w + c for y in range(cy * factor, min(h, cy * factor + factor))
                        for c in range(cx * factor, min(w, cx * factor + factor))]
                sizes[(f * hh + cy) * ww + cx] = len(cell)
                for i in range(b):
                    rows = [x[i, t].tolist() for t in cell]
                    expected[i, (f * hh + cy) * ww + cx] = (
                        rows[0] if method == "nearest" else [sum(v) / len(rows) for v in zip(*rows)])
    down = compute_downsample(fw.xp, fw.tensor(x), b, w, h, factor, method, frames)
    out = fw.numpy(down(fw.tensor(x)))
    assert down.num_kept == frames * hh * ww and out.shape == expected.shape and out.dtype == x.dtype
    np.testing.assert_allclose(out, expected, rtol=0, atol=TOL)  # means use float32 inverse counts
    # Proportional attention weighs each kept key as its cell's tokens; whole cells everywhere weigh alike.
    np.testing.assert_allclose(fw.numpy(down.inv_counts).reshape(-1), 1 / np.array(sizes), rtol=1e-6)
    assert down.uniform == (len(set(sizes)) == 1)
    assert compute_downsample(fw.xp, fw.tensor(x), b, w, h, 1, method, frames) is None


# ----------------------------------------------------------------------------- the bipartite_soft_matching_random2d entry point

@pytest.mark.parametrize("how", ["no_rand", "default seed", "seed", "generator"])
def test_the_entry_point_merges_as_the_loop(fw, how):
    """get_backend finds the tensor's backend; the dst table comes from the seed's counter-based draws, the
    framework generator's, or is the cells' first token."""
    h, w, sx, sy, b, r = 7, 9, 2, 2, 2, 20
    gen = generator(how, "entry point")
    n, cells = h * w, num_cells(w, h, sx, sy)
    metric, x = random_metric(gen, b, n), gen.standard_normal((b, n, 5))
    like = fw.tensor(metric)
    if how == "no_rand":
        kwargs, offs_list = {"no_rand": True}, None
    elif how == "default seed":
        kwargs, offs_list = {}, table(fw, "random", cells, sx * sy, like, seed=rng.DEFAULT_SEED)[1]
    elif how == "seed":
        kwargs, offs_list = {"seed": 9}, table(fw, "random", cells, sx * sy, like, seed=9)[1]
    else:
        if fw.name == "paddle":  # paddle's randint takes no generator object: refused, naming seed=
            with pytest.raises(TypeError, match="seed="):
                bipartite_soft_matching_random2d(like, w, h, sx, sy, r, generator=object())
            return
        new_generator = (lambda: np.random.default_rng(4)) if fw.name == "numpy" else \
            (lambda: fw.module.Generator().manual_seed(4))
        kwargs = {"generator": new_generator()}
        offs_list = fw.numpy(fw.xp.randint_from(new_generator(), sx * sy, (h // sy, w // sx), like)).tolist()
        assert len(set(offs_list)) > 1
    merge, unmerge = bipartite_soft_matching_random2d(like, w, h, sx, sy, r, **kwargs)
    expected = grid_expected(metric, h, w, sy, sx, offs_list, r)[0]
    y = fw.numpy(unmerge(merge(fw.tensor(x))))
    assert fw.numpy(merge(fw.tensor(x))).shape == (b, n - r, 5)
    for i in range(b):
        np.testing.assert_allclose(y[i], group_means(x[i], expected[i]), rtol=0, atol=TOL)


@pytest.mark.parametrize("shape, axis, head", [((20, 3), 0, 4), ((2, 1, 20, 2, 2), 2, 4), ((1, 16, 1, 3), 1, 0)])
def test_rotary_rows_follow_their_representatives_and_text_rows_stay(fw, shape, axis, head):
    """gather_rows, by hand: a table's text rows (in front) as they are, then the representative's row of each
    merged token, along any axis (Flux [text + image, D]; ComfyUI's Flux [B, 1, text + image, ...]; Wan)."""
    n = 16
    gen = np.random.default_rng(3)
    metric = gen.standard_normal((2, n, 8))
    rows, cols = np.divmod(np.arange(n), 4)
    merge = compute_shared_merge(fw.xp, fw.tensor(metric), (fw.tensor(rows), fw.tensor(cols)), (2, 2), 6)
    table = np.arange(math.prod(shape), dtype=np.float32).reshape(shape)
    reps = fw.numpy(merge.representatives).tolist()
    expected = np.take(table, list(range(head)) + [head + rep for rep in reps], axis=axis)
    assert np.array_equal(fw.numpy(merge.gather_rows(fw.tensor(table), axis)), expected)
    with pytest.raises(ValueError, match="must hold the image's 16 rows"):
        merge.gather_rows(fw.tensor(np.take(table, range(n - 1), axis=axis)), axis)
