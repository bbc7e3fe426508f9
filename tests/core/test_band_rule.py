"""The band rule (tome_core/bands.py) on every backend: P bands matched on their own, one global dst draw
sliced per band, and a rank's view of its band equal to that band's part of the one-process merge."""
import numpy as np
import pytest

from tome_core import (band_coordinate_merges, band_range, banded_coordinate_merges, banded_grid_merges,
                       compute_coordinate_merges, compute_merges, coordinate_partition, rng)

H, W = 6, 8  # 48 tokens; 2 bands of 3 rows meet inside a 2-row cell, 3 bands of 2 rows are whole cells


def _inputs(fw, frames=1):
    n = frames * H * W
    metric = fw.tensor(np.random.default_rng(0).standard_normal((2, n, 8)).astype(np.float32))
    token = np.arange(n)
    coords = tuple(fw.tensor(a) for a in (token // W % H, token % W)) if frames == 1 else tuple(
        fw.tensor(a) for a in (token // (H * W), token // W % H, token % W))
    cells = n // 4
    offsets = rng.randint(fw.xp, coords[0], [cells], 4, 7)
    return metric, coords, offsets


@pytest.mark.parametrize("per_sample", [False, True])
def test_one_band_is_the_whole_grid(fw, per_sample):
    metric, coords, offsets = _inputs(fw)
    whole = compute_coordinate_merges(fw.xp, metric, coords, (2, 2), [12], offsets, per_sample=per_sample)[12]
    banded = banded_coordinate_merges(fw.xp, metric, coords, (2, 2), [12], offsets, 1, per_sample)[12]
    np.testing.assert_array_equal(fw.numpy(banded.sample_rows()), fw.numpy(whole.sample_rows()))
    np.testing.assert_array_equal(fw.numpy(banded.representatives), fw.numpy(whole.representatives))
    # The bands' merge knows its counts (a sum times them), the whole grid's takes torch's own mean: round-off apart
    np.testing.assert_allclose(fw.numpy(banded.merge(metric)), fw.numpy(whole.merge(metric)), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("per_sample", [False, True])
@pytest.mark.parametrize("bands", [2, 3, 4])
def test_each_band_merges_its_own_tokens_and_a_rank_sees_its_part(fw, bands, per_sample):
    metric, coords, offsets = _inputs(fw)
    n, r = H * W, int(H * W // bands * 0.5)
    joined = banded_coordinate_merges(fw.xp, metric, coords, (2, 2), [r], offsets, bands, per_sample)[r]
    merged = fw.numpy(joined.merge(metric))
    size, kept = n // bands, n // bands - r
    assert merged.shape == (2, bands * kept, 8)
    rows = fw.numpy(joined.sample_rows())
    for index in range(bands):
        start, stop = band_range(n, bands, index)
        # Band k's tokens go to band k's rows only: no token merges across a band boundary.
        assert set(rows[0, start:stop]) == set(range(index * kept, (index + 1) * kept))
        # A rank holding band k alone computes that part of the one-process merge.
        own = band_coordinate_merges(fw.xp, metric[:, start:stop], coords, (2, 2), [r], offsets, (start, stop),
                                     per_sample)[r]
        # (round-off apart: the joined merge knows its counts, a sum times them; a band alone takes torch's mean)
        np.testing.assert_allclose(fw.numpy(own.merge(metric[:, start:stop])), merged[:, index * kept:(index + 1) * kept],
                                   rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(fw.numpy(own.representatives) + start,
                                      fw.numpy(joined.representatives)[..., index * kept:(index + 1) * kept])


def test_the_dst_pattern_is_the_whole_grids_draw_sliced(fw):
    """Bands of whole cells keep exactly the whole grid's dst tokens, whatever the band count."""
    _, coords, offsets = _inputs(fw)
    n = H * W
    order, _, num_dst = coordinate_partition(fw.xp, coords, (2, 2), offsets)
    whole = set(fw.numpy(order)[n - num_dst:])
    for bands in (1, 3):  # 3 bands of 2 rows: whole cells
        dst = set()
        for index in range(bands):
            start, stop = band_range(n, bands, index)
            order, _, num_dst = coordinate_partition(fw.xp, coords, (2, 2), offsets, band=(start, stop))
            dst |= {start + t for t in fw.numpy(order)[stop - start - num_dst:]}
        assert dst == whole


def test_bands_of_a_video_cut_inside_a_frame(fw):
    """Wan's sequence (frames, rows, cols) in 2 bands meeting inside frame 1: each band merges its share."""
    metric, coords, offsets = _inputs(fw, frames=3)  # coords: (frame, row, col)
    joined = banded_coordinate_merges(fw.xp, metric, coords, (1, 2, 2), [18], offsets, 4)[18]
    assert fw.numpy(joined.merge(metric)).shape == (2, 4 * (36 - 18), 8)


def test_grid_bands_are_rows_of_the_patch_grid(fw):
    metric, _, offsets = _inputs(fw)
    whole = compute_merges(fw.xp, metric, W, H, 2, 2, [12], offsets)[12]
    one = banded_grid_merges(fw.xp, metric, W, H, 2, 2, [12], offsets, 1)[12]
    np.testing.assert_allclose(fw.numpy(one.merge(metric)), fw.numpy(whole.merge(metric)), rtol=1e-6, atol=1e-6)
    three = banded_grid_merges(fw.xp, metric, W, H, 2, 2, [8], offsets, 3)[8]
    rows = fw.numpy(three.sample_rows())
    for index in range(3):  # every sample's band k goes to band k's rows
        assert set(rows[:, index * 16:(index + 1) * 16].ravel()) == set(range(index * 8, (index + 1) * 8))
    with pytest.raises(ValueError, match="does not split into 2 bands of whole 2-row cells"):
        banded_grid_merges(fw.xp, metric, W, H, 2, 2, [8], offsets, 2)


def test_uneven_bands_are_refused(fw):
    with pytest.raises(ValueError, match="48 tokens do not split into 5 equal bands"):
        band_range(48, 5, 0)
