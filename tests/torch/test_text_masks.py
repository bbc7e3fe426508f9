"""Self-attention given a mask over the text only (block kinds with mask="text"): ToMe merges the image tokens and
the mask still acts on the text after merging."""
import pytest
import torch

import tomesd
from families import FAMILIES, missing_host
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
    base = run(model, short)
    tomesd.apply_patch(model, ratio=0.5)
    try:
        with tomesd.observe(model) as seen:
            merged_short = run(model, short)
        merged_padded = run(model, padded)
    finally:
        tomesd.remove_patch(model)
    assert seen.calls[0].merged_blocks("attn") == [0, 1]
    assert (merged_short - base).abs().max().item() > 1000 * TOL  # ToMe changed the output
    torch.testing.assert_close(merged_padded, merged_short, atol=TOL, rtol=TOL)


def test_downsample_is_refused_by_name():
    with pytest.raises(ValueError, match="HunyuanVideo15TransformerBlock.*mode='merge'"):
        tomesd.apply_patch(_model("hunyuan_video15"), mode="downsample")
