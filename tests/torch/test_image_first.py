"""Transformers whose blocks join [image, text] with the image first under the root's key-padding mask over both
(kinds_image_first.py: HunyuanVideo, its Framepack, HunyuanImage 2.1): the mask is sliced to the merged keys
(key_masks.MaskSlice), the single blocks merge the first N tokens of the joined sequence (Span.image_first),
Framepack's history tokens before the target's pass whole, and what cannot run is refused by name."""
import pytest
import torch

import tomesd
from families import FAMILIES, missing_host
from tiny_image_first_families import (framepack, framepack_history, framepack_inputs, hunyuan_image,
                                       hunyuan_image_inputs, hunyuan_video, hunyuan_video_inputs)
from tiny_video_families import run

TOL = 1e-5
BUILDS = {"hunyuan-video": (hunyuan_video, hunyuan_video_inputs), "hunyuan-image": (hunyuan_image, hunyuan_image_inputs),
          "framepack": (framepack, framepack_inputs)}


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
    base = run(model, short)
    tomesd.apply_patch(model, ratio=0.5)
    try:
        with tomesd.observe(model) as seen:
            merged_short = run(model, short)
        merged_padded = run(model, padded)
    finally:
        tomesd.remove_patch(model)
    assert seen.calls[0].merged_blocks("attn") == [0, 1]  # the double and the single block
    assert (merged_short - base).abs().max().item() > 1000 * TOL  # ToMe changed the output
    torch.testing.assert_close(merged_padded, merged_short, atol=TOL, rtol=TOL)


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


def test_hidream_is_refused_by_name():
    """HiDream-I1 (not merged yet: its single blocks take [image, text] joined by the root, rows over both) is refused
    at apply time, naming the cause, instead of as a root whose blocks ToMe does not know."""
    diffusers = pytest.importorskip("diffusers")
    if not hasattr(diffusers, "HiDreamImageTransformer2DModel"):
        pytest.skip(f"diffusers {diffusers.__version__} has no HiDreamImageTransformer2DModel")
    model = diffusers.HiDreamImageTransformer2DModel(
        patch_size=2, in_channels=4, out_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=8,
        num_attention_heads=2, caption_channels=[8, 4], text_emb_dim=8, num_routed_experts=2, num_activated_experts=2,
        axes_dims_rope=(4, 2, 2), max_resolution=(16, 16), llama_layers=(0, 1), force_inference_output=True)
    with pytest.raises(TypeError, match="cannot patch HiDreamImageTransformer2DModel.*image first"):
        tomesd.apply_patch(model)
