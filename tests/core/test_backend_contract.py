"""Every operation of tome_core.backend.Backend on every backend, against values worked out by hand.

The NumPy reference backend (tests/numpy_backend.py) must meet the contract for the core's tests on it to
mean anything; torch's and paddle's must meet the same one, so the three agree wherever the core relies on
a detail: stable sorts in both directions, the first of equal maxima, scatters that accumulate repeated
indices and leave rows that receive nothing alone, int64 indices, fixed-shape counts, out-of-place updates.
"""
import inspect

import numpy as np
import pytest

from tome_core.backend import Backend

F64 = np.float64

# The Backend methods each test below exercises (a method added to the protocol fails the coverage test
# until a contract test covers it).
COVERED = {
    "no_grad", "shape", "arange", "zeros", "reshape", "concat", "unstack", "take", "scatter_add", "scatter_reduce",
    "argsort", "max_with_indices", "matmul_transposed", "l2_normalize", "counts", "equal", "broadcast_to",
    "where", "bitwise_xor", "floor", "to_int64", "astype_like", "to_float32", "randint_from",
    "take_along", "put_along", "segment_mean", "prefers_kept_counts", "grad_enabled", "merge_matrix", "matrix_mean",
}


def protocol_methods():
    return {name for name, _ in inspect.getmembers(Backend, inspect.isfunction) if not name.startswith("_")}


def test_every_protocol_method_is_covered_and_implemented(fw):
    assert protocol_methods() == COVERED
    for name in COVERED:
        assert callable(getattr(fw.xp, name)), name
    assert fw.xp.name == fw.name


def as_np(fw, t, dtype=None):
    a = fw.numpy(t)
    if dtype is not None:
        assert a.dtype == dtype, f"{a.dtype} where {np.dtype(dtype)} is due"
    return a


def test_creation_shape_and_layout(fw):
    xp = fw.xp
    like = fw.tensor(np.zeros((2, 3, 4)))
    assert xp.shape(like) == (2, 3, 4) and all(type(d) is int for d in xp.shape(like))
    assert as_np(fw, xp.arange(7, like), np.int64).tolist() == [0, 1, 2, 3, 4, 5, 6]
    assert as_np(fw, xp.arange(7, like, step=3), np.int64).tolist() == [0, 3, 6]
    assert as_np(fw, xp.zeros([2, 5], like), F64).tolist() == [[0.0] * 5] * 2  # like's dtype
    assert as_np(fw, xp.zeros([3], like, integer=True), np.int64).tolist() == [0, 0, 0]
    a = np.arange(24, dtype=F64).reshape(2, 3, 4)
    assert as_np(fw, xp.reshape(fw.tensor(a), [6, -1]), F64).tolist() == a.reshape(6, 4).tolist()
    b = np.arange(6, dtype=F64).reshape(2, 1, 3) + 100
    assert as_np(fw, xp.concat([fw.tensor(a[:, :, :3]), fw.tensor(b)], 1)).tolist() == \
        np.concatenate([a[:, :, :3], b], 1).tolist()
    rows = np.array([2, 0, 2], dtype=np.int64)
    assert as_np(fw, xp.take(fw.tensor(a), fw.tensor(rows), 1)).tolist() == [[a[i][r].tolist() for r in rows] for i in range(2)]
    assert as_np(fw, xp.take(fw.tensor(a), fw.tensor(np.array([1], dtype=np.int64)), 0)).tolist() == [a[1].tolist()]
    rows = xp.unstack(fw.tensor(a))
    assert len(rows) == 2 and [as_np(fw, row).tolist() for row in rows] == a.tolist()
    wide = xp.broadcast_to(fw.tensor(np.array([[1.0], [2.0]])), [3, 2, 4])
    assert as_np(fw, wide).tolist() == [[[1.0] * 4, [2.0] * 4]] * 3
    with xp.no_grad():  # a context manager on every backend
        assert xp.shape(xp.reshape(like, [24])) == (24,)


def test_grad_enabled_is_off_under_no_grad(fw):
    xp = fw.xp
    with xp.no_grad():
        assert xp.grad_enabled() is False
    assert isinstance(xp.grad_enabled(), bool)


def test_take_along_and_its_inverse_put_along(fw):
    xp = fw.xp
    x = np.array([[10.0, 20.0, 30.0, 40.0], [1.0, 2.0, 3.0, 4.0]])
    perm = np.array([[2, 0, 3, 1], [3, 2, 1, 0]], dtype=np.int64)
    taken = as_np(fw, xp.take_along(fw.tensor(x), fw.tensor(perm[:, :2]), 1), F64)
    assert taken.tolist() == [[30.0, 10.0], [4.0, 3.0]]  # fewer indices than the axis holds
    put = as_np(fw, xp.put_along(fw.tensor(x), fw.tensor(perm), 1), F64)
    assert put.tolist() == [[20.0, 40.0, 10.0, 30.0], [4.0, 3.0, 2.0, 1.0]]  # out[perm[k]] = x[k]
    back = as_np(fw, xp.take_along(xp.put_along(fw.tensor(x), fw.tensor(perm), 1), fw.tensor(perm), 1), F64)
    assert back.tolist() == x.tolist()
    rows = np.array([[5, 6, 7, 8], [1, 2, 3, 4]], dtype=np.int64)
    ints = as_np(fw, xp.put_along(fw.tensor(rows), fw.tensor(perm), 1), np.int64)
    assert ints.tolist() == [[6, 8, 5, 7], [4, 3, 2, 1]]  # integer rows too (the merge's row numbers)


def test_segment_mean_averages_the_rows_of_each_segment(fw):
    xp = fw.xp
    src = np.array([[1.0, 10.0], [2.0, 20.0], [4.0, 40.0], [8.0, 80.0], [16.0, 160.0]])
    segments = np.array([0, 2, 0, 1, 0], dtype=np.int64)
    # The framework's own mean, and a sum times given inverse counts (a merge's kept counts; here wrong on purpose
    # for segment 1, so that counts ignored would fail)
    own = as_np(fw, xp.segment_mean(fw.tensor(src), fw.tensor(segments), 3, None), F64)
    kept = as_np(fw, xp.segment_mean(fw.tensor(src), fw.tensor(segments), 3, fw.tensor(np.array([[1 / 3], [0.5], [1.0]]))), F64)
    # float32's round-off at most: paddle keeps ppdiffusers' own numerics, a sum times float32 inverse counts
    assert np.allclose(own, [[7.0, 70.0], [8.0, 80.0], [2.0, 20.0]], rtol=1e-6, atol=0)
    assert np.allclose(kept, [[7.0, 70.0], [4.0, 40.0], [2.0, 20.0]], rtol=1e-6, atol=0)


def test_a_merge_matrix_takes_the_segment_mean_as_a_product(fw):
    xp = fw.xp
    # two samples of 5 tokens into 3 rows each (flat rows: sample 1's are 3..5)
    src = np.arange(20.0).reshape(10, 2) ** 1.5
    rows = np.array([0, 2, 0, 1, 0, 5, 3, 4, 3, 3], dtype=np.int64)
    inv = np.array([[1 / 3], [1.0], [1.0], [1 / 3], [1.0], [1.0]])
    matrix = xp.merge_matrix(fw.tensor(rows), 2, 5, 3, fw.tensor(src), force=True)
    assert as_np(fw, matrix, F64).tolist() == [
        [[1, 0, 1, 0, 1], [0, 0, 0, 1, 0], [0, 1, 0, 0, 0]], [[0, 1, 0, 1, 1], [0, 0, 1, 0, 0], [1, 0, 0, 0, 0]]]
    product = as_np(fw, xp.matrix_mean(matrix, fw.tensor(src), fw.tensor(inv)), F64)
    scattered = as_np(fw, xp.segment_mean(fw.tensor(src), fw.tensor(rows), 6, None), F64)
    assert np.allclose(product, scattered, rtol=1e-6, atol=0)
    # unforced, a CPU's (and the reference's) mean scatters: a product costs it M times the adds
    assert xp.merge_matrix(fw.tensor(rows), 2, 5, 3, fw.tensor(src)) is None


def test_scatter_add_accumulates_repeated_indices_out_of_place(fw):
    xp = fw.xp
    target = np.array([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0], [4.0, 4.0]])
    indices = np.array([0, 2, 0, 0, 3], dtype=np.int64)
    src = np.array([[1.0, 10.0], [2.0, 20.0], [4.0, 40.0], [8.0, 80.0], [16.0, 160.0]])
    t = fw.tensor(target)
    out = as_np(fw, xp.scatter_add(t, fw.tensor(indices), fw.tensor(src)), F64)
    # row 0 receives three rows, row 1 none, rows 2 and 3 one each; each on top of the target's values
    assert out.tolist() == [[14.0, 131.0], [2.0, 2.0], [5.0, 23.0], [20.0, 164.0]]
    assert fw.numpy(t).tolist() == target.tolist()  # the target is left as it was


@pytest.mark.parametrize("mode,expected_row0", [("amax", [8.0, 40.0]), ("amin", [1.0, -80.0]), ("prod", [32.0, -32000.0])])
def test_scatter_reduce_takes_only_the_src_rows_of_receiving_rows(fw, mode, expected_row0):
    xp = fw.xp
    # The target's own values lie outside every src value: a reduction that included them would show.
    target = np.array([[100.0, 100.0], [-7.0, 7.0], [0.5, -0.5]])
    indices = np.array([0, 2, 0, 0], dtype=np.int64)
    src = np.array([[1.0, 10.0], [3.0, -30.0], [4.0, 40.0], [8.0, -80.0]])
    t = fw.tensor(target)
    out = as_np(fw, xp.scatter_reduce(t, fw.tensor(indices), fw.tensor(src), mode), F64)
    assert out[0].tolist() == expected_row0
    assert out[1].tolist() == [-7.0, 7.0]  # receives nothing: keeps the target's row
    assert out[2].tolist() == [3.0, -30.0]  # one src row: that row, whatever the mode
    assert fw.numpy(t).tolist() == target.tolist()


def stable_order(values, descending):
    """Indices sorting `values`, equal values in index order (Python's sort is stable)."""
    return sorted(range(len(values)), key=lambda i: -values[i] if descending else values[i])


@pytest.mark.parametrize("descending", [False, True])
def test_argsort_is_stable_in_both_directions(fw, descending):
    xp = fw.xp
    rows = np.array([[3, 1, 3, 0, 1, 3, 2, 1], [5, 5, 5, 5, 5, 5, 5, 5], [0, 1, 0, 1, 0, 1, 0, 1]], dtype=F64)
    out = as_np(fw, xp.argsort(fw.tensor(rows), -1, descending), np.int64)
    assert out.tolist() == [stable_order(r.tolist(), descending) for r in rows]
    cols = as_np(fw, xp.argsort(fw.tensor(rows.T.copy()), 0, descending), np.int64)
    assert cols.T.tolist() == out.tolist()
    flags = np.array([True, False, True, True, False, False, True, False])
    out = as_np(fw, xp.argsort(fw.tensor(flags), 0, descending), np.int64)
    assert out.tolist() == stable_order(flags.astype(int).tolist(), descending)


def test_max_with_indices_gives_the_first_of_equal_maxima(fw):
    xp = fw.xp
    x = np.array([[[1.0, 3.0, 3.0, 0.0, 3.0], [2.0, 2.0, 2.0, 2.0, 2.0], [0.0, 1.0, 0.0, 1.0, -1.0]]])
    values, indices = xp.max_with_indices(fw.tensor(x), -1)
    assert as_np(fw, values, F64).tolist() == [[3.0, 2.0, 1.0]]
    assert as_np(fw, indices, np.int64).tolist() == [[1, 0, 1]]
    values, indices = xp.max_with_indices(fw.tensor(np.array([4, -2, 9, 9, 1], dtype=np.int64)), 0)
    assert int(fw.numpy(values)) == 9 and int(fw.numpy(indices)) == 2


def test_matmul_transposed_and_l2_normalize(fw):
    xp = fw.xp
    a = np.arange(2 * 3 * 4, dtype=F64).reshape(2, 3, 4) - 5
    b = np.arange(2 * 2 * 4, dtype=F64).reshape(2, 2, 4) % 3
    expected = [[[sum(a[k, i, c] * b[k, j, c] for c in range(4)) for j in range(2)] for i in range(3)] for k in range(2)]
    assert as_np(fw, xp.matmul_transposed(fw.tensor(a), fw.tensor(b)), F64).tolist() == expected
    v = np.array([[3.0, 4.0], [0.0, -2.0], [1.0, 1.0]])
    out = as_np(fw, xp.l2_normalize(fw.tensor(v), -1), F64)
    np.testing.assert_allclose(out, [[0.6, 0.8], [0.0, -1.0], [2 ** -0.5, 2 ** -0.5]], rtol=0, atol=1e-15)
    out = as_np(fw, xp.l2_normalize(fw.tensor(v.T.copy()), 0), F64)
    np.testing.assert_allclose(out.T, [[0.6, 0.8], [0.0, -1.0], [2 ** -0.5, 2 ** -0.5]], rtol=0, atol=1e-15)


def test_counts_is_a_fixed_shape_float32_histogram(fw):
    x = np.array([4, 0, 4, 2, 4, 0], dtype=np.int64)
    out = as_np(fw, fw.xp.counts(fw.tensor(x), 7), np.float32)
    assert out.tolist() == [2.0, 0.0, 1.0, 0.0, 3.0, 0.0, 0.0]  # length 7, values absent from x counted 0


def test_elementwise_ops(fw):
    xp = fw.xp
    a = np.array([1, 5, -3, 7], dtype=np.int64)
    b = np.array([1, 4, -3, 0], dtype=np.int64)
    assert as_np(fw, xp.equal(fw.tensor(a), fw.tensor(b))).tolist() == [True, False, True, False]
    cond = fw.tensor(np.array([True, False, False, True]))
    assert as_np(fw, xp.where(cond, fw.tensor(a), fw.tensor(b)), np.int64).tolist() == [1, 4, -3, 7]
    big = np.array([2 ** 40 + 12345, 65_535, 0, 2 ** 61 + 1], dtype=np.int64)
    assert as_np(fw, xp.bitwise_xor(fw.tensor(big), fw.tensor(big // 65_536)), np.int64).tolist() == \
        [v ^ (v // 65_536) for v in big.tolist()]
    f = np.array([2.5, -2.5, 3.0, -0.25, 1023.999], dtype=np.float32)
    assert as_np(fw, xp.floor(fw.tensor(f)), np.float32).tolist() == [2.0, -3.0, 3.0, -1.0, 1023.0]
    assert as_np(fw, xp.to_int64(fw.tensor(np.array([3.0, -2.0, 7.0]))), np.int64).tolist() == [3, -2, 7]
    assert as_np(fw, xp.to_int64(fw.tensor(np.array([True, False]))), np.int64).tolist() == [1, 0]
    assert as_np(fw, xp.to_float32(fw.tensor(np.array([1, 2 ** 20], dtype=np.int64))), np.float32).tolist() == [1.0, 2.0 ** 20]
    like = fw.tensor(np.zeros(2, dtype=F64))
    assert as_np(fw, xp.astype_like(fw.tensor(np.array([0.5, 2.0], dtype=np.float32)), like), F64).tolist() == [0.5, 2.0]


def framework_generator(fw, seed):
    if fw.name == "numpy":
        return np.random.default_rng(seed)
    if fw.name == "torch":
        return fw.module.Generator().manual_seed(seed)
    return None  # paddle takes no generator object


def test_randint_from_draws_from_the_frameworks_generator(fw):
    xp, like = fw.xp, fw.tensor(np.zeros(1))
    if fw.name == "paddle":
        with pytest.raises(TypeError, match="seed="):
            xp.randint_from(object(), 4, (3, 5), like)
        return
    draws = [as_np(fw, xp.randint_from(framework_generator(fw, s), 4, (30, 50), like), np.int64) for s in (1, 1, 2)]
    assert draws[0].shape == (1500,) and draws[0].min() == 0 and draws[0].max() == 3  # flat, in [0, 4)
    assert np.array_equal(draws[0], draws[1]) and not np.array_equal(draws[0], draws[2])  # the generator decides
