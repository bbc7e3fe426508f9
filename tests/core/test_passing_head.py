"""TokenMerge.merge_head / unmerge_head / spread(head=True): a sequence whose first N tokens are the image and whose
text follows (HunyuanVideo's single blocks join [image, text]): the image merges as alone, the text passes whole and
comes back as it was. TokenMerge.with_passing_head: condition tokens before the target's (Framepack's history) pass
whole, each its own row. On each backend (`fw`), for one map shared by the batch and for one map per sample."""
import numpy as np
import pytest

from tome_core import compute_coordinate_merges


def _merge(fw, gen, b, h, w, per_sample):
    rows, cols = np.divmod(np.arange(h * w), w)
    coords = (fw.tensor(rows.astype(np.int64)), fw.tensor(cols.astype(np.int64)))
    metric = fw.tensor(gen.standard_normal((b, h * w, 8)).astype(np.float32))
    return compute_coordinate_merges(fw.xp, metric, coords, (2, 2), [10], None, per_sample=per_sample)[10]


@pytest.mark.parametrize("per_sample", [True, False])
def test_the_first_n_tokens_merge_as_alone_and_the_text_after_them_passes(fw, per_sample):
    gen = np.random.default_rng(0)
    b, h, w, text = 2, 4, 6, 5
    n = h * w
    merge = _merge(fw, gen, b, h, w, per_sample)
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


@pytest.mark.parametrize("per_sample", [True, False])
def test_a_passing_head_stays_whole_before_the_target_which_merges_as_alone(fw, per_sample):
    """[head, target, text] (Framepack's single blocks): merging the first head + N tokens keeps the head's and the
    text's tokens as they are and merges the target's as alone; the head's rotary rows stay its own."""
    gen = np.random.default_rng(2)
    b, h, w, head, text = 2, 4, 6, 7, 3
    n = h * w
    merge = _merge(fw, gen, b, h, w, per_sample)
    joined = merge.with_passing_head(head)
    m = merge.num_merged
    assert (joined.num_tokens, joined.num_merged) == (head + n, head + m) and m < n
    x = gen.standard_normal((b, head + n + text, 4)).astype(np.float32)
    merged = fw.numpy(joined.merge_head(fw.tensor(x)))
    np.testing.assert_array_equal(merged[:, :head], x[:, :head])
    np.testing.assert_allclose(merged[:, head:head + m], fw.numpy(merge.merge(fw.tensor(x[:, head:head + n]))),
                               rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(merged[:, head + m:], x[:, head + n:])
    back = fw.numpy(joined.unmerge_head(fw.tensor(merged)))
    np.testing.assert_array_equal(back[:, :head], x[:, :head])
    np.testing.assert_array_equal(back[:, head + n:], x[:, head + n:])
    rows = fw.numpy(joined.sample_rows())  # no merged row holds a head token and a target token
    assert not set(rows[:, :head].ravel().tolist()) & set(rows[:, head:].ravel().tolist())
    table = np.arange(head + n, dtype=np.float32)[:, None] * np.ones((1, 2), np.float32)  # row i holds i
    gathered = fw.numpy(joined.gather_rows(fw.tensor(table), 0))
    alone = fw.numpy(merge.gather_rows(fw.tensor(table[head:]), 0))  # the target's rows, by their number
    if gathered.ndim == 3:  # one table per sample
        np.testing.assert_array_equal(gathered[:, :head, 0], np.tile(np.arange(head), (b, 1)))
        np.testing.assert_array_equal(gathered[:, head:], alone)
    else:
        np.testing.assert_array_equal(gathered[:head, 0], np.arange(head))
        np.testing.assert_array_equal(gathered[head:], alone)
    assert merge.with_passing_head(0) is merge


@pytest.mark.parametrize("per_sample", [True, False])
def test_rotary_rows_over_image_then_text_follow_the_image_and_keep_the_texts(fw, per_sample):
    """Rows over [image, text] (HiDream's, with a batch axis, and without one): the image's first N become the merged
    rows' representatives' rows, the text's after them stay."""
    gen = np.random.default_rng(3)
    b, h, w, text = 2, 4, 6, 5
    n = h * w
    merge = _merge(fw, gen, b, h, w, per_sample)
    alone = fw.numpy(merge.gather_rows(fw.tensor(np.arange(n, dtype=np.float32)[:, None]), 0))
    for lead in ((), (b,)):  # [S, 1] and [B, S, 1] (rows along axis 1)
        table = np.broadcast_to(np.arange(n + text, dtype=np.float32)[:, None], lead + (n + text, 1)).copy()
        rows = fw.numpy(merge.gather_rows(fw.tensor(table), len(lead), image_first=True))
        image, after = rows[..., :merge.num_merged, 0], rows[..., merge.num_merged:, 0]
        np.testing.assert_array_equal(after, np.broadcast_to(np.arange(n, n + text), after.shape))
        np.testing.assert_array_equal(image, np.broadcast_to(alone[..., 0], image.shape))
