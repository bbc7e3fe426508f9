"""Several images in one sequence (tome_core/images.py), on each backend (`fw`): image_cells gives
coordinate_partition cells that are each image's own complete blocks, numbered with no gap, and on one image filling
a box the very partition of its own (row, col); every image with a complete cell keeps a dst; the matching with
`images` merges every src into a dst of its own image, even where a twin in another image is the closer match."""
import numpy as np
import pytest

from tome_core import compute_coordinate_merges, coordinate_partition, image_cells


def _box(first, h, w, row=0, col=0):
    rows, cols = np.meshgrid(np.arange(h) + row, np.arange(w) + col, indexing="ij")
    return np.stack([np.full(h * w, first), rows.ravel(), cols.ravel()], 1).astype(np.int64)


def _cells(fw, ids, sy, sx):
    return list(image_cells(fw.xp, *(fw.tensor(ids[:, k]) for k in range(3)), sy, sx))


def _partition(fw, coords, strides, offsets):
    order, position, num_dst = coordinate_partition(fw.xp, coords, strides, offsets)
    return fw.numpy(order), fw.numpy(position), num_dst


@pytest.mark.parametrize("h, w", [(1, 1), (2, 2), (3, 5), (5, 4), (8, 8), (7, 3)])
@pytest.mark.parametrize("sy, sx", [(1, 1), (2, 2), (1, 3), (3, 1), (2, 3)])
def test_one_box_gets_the_partition_of_its_own_rows_and_columns(fw, h, w, sy, sx):
    ids = _box(0, h, w, row=3, col=512)
    draws = np.random.default_rng(h * w + sy).integers(0, sy * sx, size=max(h * w // (sy * sx), 1))
    offsets = fw.tensor(draws.astype(np.int64))
    plain = _partition(fw, (fw.tensor(ids[:, 1]), fw.tensor(ids[:, 2])), (sy, sx), offsets)
    own = _partition(fw, _cells(fw, ids, sy, sx), (sy, sx), offsets)
    assert plain[2] == own[2]
    np.testing.assert_array_equal(plain[0], own[0])
    np.testing.assert_array_equal(plain[1], own[1])


SEVERAL = [
    [(0, 4, 4), (1, 4, 4)],  # Flux Kontext: a reference of the target's size
    [(0, 3, 5), (1, 5, 7)],  # odd sides, a larger reference
    [(0, 2, 2), (10, 5, 5), (20, 5, 5), (30, 6, 6)],  # Flux.2: a small target among larger odd references
    [(0, 6, 4), (10, 1, 9), (20, 3, 3)],  # a reference one row high: no complete cell
]


@pytest.mark.parametrize("images", SEVERAL)
@pytest.mark.parametrize("sy, sx", [(2, 2), (1, 2), (2, 1), (3, 2)])
def test_cells_are_each_images_own_complete_blocks(fw, images, sy, sx):
    ids = np.concatenate([_box(t, h, w) for t, h, w in images])
    n, volume = len(ids), sy * sx
    rows, cols = (fw.numpy(a) for a in _cells(fw, ids, sy, sx))
    rows, cols = rows - rows.min(), cols - cols.min()
    cells_h, cells_w = (rows.max() + 1) // sy, (cols.max() + 1) // sx
    inside = (rows < cells_h * sy) & (cols < cells_w * sx)  # coordinate_partition's complete cells
    number = (rows // sy) * cells_w + cols // sx
    expected = sum((h // sy) * (w // sx) for _, h, w in images)  # every image's complete blocks, no other
    assert sorted(set(number[inside])) == list(range(expected)) and expected <= n // volume
    for cell in range(expected):
        members = np.nonzero(inside & (number == cell))[0]
        assert len(members) == volume and len(set(ids[members, 0])) == 1  # whole, of one image
        block = {(r // sy, c // sx) for r, c in ids[members, 1:]}
        assert len(block) == 1  # one block of the image's own grid


@pytest.mark.parametrize("images", SEVERAL)
def test_every_image_with_a_complete_cell_keeps_a_dst(fw, images):
    ids = np.concatenate([_box(t, h, w) for t, h, w in images])
    n = len(ids)
    for seed in range(20):
        offsets = fw.tensor(np.random.default_rng(seed).integers(0, 4, size=n // 4).astype(np.int64))
        order, _, num_dst = _partition(fw, _cells(fw, ids, 2, 2), (2, 2), offsets)
        dst = set(order[n - num_dst:].tolist())
        for t, h, w in images:
            if h >= 2 and w >= 2:
                assert dst & set(np.nonzero(ids[:, 0] == t)[0].tolist())


@pytest.mark.parametrize("per_sample", [True, False])
@pytest.mark.parametrize("images", SEVERAL[:3])
def test_no_src_merges_into_another_images_dst(fw, images, per_sample):
    """The references' tokens are twins of the target's: a matching over every dst would pair them. r takes
    every src token."""
    ids = np.concatenate([_box(t, h, w) for t, h, w in images])
    n = len(ids)
    gen = np.random.default_rng(0)
    _, th, tw = images[0]
    target = gen.standard_normal((2, th, tw, 8)).astype(np.float32)
    metric = np.concatenate([target.reshape(2, th * tw, 8)] + [
        target[:, np.arange(h) % th][:, :, np.arange(w) % tw].reshape(2, h * w, 8) for _, h, w in images[1:]], 1)
    offsets = fw.tensor(gen.integers(0, 4, size=n // 4).astype(np.int64))
    coords, image = _cells(fw, ids, 2, 2), fw.tensor(ids[:, 0])
    for separated in (False, True):
        merge = compute_coordinate_merges(fw.xp, fw.tensor(metric), coords, (2, 2), [n], offsets,
                                          per_sample=per_sample, images=image if separated else None)[n]
        rows = fw.numpy(merge.sample_rows())
        crossing = sum(len(set(ids[sample == row, 0])) > 1 for sample in rows for row in np.unique(sample))
        assert merge.num_merged < n and (crossing == 0) == separated


def test_an_image_smaller_than_a_cell_merges_last(fw):
    """A reference one row high has no dst of its own: its tokens' edges come after every other src token's, so
    merging every src token but those keeps the images apart (merging them too could not)."""
    images = SEVERAL[3]
    ids = np.concatenate([_box(t, h, w) for t, h, w in images])
    n = len(ids)
    metric = np.random.default_rng(1).standard_normal((1, n, 8)).astype(np.float32)
    offsets = fw.tensor(np.random.default_rng(2).integers(0, 4, size=n // 4).astype(np.int64))
    coords, image = _cells(fw, ids, 2, 2), fw.tensor(ids[:, 0])
    order, _, num_dst = _partition(fw, coords, (2, 2), offsets)
    strip = set(np.nonzero(ids[:, 0] == 10)[0].tolist())
    assert not strip & set(order[n - num_dst:].tolist())  # no dst in the strip
    r = n - num_dst - len(strip)
    merge = compute_coordinate_merges(fw.xp, fw.tensor(metric), coords, (2, 2), [r], offsets, images=image)[r]
    rows = fw.numpy(merge.sample_rows())[0]
    assert all(len(set(ids[rows == row, 0])) == 1 for row in np.unique(rows))
    assert all((rows == rows[t]).sum() == 1 for t in strip)  # each strip token a row of its own
