"""TokenMerge.gather_rows with a matching per sample on tables whose tokens are not the second axis: axes between the
batch and the rows of any size (LTX-2's split rotary rows [B, heads, S, D/2]), and a negative axis counted from the
table's last (LTX-2's rows: -2 for [B, S, D] and [B, heads, S, D/2] alike). By hand, on each backend (`fw`)."""
import numpy as np
import pytest

from tome_core import compute_coordinate_merges


@pytest.mark.parametrize("shape, axis", [((2, 3, 16, 4), 2), ((2, 3, 16, 4), -2), ((1, 3, 16, 4), -2),
                                         ((2, 16, 5), -2), ((2, 2, 3, 16), -1)])
def test_each_sample_takes_its_own_rows_at_its_representatives_along_any_axis(fw, shape, axis):
    gen = np.random.default_rng(7)
    b, n = 2, 16
    rows, cols = np.divmod(np.arange(n), 4)
    coords = (fw.tensor(rows.astype(np.int64)), fw.tensor(cols.astype(np.int64)))
    metric = fw.tensor(gen.standard_normal((b, n, 8)).astype(np.float32))
    merge = compute_coordinate_merges(fw.xp, metric, coords, (2, 2), [6], None, per_sample=True)[6]
    reps = fw.numpy(merge.representatives)
    assert reps.shape == (b, n - 6) and not np.array_equal(reps[0], reps[1])  # the samples match apart
    table = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    whole = np.broadcast_to(table, (b,) + shape[1:])
    expected = np.stack([np.take(whole[i], reps[i], axis=axis if axis < 0 else axis - 1) for i in range(b)])
    assert np.array_equal(fw.numpy(merge.gather_rows(fw.tensor(table), axis)), expected)
