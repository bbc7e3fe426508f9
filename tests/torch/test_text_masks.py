"""Self-attention given a mask over the text only (block kinds with mask="text"): ToMe merges the image tokens and
the mask still acts on the text after merging."""
import pytest
import torch

import tomesd
from families import FAMILIES, missing_host
from probes import assert_padding_changes_nothing_under_tome
from tiny_hunyuan_families import hunyuan_video15, hunyuan_video15_inputs, mochi, mochi_inputs
from tiny_image_families import prx, prx_inputs
from tiny_video_families import run

TOL = 1e-5


def _hunyuan_video15(valid):
    padded = hunyuan_video15_inputs(text=6, valid=valid)
    return padded, dict(padded, encoder_hidden_states=padded["encoder_hidden_states"][:, :valid],
                        encoder_attention_mask=padded["encoder_attention_mask"][:, :valid])


def _prx(valid):
    short = prx_inputs(text=6)
    short["encoder_hidden_states"] = short["encoder_hidden_states"][:, :valid]
    return prx_inputs(text=6, valid=valid), short


def _mochi(valid):
    padded = mochi_inputs(text=8, valid=valid)
    return padded, dict(padded, encoder_hidden_states=padded["encoder_hidden_states"][:, :valid],
                        encoder_attention_mask=padded["encoder_attention_mask"][:, :valid])


# family: (its tiny model, (padded inputs, the same prompt unpadded) for `valid` prompt tokens). How each processor
# fits the text's mask to the image tokens it is given: HunyuanVideo 1.5 pads it on the left to the joined length,
# PRX joins [text mask, ones for the image queries], Mochi keeps each sample's valid text and joins it after them.
PADDED = {"hunyuan_video15": (hunyuan_video15, _hunyuan_video15), "prx": (prx, _prx), "mochi": (mochi, _mochi)}


def _model(name):
    reason = missing_host(FAMILIES[name])
    if reason:
        pytest.skip(reason)
    return PADDED[name][0]().eval()


@pytest.mark.parametrize("name", sorted(PADDED))
def test_a_padded_prompt_gives_the_unpadded_prompts_output_under_tome(name):
    """3 prompt tokens and masked padding tokens after them give, merged, what the 3 tokens alone give."""
    model = _model(name)
    padded, short = PADDED[name][1](3)
    assert_padding_changes_nothing_under_tome(model, run, padded, short, [0, 1], TOL)


def test_downsample_is_refused_by_name():
    with pytest.raises(ValueError, match="HunyuanVideo15TransformerBlock.*mode='merge'"):
        tomesd.apply_patch(_model("hunyuan_video15"), mode="downsample")


# Self-attention given a mask over [text, image] whose image part is all True, sliced to the merged image: Chroma's
# key-padding mask (ChromaPipeline._prepare_attention_mask: [text mask, ones for the image]), which each block squares
# into (query, key) pairs [B, 1, S, S] before its attention (BlockKind.mask "pairs_image_ones_last"), and Bria FIBO's
# [B, 1, 1, text + image] given in joint_attention_kwargs ("image_ones_last").
def _chroma(valid):
    from tiny_transformers import chroma_inputs

    padded = chroma_inputs(text=6, mask=True)
    padded["attention_mask"][:, valid:6] = False
    mask = padded["attention_mask"]
    return padded, dict(padded, encoder_hidden_states=padded["encoder_hidden_states"][:, :valid],
                        txt_ids=padded["txt_ids"][:valid], attention_mask=torch.cat([mask[:, :valid], mask[:, 6:]], 1))


def _bria_fibo(valid):
    from tiny_image_families import TEXT, bria_fibo_inputs

    padded = bria_fibo_inputs()
    mask = torch.ones(2, 1, 1, padded["hidden_states"].shape[1] + TEXT, dtype=torch.bool)
    mask[..., valid:TEXT] = False
    padded["joint_attention_kwargs"] = dict(attention_mask=mask)
    short = dict(padded, encoder_hidden_states=padded["encoder_hidden_states"][:, :valid],
                 text_encoder_layers=tuple(layer[:, :valid] for layer in padded["text_encoder_layers"]),
                 txt_ids=padded["txt_ids"][:valid])
    short["joint_attention_kwargs"] = dict(attention_mask=torch.cat([mask[..., :valid], mask[..., TEXT:]], -1))
    return padded, short


def _chroma_model():
    from tiny_transformers import chroma

    return chroma()


def _bria_fibo_model():
    from tiny_image_families import bria_fibo

    return bria_fibo()


# family: (its tiny model, (padded inputs, the same prompt unpadded), the blocks merged).
SLICED = {"chroma": (_chroma_model, _chroma, [0, 1, 2, 3]), "bria-fibo": (_bria_fibo_model, _bria_fibo, [0, 1])}


def _sliced_model(name):
    reason = missing_host(FAMILIES[name])
    if reason:
        pytest.skip(reason)
    return SLICED[name][0]().eval()


@pytest.mark.parametrize("name", sorted(SLICED))
def test_a_padded_prompt_under_a_mask_over_text_and_image_gives_the_unpadded_prompts_output(name):
    """3 prompt tokens and masked padding tokens after them give, merged, what the 3 tokens alone give: the mask's
    image part (rows and columns alike) is sliced to the merged image, exactly."""
    model = _sliced_model(name)
    padded, short = SLICED[name][1](3)
    torch.testing.assert_close(run(model, padded), run(model, short), atol=TOL, rtol=TOL)  # the host's own masking
    assert_padding_changes_nothing_under_tome(model, run, padded, short, SLICED[name][2], TOL)


@pytest.mark.parametrize("name", sorted(SLICED))
@pytest.mark.parametrize("option, cause", [(dict(mode="downsample", downsample_factor=2), "attention_mask.*'merge'"),
                                           (dict(ratio=0.5, proportional_attention=True),
                                            "attention mask.*proportional_attention=False")])
def test_what_a_sliced_mask_rules_out_is_refused_by_name_at_the_masked_call(name, option, cause):
    """mode='downsample' shrinks the image keys at the dispatch, where the mask over every key no longer fits; the
    key weights of proportional attention cannot join a mask. Both run on unmasked calls (the family contract)."""
    model = _sliced_model(name)
    tomesd.apply_patch(model, **option)
    try:
        with pytest.raises(ValueError, match=cause):
            run(model, SLICED[name][1](3)[0])
    finally:
        tomesd.remove_patch(model)
