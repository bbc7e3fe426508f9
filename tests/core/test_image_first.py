"""TokenMerge.merge_head / unmerge_head / spread(head=True): a sequence whose first N tokens are the image and whose
text follows (HunyuanVideo's single blocks join [image, text]): the image merges as alone, the text passes whole and
comes back as it was. On each backend (`fw`), for one map shared by the batch and for one map per sample."""
import numpy as np
import pytest

from tome_core import compute_coordinate_merges


@pytest.mark.parametrize("per_sample", [True, False])
def test_the_first_n_tokens_merge_as_alone_and_the_text_after_them_passes(fw, per_sample):
    gen = np.random.default_rng(0)
    b, h, w, text = 2, 4, 6, 5
    n = h * w
    rows, cols = np.divmod(np.arange(n), w)
    coords = (fw.tensor(rows.astype(np.int64)), fw.tensor(cols.astype(np.int64)))
    metric = fw.tensor(gen.standard_normal((b, n, 8)).astype(np.float32))
    merge = compute_coordinate_merges(fw.xp, metric, coords, (2, 2), [10], None, per_sample=per_sample)[10]
    m = merge.num_merged
    assert m < n  # the image did merge
    x = gen.standard_normal((b, n + text, 4)).astype(np.float32)
    merged = fw.numpy(merge.merge_head(fw.tensor(x)))
    alone = fw.numpy(merge.merge(fw.tensor(x[:, :n])))
    assert merged.shape == (b, m + text, 4)
    np.testing.assert_allclose(merged[:, :m], alone, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(merged[:, m:], x[:, n:])  # the text, untouched
    back = fw.numpy(merge.unmerge_head(fw.tensor(merged)))
    np.testing.assert_array_equal(back[:, n:], x[:, n:])
    np.testing.assert_allclose(back[:, :n], fw.numpy(merge.unmerge(fw.tensor(alone))), rtol=1e-6, atol=1e-6)
    spread = fw.numpy(merge.spread(fw.tensor(x), head=True))
    np.testing.assert_array_equal(spread[:, n:], 0 * x[:, n:])  # the text has no residual
    np.testing.assert_allclose(spread[:, :n], x[:, :n] - back[:, :n], rtol=1e-6, atol=1e-6)
    assert np.abs(spread[:, :n]).max() > 0.1
    # Without text, the image alone.
    np.testing.assert_allclose(fw.numpy(merge.merge_head(fw.tensor(x[:, :n]))), alone, rtol=1e-6, atol=1e-6)
