"""TokenMerge.placed: a matching of N image tokens placed in a longer sequence at a start per sample (a unified
sequence: Lumina 2's [text_b, image, padding], Z-Image's [image, padding, caption]), every other token passing
whole and in place. Merging equals, sample by sample, the text as it was, the image merged alone, the rest as it
was; unmerging gives every passing token back bit for bit; rotary rows and a padding mask follow. On each backend
(`fw`), for one map shared by the batch and for one map per sample."""
import numpy as np
import pytest

from tome_core import compute_coordinate_merges


def _merge(fw, metric, per_sample):
    h, w = 4, 6
    rows, cols = np.divmod(np.arange(h * w), w)
    coords = (fw.tensor(rows.astype(np.int64)), fw.tensor(cols.astype(np.int64)))
    return compute_coordinate_merges(fw.xp, fw.tensor(metric), coords, (2, 2), [10], None, per_sample=per_sample)[10]


@pytest.mark.parametrize("per_sample", [True, False])
def test_the_image_merges_where_each_sample_has_it_and_the_rest_passes_in_place(fw, per_sample):
    gen = np.random.default_rng(0)
    b, n, total, starts = 2, 24, 33, [5, 2]  # sample 0: 5 text tokens, image, 4 after; sample 1: 2, image, 7 after
    merge = _merge(fw, gen.standard_normal((b, n, 8)).astype(np.float32), per_sample)
    m, r = merge.num_merged, n - merge.num_merged
    placed = merge.placed(fw.tensor(np.array(starts, np.int64)), total)
    assert (placed.num_tokens, placed.num_merged) == (total, total - r) and r > 0
    x = gen.standard_normal((b, total, 4)).astype(np.float32)
    image = np.stack([x[i, s:s + n] for i, s in enumerate(starts)])
    alone = fw.numpy(merge.merge(fw.tensor(image)))
    merged = fw.numpy(placed.merge_tail(fw.tensor(x)))
    for i, s in enumerate(starts):
        np.testing.assert_array_equal(merged[i, :s], x[i, :s])
        np.testing.assert_allclose(merged[i, s:s + m], alone[i], rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(merged[i, s + m:], x[i, s + n:])
    back = fw.numpy(placed.unmerge_tail(fw.tensor(merged)))
    image_back = fw.numpy(merge.unmerge(fw.tensor(alone)))
    for i, s in enumerate(starts):
        np.testing.assert_array_equal(back[i, :s], x[i, :s])
        np.testing.assert_array_equal(back[i, s + n:], x[i, s + n:])
        np.testing.assert_allclose(back[i, s:s + n], image_back[i], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("per_sample", [True, False])
def test_rotary_rows_and_a_padding_mask_follow_the_representatives(fw, per_sample):
    gen = np.random.default_rng(1)
    b, n, total, starts = 2, 24, 30, [4, 0]
    merge = _merge(fw, gen.standard_normal((b, n, 8)).astype(np.float32), per_sample)
    m, r = merge.num_merged, n - merge.num_merged
    placed = merge.placed(fw.tensor(np.array(starts, np.int64)), total)
    table = np.broadcast_to(np.arange(total, dtype=np.float32)[None, :, None], (b, total, 2)).copy()  # row i holds i
    rows = fw.numpy(placed.gather_rows(fw.tensor(table), 1))
    reps = fw.numpy(merge.representatives)
    reps = np.broadcast_to(reps, (b, m)) if reps.ndim == 1 else reps
    for i, s in enumerate(starts):
        expected = np.concatenate([np.arange(s), s + reps[i], np.arange(s + n, total)]).astype(np.float32)
        np.testing.assert_array_equal(rows[i, :, 0], expected)
    mask = np.zeros((b, total), np.float32)
    mask[0, :starts[0] + n + 1] = 1  # sample 0: one real token after the image, then padding
    mask[1, :starts[1] + n] = 1
    fitted = fw.numpy(placed.gather_rows(fw.tensor(mask), 1))
    np.testing.assert_array_equal(fitted[0], (np.arange(total - r) < starts[0] + m + 1).astype(np.float32))
    np.testing.assert_array_equal(fitted[1], (np.arange(total - r) < starts[1] + m).astype(np.float32))
