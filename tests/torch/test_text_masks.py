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


@pytest.fixture
def model():
    reason = missing_host(FAMILIES["hunyuan_video15"])
    if reason:
        pytest.skip(reason)
    return hunyuan_video15().eval()


def test_a_padded_prompt_gives_the_unpadded_prompts_image_under_tome(model):
    """HunyuanVideo 1.5: 3 prompt tokens and 3 masked padding tokens give what the 3 tokens alone give, merged
    (the processor pads the text's mask to the merged query length itself, so padding stays out)."""
    padded = hunyuan_video15_inputs(model, text=6, valid=3)
    short = dict(padded, encoder_hidden_states=padded["encoder_hidden_states"][:, :3],
                 encoder_attention_mask=padded["encoder_attention_mask"][:, :3])
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


def test_downsample_is_refused_by_name(model):
    with pytest.raises(ValueError, match="HunyuanVideo15TransformerBlock.*mode='merge'"):
        tomesd.apply_patch(model, mode="downsample")


def test_prx_padded_prompt_gives_the_unpadded_prompts_image_under_tome():
    """PRX: its processor joins [text mask, ones for the image queries it is given], so 4 prompt tokens and 2 masked
    padding tokens give, merged, what the 4 tokens alone give."""
    reason = missing_host(FAMILIES["prx"])
    if reason:
        pytest.skip(reason)
    model = prx().eval()
    padded = prx_inputs(model, text=6, valid=4)
    short = prx_inputs(model, text=6)
    short["encoder_hidden_states"] = short["encoder_hidden_states"][:, :4]
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


def test_mochi_padded_prompt_gives_the_unpadded_prompts_video_under_tome():
    """Mochi: its processor keeps each sample's valid text by the mask and joins it after the image queries it is
    given, so 5 prompt tokens and 3 masked padding tokens give, merged, what the 5 tokens alone give."""
    reason = missing_host(FAMILIES["mochi"])
    if reason:
        pytest.skip(reason)
    model = mochi().eval()
    padded = mochi_inputs(model, text=8, valid=5)
    short = dict(padded, encoder_hidden_states=padded["encoder_hidden_states"][:, :5],
                 encoder_attention_mask=padded["encoder_attention_mask"][:, :5])
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
