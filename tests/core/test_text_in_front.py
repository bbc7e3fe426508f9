"""A sequence with text in front of the image (Flux's single blocks): merge_tail and unmerge_tail keep the text as it
is and merge the image as alone. A merge from a matching with the matcher's memo does it over one map of the whole
sequence (TokenMerge._whole_rows); without a memo, by slicing and joining. Both give the same values, on each backend
(`fw`), for a batch of one and of several, twice from one merge (the map kept) and from a second merge (the memo's
constants reused)."""
import numpy as np
import pytest

from tome_core import compute_merges


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("text", [1, 5])
def test_text_in_front_passes_whole_and_the_image_merges_as_alone(fw, batch, text):
    gen = np.random.default_rng(0)
    h, w, c = 4, 6, 4
    metric = fw.tensor(gen.standard_normal((batch, h * w, 8)).astype(np.float32))
    memo = {}
    for _ in range(2):  # the second merge reads the memo's constants
        whole = compute_merges(fw.xp, metric, w, h, 2, 2, [10], memo=memo)[10]
        sliced = compute_merges(fw.xp, metric, w, h, 2, 2, [10])[10]
        m = whole.num_merged
        assert m < h * w  # tokens did merge
        x = gen.standard_normal((batch, text + h * w, c)).astype(np.float32)
        for _ in range(2):  # the map, built once, serves the merge and the unmerge
            merged = fw.numpy(whole.merge_tail(fw.tensor(x)))
            np.testing.assert_array_equal(merged, fw.numpy(sliced.merge_tail(fw.tensor(x))))
            np.testing.assert_array_equal(merged[:, :text], x[:, :text])
            np.testing.assert_array_equal(merged[:, text:], fw.numpy(sliced.merge(fw.tensor(x[:, text:]))))
            assert not np.allclose(merged[:, text:text + m], x[:, text:text + m])  # merging changed the image
            y = gen.standard_normal((batch, text + m, c)).astype(np.float32)
            back = fw.numpy(whole.unmerge_tail(fw.tensor(y)))
            np.testing.assert_array_equal(back, fw.numpy(sliced.unmerge_tail(fw.tensor(y))))
            np.testing.assert_array_equal(back[:, :text], y[:, :text])
