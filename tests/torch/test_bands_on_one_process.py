"""bands=P on one process: each of P contiguous bands of a transformer's tokens merges on its own (what each
rank of a P-way context-parallel run does, tests/torch/test_context_parallel.py), with no host read, in one
graph; bands=1 is today's merge bit for bit; what cannot be banded is refused in the user's terms."""
import pytest
import torch
import torch._dynamo

import tiny_torch as T
import tomesd
from families import FAMILIES, missing_host

# Wan is in diffusers from 0.33: the paddle environment's 0.32 skips it, as the family contract does.
BANDED = [pytest.param(name, marks=pytest.mark.skipif(bool(missing_host(FAMILIES[name])),
                                                      reason=missing_host(FAMILIES[name])))
          for name in ("sd3", "flux", "wan", "ltx-video", "qwen-image")]


def _model_and_inputs(name):
    family = FAMILIES[name]
    model = family.build()
    return family, model, family.inputs(model)


@pytest.mark.parametrize("name", BANDED)
def test_one_band_is_todays_merge(name, unpatch):
    family, model, inputs = _model_and_inputs(name)
    unpatch(model)
    tomesd.apply_patch(model, ratio=0.5)
    today = family.run(model, inputs)
    tomesd.remove_patch(model)
    tomesd.apply_patch(model, ratio=0.5, bands=1)
    assert torch.equal(family.run(model, inputs), today)


@pytest.mark.parametrize("name", BANDED)
def test_each_band_merges_its_share_and_the_bands_differ_from_one_matching(name, unpatch):
    family, model, inputs = _model_and_inputs(name)
    unpatch(model)
    tomesd.apply_patch(model, ratio=0.5)
    whole = family.run(model, inputs)
    tomesd.remove_patch(model)
    tomesd.apply_patch(model, ratio=0.5, bands=2)
    with tomesd.observe(model) as seen:
        banded = family.run(model, inputs)
    block = seen.calls[0].blocks[0]
    (given, kept), = block.tokens("attn")[:1]
    assert kept == 2 * (given // 2 - int(given // 2 * 0.5))  # each band merged its own share
    assert (banded - whole).abs().max() > 1e-3  # bands are not one matching over the grid


@pytest.mark.parametrize("name", BANDED)
def test_bands_read_no_tensor_value_on_the_host(name, unpatch):
    family, model, inputs = _model_and_inputs(name)
    with torch.device("meta"):
        twin = type(model)(**model.config).eval()
    meta = {k: (v.to("meta") if torch.is_tensor(v) else v) for k, v in inputs.items()}
    tomesd.apply_patch(twin, ratio=0.5, bands=2)
    unpatch(twin)
    with tomesd.observe(twin) as seen:
        out = family.run(twin, meta)
    assert out.device.type == "meta" and seen.calls[0].merged_blocks("attn")


def test_bands_trace_as_one_graph(unpatch):
    torch._dynamo.reset()
    family, model, inputs = _model_and_inputs("flux")
    unpatch(model)
    tomesd.apply_patch(model, ratio=0.5, bands=2)
    explained = torch._dynamo.explain(lambda: family.run(model, inputs))()
    torch._dynamo.reset()
    assert explained.graph_break_count == 0 and explained.graph_count == 1


@pytest.mark.parametrize("value", [0, -2, True, 1.5, "2"])
def test_a_bad_band_count_names_bands(value):
    with pytest.raises(ValueError, match="bands must be a positive int"):
        tomesd.apply_patch(T.flux(), bands=value)


def test_bands_have_no_meaning_on_a_unet_or_in_downsample_mode():
    unet = T.unet()
    with pytest.raises(ValueError, match="bands has no meaning on UNet2DConditionModel.*Leave bands out"):
        tomesd.apply_patch(unet, bands=2)
    assert not hasattr(unet, "_tome_patch")
    with pytest.raises(ValueError, match="no meaning with mode='downsample'"):
        tomesd.apply_patch(T.flux(), mode="downsample", bands=2)
    with pytest.raises(TypeError):
        tomesd.ToDoConfig(bands=2)
    assert tomesd.ToMeConfig(bands=2).args.bands == 2


def test_a_patch_grid_that_does_not_split_in_whole_rows_is_refused_at_the_call():
    family, model, inputs = _model_and_inputs("sd3")  # an 8 x 8 patch grid
    tomesd.apply_patch(model, ratio=0.5, bands=3)
    with pytest.raises(ValueError, match="bands=3 splits the patch grid's 8 rows .* choose bands dividing 8"):
        family.run(model, inputs)


@pytest.mark.parametrize("name,embedder", [
    pytest.param(name, embedder, marks=pytest.mark.skipif(bool(missing_host(FAMILIES[name])),
                                                          reason=missing_host(FAMILIES[name])))
    for name, embedder in (("sd3", "pos_embed"), ("flux", "x_embedder"), ("wan", "patch_embedding"))])
def test_a_block_holding_a_share_of_the_tokens_is_refused_not_left_alone(name, embedder, unpatch):
    """A sequence split by something ToMe does not read (here: a hook keeping the first half of the embedded
    tokens, as an engine's split would) is refused at the first block, where SD3 used to leave every block
    alone silently."""
    family, model, inputs = _model_and_inputs(name)

    def first_half(module, args, output):
        if output.ndim == 5:  # Wan's patch embedding: [B, C, F, H, W], flattened to tokens after it
            return output[:, :, :, : output.shape[3] // 2]
        return output[:, : output.shape[1] // 2]

    getattr(model, embedder).register_forward_hook(first_half)
    tomesd.apply_patch(model, ratio=0.5)
    unpatch(model)
    with pytest.raises(ValueError, match=f"a block of {type(model).__name__} holds .* image tokens: the sequence "
                                         f"was split"):
        family.run(model, inputs)
