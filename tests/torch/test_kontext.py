"""Flux Kontext: the reference image's tokens, joined after the target's in one sequence by the real
FluxKontextPipeline (ids of the same shape, first axis 1), never merge with the target's. They pass whole:
every merged row holds target tokens only or one reference token, the target's first-block merge is the one a
target-only call computes, and the pipeline's output with ToMe differs from the unpatched output by far more
than round-off (ToMe did merge)."""
import numpy as np
import pytest
import torch

import tiny_torch as T
import tomesd


def kontext_pipeline():
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxKontextPipeline

    pipe = FluxKontextPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(), text_encoder=None, tokenizer=None, text_encoder_2=None,
        tokenizer_2=None, transformer=T.flux(),
        vae=T._latent_vae(shift_factor=0.0, scaling_factor=1.0, use_quant_conv=False, use_post_quant_conv=False))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run(pipe, steps=2, side=16):
    gen = torch.Generator().manual_seed(5)
    image = torch.rand(1, 3, side, side, generator=gen)
    return pipe(image=image, prompt_embeds=torch.randn(1, 5, 32, generator=gen),
                pooled_prompt_embeds=torch.randn(1, 32, generator=gen), num_inference_steps=steps, height=side,
                width=side, max_area=side * side, _auto_resize=False, output_type="np",
                generator=torch.Generator().manual_seed(0)).images


def transformer_calls(pipe):
    """The transformer's inputs in each call of a run (shapes, and the ids' first axis)."""
    seen = []

    def record(module, args, kwargs):
        seen.append((kwargs["hidden_states"].shape[1], kwargs["img_ids"][:, 0].clone()))

    return seen, pipe.transformer.register_forward_pre_hook(record, with_kwargs=True)


def test_the_pipeline_joins_a_reference_of_the_targets_shape():
    """What the test stands on: the real pipeline's sequence is [target, reference], ids rows 0 then 1."""
    pipe = kontext_pipeline()
    seen, handle = transformer_calls(pipe)
    run(pipe, steps=1)
    handle.remove()
    tokens, first_axis = seen[0]
    assert tokens == 32 and first_axis[:16].eq(0).all() and first_axis[16:].eq(1).all()


@pytest.mark.parametrize("steps_reused", [1, 2])
def test_reference_tokens_pass_whole_and_never_join_a_target_group(steps_reused):
    pipe = kontext_pipeline()
    base = run(pipe)
    tomesd.apply_patch(pipe, ratio=0.5, reuse_steps=steps_reused)
    try:
        with tomesd.observe(pipe) as seen:
            out = run(pipe)
    finally:
        tomesd.remove_patch(pipe)
    assert np.abs(out - base).max() > 1e-2  # ToMe changed the output: it merged
    target, reference = 16, 16
    merged_blocks = 0
    for call in seen.calls:
        for block in call.blocks.values():
            merge = block.merge
            if merge is None:
                continue
            merged_blocks += 1
            rows = merge.sample_rows()  # [B, target + reference]
            assert merge.num_tokens == target + reference
            target_rows, reference_rows = rows[:, :target], rows[:, target:]
            for i in range(rows.shape[0]):
                assert not set(target_rows[i].tolist()) & set(reference_rows[i].tolist())
                assert len(set(reference_rows[i].tolist())) == reference  # each reference token its own row
            assert merge.num_merged == target - 8 + reference  # r = half the target's 16
    assert merged_blocks > 0
    assert not hasattr(pipe.__dict__.get("prepare_latents"), "split")  # remove_patch restored the method


def test_the_targets_merge_is_the_one_a_target_only_call_computes():
    """Block 0's matching sees the target's tokens alone: the same rows as a call of the target alone."""
    pipe = kontext_pipeline()
    calls = []
    pipe.transformer.register_forward_pre_hook(lambda m, a, k: calls.append(dict(k)), with_kwargs=True)
    run(pipe, steps=1)
    joined = calls[0]
    alone = dict(joined, hidden_states=joined["hidden_states"][:, :16], img_ids=joined["img_ids"][:16])
    pipe.transformer._forward_pre_hooks.clear()
    tomesd.apply_patch(pipe, ratio=0.5)
    try:
        pipe.prepare_latents(**_prepare_args(pipe))  # the pipeline says where the target ends, as in a run
        with tomesd.observe(pipe) as seen, torch.no_grad():
            pipe.transformer(**joined)
            pipe.transformer(**alone)
    finally:
        tomesd.remove_patch(pipe)
    first = [call.blocks[0].merge.sample_rows() for call in seen.calls]
    assert first[0].shape[1] == 32 and first[1].shape[1] == 16
    assert torch.equal(first[0][:, :16], first[1])


def _prepare_args(pipe):
    gen = torch.Generator().manual_seed(5)
    image = pipe.image_processor.preprocess(torch.rand(1, 3, 16, 16, generator=gen), 16, 16)
    return dict(image=image, batch_size=1, num_channels_latents=4, height=16, width=16, dtype=torch.float32,
                device=torch.device("cpu"), generator=torch.Generator().manual_seed(0))


def test_downsample_mode_refuses_reference_tokens():
    pipe = kontext_pipeline()
    tomesd.apply_patch(pipe, mode="downsample")
    try:
        with pytest.raises(ValueError, match="mode='downsample' cannot leave a reference image's 16 tokens out"):
            run(pipe, steps=1)
    finally:
        tomesd.remove_patch(pipe)
