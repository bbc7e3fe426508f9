"""A bare Flux or Flux.2 transformer fed a Kontext sequence (the target's tokens, then each reference's, every image
marked by the ids' first axis: Flux Kontext's 0 then 1, Flux.2's 0 then 10, 20, ...) merges each image's tokens
among themselves: no merged row holds tokens of two images, though tokens merged, with reference grids of other
sizes and odd sides, at a ratio that merges nearly every src token, and under the band rule; a target-only call merges
as it did before (the partition and the matching are the old ones, bit for bit); nothing is read on the host (a
meta-device forward runs) and dynamo traces one graph. Where the images cannot be kept apart (mode='downsample'),
the first call says so by name.

The references' latents repeat the target's (tiled), so each reference token has an exact twin in the target: a
matching that could cross images would pair them first."""
import pytest
import torch

import tiny_torch as T
import tiny_transformers as X
import tomesd
from probes import count_host_reads


def _grid(first, h, w, axes=3):
    rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    ids = torch.stack([torch.full((h * w,), first), rows.reshape(-1), cols.reshape(-1)], 1)
    return ids if axes == 3 else torch.cat([ids, torch.zeros(h * w, 1, dtype=ids.dtype)], 1)


def _tiled(target, h, w, th, tw):
    """A reference latent h x w whose token (r, c) is the target's (r mod th, c mod tw)."""
    grid = target.reshape(target.shape[0], th, tw, -1)
    rows, cols = torch.arange(h) % th, torch.arange(w) % tw
    return grid[:, rows][:, :, cols].reshape(target.shape[0], h * w, -1)


def flux_inputs(images, batch=2, seed=1):
    """A bare Flux call on a Kontext sequence: `images` [(first axis, h, w)], the target first."""
    _, th, tw = images[0]
    inputs = T.flux_inputs(batch=batch, h=th, w=tw, seed=seed)
    target = inputs["hidden_states"]
    inputs["hidden_states"] = torch.cat([target] + [_tiled(target, h, w, th, tw) for _, h, w in images[1:]], 1)
    inputs["img_ids"] = torch.cat([_grid(t, h, w) for t, h, w in images]).float()
    return inputs


def flux2_inputs(images, batch=2, seed=1):
    """A bare Flux.2 call: ids [B, N, 4] (t, row, col, 0); Flux2Pipeline's references have t = 10, 20, ..."""
    _, th, tw = images[0]
    inputs = X.flux2_inputs(batch=batch, h=th, w=tw, seed=seed)
    target = inputs["hidden_states"]
    inputs["hidden_states"] = torch.cat([target] + [_tiled(target, h, w, th, tw) for _, h, w in images[1:]], 1)
    ids = torch.cat([_grid(t, h, w, axes=4) for t, h, w in images])
    inputs["img_ids"] = ids[None].expand(batch, -1, -1)
    return inputs


FAMILIES = {"flux": (T.flux, flux_inputs, 1), "flux2": (X.flux2, flux2_inputs, 10)}
# (target h, w), then each reference's: one of the target's size, larger ones with odd sides, several
SHAPES = {
    "same": [(4, 4), (4, 4)],
    "odd": [(3, 5), (5, 7)],
    "several": [(4, 6), (5, 5), (3, 3)],
    "small_target": [(2, 2), (5, 5), (5, 5), (6, 6)],
}


def _images(family, shape):
    step = FAMILIES[family][2]
    return [(i * step, h, w) for i, (h, w) in enumerate(SHAPES[shape])]


def _image_of_token(images):
    return torch.cat([torch.full((h * w,), i) for i, (_, h, w) in enumerate(images)])


def _check_merges(seen, image_of):
    """(blocks that merged, merged rows holding tokens of two images) over every call and block observed."""
    merged = crossing = 0
    for call in seen.calls:
        for block in call.blocks.values():
            merges = block.merge if isinstance(block.merge, dict) else {"": block.merge}
            for merge in merges.values():
                if merge is None:
                    continue
                assert merge.num_tokens == image_of.shape[0]
                rows = merge.sample_rows()
                merged += int(merge.num_merged < merge.num_tokens)
                for sample in rows:
                    for row in sample.unique():
                        crossing += int(image_of[sample == row].unique().numel() > 1)
    return merged, crossing


def _run(model, inputs, **patch):
    tomesd.apply_patch(model, **patch)
    try:
        with tomesd.observe(model) as seen, torch.no_grad():
            out = model(**inputs, return_dict=False)[0]
    finally:
        tomesd.remove_patch(model)
    return out, seen


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("ratio", [0.5, 0.95])
def test_no_merged_row_holds_tokens_of_two_images(family, shape, ratio):
    build, make_inputs, _ = FAMILIES[family]
    images = _images(family, shape)
    model, inputs = build(), make_inputs(images)
    _, seen = _run(model, inputs, ratio=ratio)
    merged, crossing = _check_merges(seen, _image_of_token(images))
    assert merged > 0 and crossing == 0, (merged, crossing)


@pytest.mark.parametrize("bands", [2, 4])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_under_the_band_rule_no_merged_row_holds_tokens_of_two_images(family, bands):
    """bands=P (what each rank of a context-parallel run does): each band matched on its own, with the mask. The
    band boundaries fall inside images (76 tokens in bands of 38: the first reference's third row; 64 in bands of
    16: the target's third row, the first reference's second and fifth)."""
    build, make_inputs, step = FAMILIES[family]
    images = [(0, 4, 6), (step, 6, 6), (2 * step, 4, 4)]  # 76 tokens
    if bands == 4:
        images = [(0, 4, 6), (step, 6, 6), (2 * step, 2, 2)]  # 64 tokens
    model, inputs = build(), make_inputs(images)
    _, seen = _run(model, inputs, ratio=0.5, bands=bands)
    merged, crossing = _check_merges(seen, _image_of_token(images))
    assert merged > 0 and crossing == 0, (merged, crossing)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_target_only_call_merges_as_before(family):
    """The old path (the ids' rows and columns, no image mask: what a family that joins no references gets) and the
    separating one give the same merges and the same output, bit for bit."""
    build, make_inputs, _ = FAMILIES[family]
    model, inputs = build(), make_inputs([(0, 6, 8)])
    outs, rows = [], []
    for separates in (True, False):
        tomesd.apply_patch(model, ratio=0.5)
        model._tome_patch.layout.separates = separates
        try:
            with tomesd.observe(model) as seen, torch.no_grad():
                outs.append(model(**inputs, return_dict=False)[0])
        finally:
            tomesd.remove_patch(model)
        rows.append([block.merge.sample_rows() for call in seen.calls for block in call.blocks.values()
                     if block.merge is not None])
    assert rows[0] and len(rows[0]) == len(rows[1])
    assert all(torch.equal(a, b) for a, b in zip(*rows))
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_kontext_call_reads_no_tensor_value_on_the_host(family):
    build, make_inputs, _ = FAMILIES[family]
    images = _images(family, "odd")
    model, inputs = build(), make_inputs(images)
    tomesd.apply_patch(model, ratio=0.5)
    try:
        with torch.no_grad():
            _, reads = count_host_reads(lambda: model(**inputs, return_dict=False)[0])
    finally:
        tomesd.remove_patch(model)
    assert reads == 0
    with torch.device("meta"):
        twin = type(model)(**model.config).eval()
    tomesd.apply_patch(twin, ratio=0.5)
    meta = {k: (v.to("meta") if torch.is_tensor(v) else v) for k, v in inputs.items()}
    try:
        with tomesd.observe(twin) as seen, torch.no_grad():
            out = twin(**meta, return_dict=False)[0]
    finally:
        tomesd.remove_patch(twin)
    assert out.device.type == "meta" and out.shape == inputs["hidden_states"].shape
    assert any(block.merge is not None for call in seen.calls for block in call.blocks.values())


def test_dynamo_traces_a_kontext_call_in_one_graph():
    images = _images("flux", "odd")
    model, inputs = T.flux(), flux_inputs(images)
    tomesd.apply_patch(model, ratio=0.5)
    try:
        with torch.no_grad():
            explained = torch._dynamo.explain(model)(**inputs, return_dict=False)
    finally:
        tomesd.remove_patch(model)
        torch._dynamo.reset()
    assert explained.graph_break_count == 0 and explained.graph_count == 1


def test_downsample_mode_refuses_several_images_by_name():
    images = _images("flux", "same")
    model, inputs = T.flux(), flux_inputs(images)
    tomesd.apply_patch(model, mode="downsample")
    try:
        with pytest.raises(ValueError, match="mode='downsample' cannot keep apart the images"), torch.no_grad():
            model(**inputs)
    finally:
        tomesd.remove_patch(model)
