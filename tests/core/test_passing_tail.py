"""TokenMerge.with_passing_tail: a reference image's tokens joined after the target's (Flux Kontext) pass
whole. Merging [target, tail] equals merging the target and keeping the tail; unmerging gives the tail back
as it was; rotary rows follow (each tail row its own). On each backend (`fw`), for one map shared by the
batch and for one map per sample."""
import numpy as np
import pytest

from tome_core import compute_coordinate_merges


def _merges(fw, metric, per_sample):
    """Flux's matching: on (row, col) coordinates, one map per sample or one for the batch."""
    h, w = 4, 6
    rows, cols = np.divmod(np.arange(h * w), w)
    coords = (fw.tensor(rows.astype(np.int64)), fw.tensor(cols.astype(np.int64)))
    return compute_coordinate_merges(fw.xp, fw.tensor(metric), coords, (2, 2), [10], None, per_sample=per_sample)[10]


@pytest.mark.parametrize("per_sample", [True, False])
def test_the_tail_passes_whole_and_the_target_merges_as_alone(fw, per_sample):
    gen = np.random.default_rng(0)
    b, n, tail, text = 2, 24, 5, 3
    metric = gen.standard_normal((b, n, 8)).astype(np.float32)
    merge = _merges(fw, metric, per_sample)
    joined = merge.with_passing_tail(tail)
    assert (joined.num_tokens, joined.num_merged) == (n + tail, merge.num_merged + tail)
    x = gen.standard_normal((b, text + n + tail, 4)).astype(np.float32)
    merged = fw.numpy(joined.merge_tail(fw.tensor(x)))
    alone = fw.numpy(merge.merge(fw.tensor(x[:, text:text + n])))
    np.testing.assert_allclose(merged[:, :text], x[:, :text])
    np.testing.assert_allclose(merged[:, text:text + merge.num_merged], alone, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(merged[:, text + merge.num_merged:], x[:, text + n:])  # the tail, untouched
    back = fw.numpy(joined.unmerge_tail(fw.tensor(merged)))
    np.testing.assert_array_equal(back[:, text + n:], x[:, text + n:])
    np.testing.assert_allclose(back[:, text:text + n], fw.numpy(merge.unmerge(fw.tensor(alone))), rtol=1e-6, atol=1e-6)
    # No merged row holds a target token and a tail token.
    rows = fw.numpy(joined.sample_rows())
    assert not set(rows[:, :n].ravel().tolist()) & set(rows[:, n:].ravel().tolist())
    assert merge.num_merged < n  # the target did merge


@pytest.mark.parametrize("per_sample", [True, False])
def test_rotary_rows_of_the_tail_stay_its_own(fw, per_sample):
    gen = np.random.default_rng(1)
    b, n, tail, text = 2, 24, 4, 3
    merge = _merges(fw, gen.standard_normal((b, n, 8)).astype(np.float32), per_sample)
    joined = merge.with_passing_tail(tail)
    table = np.arange(text + n + tail, dtype=np.float32)[:, None] * np.ones((1, 2), np.float32)  # row i holds i
    rows = fw.numpy(joined.gather_rows(fw.tensor(table), 0))
    expected_tail = np.arange(text + n, text + n + tail, dtype=np.float32)
    if rows.ndim == 3:  # one table per sample
        for i in range(b):
            np.testing.assert_array_equal(rows[i, -tail:, 0], expected_tail)
            np.testing.assert_array_equal(rows[i, :text, 0], np.arange(text))
    else:
        np.testing.assert_array_equal(rows[-tail:, 0], expected_tail)
        np.testing.assert_array_equal(rows[:text, 0], np.arange(text))
    assert merge.with_passing_tail(0) is merge
