"""Transformers whose blocks join [image, text] with the image first under a key mask over both (kinds_image_first.py:
HunyuanVideo, its Framepack, HunyuanImage 2.1; HiDream-I1's mask over a non-square image's padding): the mask is
sliced to the merged keys (key_masks.MaskSlice), the single blocks merge the first N tokens of the joined sequence
(Span.image_first, Sublayer.image_first), condition tokens before the target's pass whole, and what cannot run is
refused by name."""
import pytest
import torch

import tomesd
from families import FAMILIES, missing_host
from probes import assert_padding_changes_nothing_under_tome
from tiny_image_first_families import (framepack, framepack_history, framepack_inputs, hidream, hidream_inputs,
                                       hunyuan_image, hunyuan_image_inputs, hunyuan_video, hunyuan_video_inputs,
                                       motif_video, motif_video_inputs)
from tiny_video_families import run

TOL = 1e-5
BUILDS = {"hunyuan-video": (hunyuan_video, hunyuan_video_inputs),
          "hunyuan-image": (hunyuan_image, hunyuan_image_inputs), "framepack": (framepack, framepack_inputs),
          "motif-video": (motif_video, motif_video_inputs)}


def _skip_without(name):
    reason = missing_host(FAMILIES[name])
    if reason:
        pytest.skip(reason)


@pytest.mark.parametrize("name", sorted(BUILDS))
def test_a_padded_prompt_gives_the_unpadded_prompts_output_under_tome(name):
    """3 prompt tokens and 3 masked padding tokens after them give, merged, what the 3 tokens alone give (a batch of
    2: each sample's rotary rows applied at the attention dispatch, to the first tokens of [image, text])."""
    _skip_without(name)
    build, inputs = BUILDS[name]
    model = build().eval()
    padded = inputs(model, text=6, valid=3)
    short = dict(padded, encoder_hidden_states=padded["encoder_hidden_states"][:, :3],
                 encoder_attention_mask=padded["encoder_attention_mask"][:, :3])
    assert_padding_changes_nothing_under_tome(model, run, padded, short, [0, 1], TOL)  # the double and single block


def _token_replace():
    """HunyuanVideo-I2V's model (image_condition_type='token_replace'), where this diffusers has it."""
    import inspect

    from diffusers import HunyuanVideoTransformer3DModel

    if "image_condition_type" not in inspect.signature(HunyuanVideoTransformer3DModel.__init__).parameters:
        pytest.skip("this diffusers' HunyuanVideo has no image-to-video blocks (env (a), current diffusers, runs it)")
    return hunyuan_video(image_condition_type="token_replace")


# (family, the model, its inputs, condition tokens before the target's, the target's tokens, text tokens): Framepack's
# history (clean, 2x, 4x latents); HunyuanVideo-I2V's first frame (8 x 8 tokens of 3 frames, patch 1).
CONDITIONED = {
    "framepack": (framepack, lambda model: framepack_inputs(model), framepack_history(8, 8), 2 * 4 * 4, 4 + 6),
    "token_replace": (_token_replace, lambda model: hunyuan_video_inputs(model, frames=3), 8 * 8, 2 * 8 * 8, 6),
}


@pytest.mark.parametrize("name", sorted(CONDITIONED))
def test_condition_tokens_before_the_target_pass_whole_in_every_block(name):
    """Framepack's history and HunyuanVideo-I2V's condition frame precede the target's tokens in each block's input:
    the attention of the double block and of the single block (inside its span, [condition, target, text]) gets them
    exactly as the block made them, before the merged target, and the text after; the target merged."""
    _skip_without("framepack" if name == "framepack" else "hunyuan-video")
    build, inputs, head, target, text = CONDITIONED[name]
    model = build()
    double, single = model.transformer_blocks[0], model.single_transformer_blocks[0]
    made, given = {}, {}

    def keep(record, name, value):
        record[name] = value  # (returns None: the hooks change nothing)

    hooks = [double.norm1.register_forward_hook(lambda m, a, out: keep(made, "double", out[0])),
             single.norm.register_forward_hook(lambda m, a, out: keep(made, "single", out[0]))]
    for block, attn in (("double", double.attn), ("single", single.attn)):  # what the attention projects
        hooks.append(attn.to_q.register_forward_pre_hook(lambda m, a, block=block: keep(given, block, a[0])))
    tomesd.apply_patch(model, ratio=0.5)  # after the test's hooks: they see the norms' outputs before ToMe merges
    try:
        with tomesd.observe(model) as seen:
            run(model, inputs(model))
    finally:
        tomesd.remove_patch(model)
        for hook in hooks:
            hook.remove()
    assert seen.calls[0].merged_blocks("attn") == [0, 1]
    for block in ("double", "single"):
        joined = given[block]  # the double block's image alone; the single block's [condition, target, text]
        image = joined.shape[1] - (text if block == "single" else 0)
        assert head < image < head + target  # the target merged
        assert torch.equal(joined[:, :head], made[block][:, :head])
        if block == "single":  # the text passes too
            assert torch.equal(joined[:, image:], made[block][:, head + target:])


def test_an_image_to_video_call_of_its_condition_frame_alone_is_refused_by_name():
    model = _token_replace()
    tomesd.apply_patch(model, ratio=0.5)
    try:
        with pytest.raises(ValueError, match="first latent frame is the condition image.*remove_patch"):
            run(model, hunyuan_video_inputs(model, frames=1))
    finally:
        tomesd.remove_patch(model)


@pytest.mark.parametrize("option, cause", [(dict(mode="downsample"), "mode='downsample' cannot run on "
                                                                      "HunyuanVideoTransformerBlock.*mode='merge'"),
                                           (dict(proportional_attention=True), "HunyuanVideoTransformerBlock.*mask.*"
                                                                               "proportional_attention=False")])
def test_what_the_mask_rules_out_is_refused_by_name(option, cause):
    _skip_without("hunyuan-video")
    with pytest.raises(ValueError, match=cause):
        tomesd.apply_patch(hunyuan_video(), **option)


def test_hidreams_padded_image_tokens_pass_whole_and_their_keys_stay_masked(monkeypatch):
    """A non-square latent: HiDream pads its image tokens to max_seq and zeroes the padding's keys by
    hidden_states_masks. Merged, the double block's attention projects [merged image, padding] with the padding's
    tokens as the block made them, and the mask, sliced to the merged image, still zeroes exactly the padding's keys."""
    _skip_without("hidream")
    model = hidream()
    image, padding, text = 8 * 6, 64 - 8 * 6, 6 + 6 + 6  # 16 x 12 latent pixels, patch 2; max_resolution 16 x 16
    block = model.double_stream_blocks[0].block
    seen, keys = {}, []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording(query, key, value, **kwargs):
        keys.append(key)
        return sdpa(query, key, value, **kwargs)

    hook = block.attn1.to_q.register_forward_pre_hook(lambda m, a: seen.__setitem__("q", a[0]))
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    inputs = hidream_inputs(model, h=16, w=12)
    try:
        run(model, inputs)
        plain, keys[:] = seen["q"], []
        tomesd.apply_patch(model, ratio=0.5)
        try:
            run(model, inputs)
        finally:
            tomesd.remove_patch(model)
    finally:
        hook.remove()
    merged = seen["q"].shape[1] - padding
    assert merged < image  # the image merged
    assert torch.equal(seen["q"][:, merged:], plain[:, image:])  # the padding, whole
    key = keys[0]  # the double block's: [B, heads, merged + padding + text, D]
    assert key.shape[2] == merged + padding + text
    assert (key[:, :, merged:merged + padding] == 0).all()  # the padding's keys masked
    assert (key[:, :, :merged].abs().sum(-1) > 0).all()  # the merged image's not




@pytest.mark.parametrize("name, image, grid", [("hunyuan-video", 2 * 8 * 8, dict(frames=2, h=8, w=8)),
                                               ("hidream", 8 * 6, dict(h=16, w=12))])
def test_restore_tokens_keeps_no_residual_for_the_tokens_after_the_image(name, image, grid):
    """restore_tokens' unmerged step keeps each site's residual: where the image comes first in a site's output
    (HunyuanVideo's single-block span, [image, text]; HiDream's sites over [image, padding (, text)]), the tokens after
    it have none, and the image's is not zero."""
    _skip_without(name)
    family = FAMILIES[name]
    model = family.build()
    tomesd.apply_patch(model, ratio=0.5, reuse_steps=2, restore_tokens=True)
    try:
        run(model, family.inputs(model, **grid))  # the window's first step: unmerged, keeping residuals
        residuals = [spread for _, spread in model._tome_patch.matcher.steps.cache.residuals.values()]
    finally:
        tomesd.remove_patch(model)
    joined = [spread for spread in residuals if spread.shape[1] > image]
    assert joined  # sites whose output holds more than the image
    for spread in joined:
        assert (spread[:, image:] == 0).all() and (spread[:, :image].abs().amax() > 1e-3)


def test_motif_videos_decoder_blocks_merge_its_stream_and_pass_the_encoders_tokens_whole():
    """Motif-Video's decoder blocks (num_decoder_layers) are single blocks joining [decoder stream, encoder's output]
    with no mask: the decoder stream (the block's own input) merges, the encoder's output tokens, in the place of the
    text, reach the attention exactly as the block's norm made them."""
    _skip_without("motif-video")
    model = motif_video(num_single_layers=2, num_decoder_layers=1)
    decoder = model.single_transformer_blocks[1]
    made, given = [], []
    hooks = [decoder.norm.register_forward_hook(lambda m, a, out: made.append(out[0])),
             decoder.attn.to_q.register_forward_pre_hook(lambda m, a: given.append(a[0]))]
    tomesd.apply_patch(model, ratio=0.5)  # after the test's hooks: they see the norm's output before ToMe merges
    try:
        with tomesd.observe(model) as seen:
            run(model, motif_video_inputs(model))
    finally:
        tomesd.remove_patch(model)
        for hook in hooks:
            hook.remove()
    tokens = 2 * 8 * 8
    assert seen.calls[0].merged_blocks("attn") == [0, 1, 2]
    assert made[0].shape[1] == 2 * tokens and given[0].shape[1] < 2 * tokens  # the decoder stream merged
    assert torch.equal(given[0][:, -tokens:], made[0][:, -tokens:])


def test_motif_videos_single_block_text_cross_attention_is_refused_by_name_and_merge_attn_false_runs():
    """Built with enable_text_cross_attention_single=True, a single block's text cross-attention takes the joint
    attention's output, merged inside the span, with the unmerged rotary rows (a shape error without the refusal):
    refused at apply time, naming merge_attn=False, under which the double block's feed-forward merges."""
    _skip_without("motif-video")
    model = motif_video(enable_text_cross_attention_single=True)
    with pytest.raises(ValueError, match="enable_text_cross_attention_single=True.*merge_attn=False"):
        tomesd.apply_patch(model, ratio=0.5)
    assert not model._forward_pre_hooks
    inputs = motif_video_inputs(model)
    base = run(model, inputs)
    tomesd.apply_patch(model, ratio=0.5, merge_attn=False, merge_mlp=True)
    try:
        with tomesd.observe(model) as seen:
            out = run(model, inputs)
    finally:
        tomesd.remove_patch(model)
    assert seen.calls[0].merged_blocks("mlp") == [0]
    assert (out - base).abs().max().item() > 1000 * TOL


@pytest.mark.parametrize("config", [{}, dict(enable_text_cross_attention_dual=True)])
def test_motif_videos_image_to_video_call_and_double_block_cross_attention_keep_a_padded_prompt_exact(config):
    """Motif-Video's image-to-video call joins its image embedding before the text (under ones in the mask), and a
    double block's optional text cross-attention takes the joint attention's unmerged output: a padded prompt still
    gives, merged, what the unpadded one gives."""
    _skip_without("motif-video")
    model = motif_video(**config).eval()
    padded = motif_video_inputs(model, text=6, valid=3, image=True)
    short = dict(padded, encoder_hidden_states=padded["encoder_hidden_states"][:, :3],
                 encoder_attention_mask=padded["encoder_attention_mask"][:, :3])
    base = run(model, short)
    tomesd.apply_patch(model, ratio=0.5)
    try:
        merged_short, merged_padded = run(model, short), run(model, padded)
    finally:
        tomesd.remove_patch(model)
    assert (merged_short - base).abs().max().item() > 1000 * TOL
    torch.testing.assert_close(merged_padded, merged_short, atol=TOL, rtol=TOL)
