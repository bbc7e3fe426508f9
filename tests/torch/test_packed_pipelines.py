"""Whole pipelines over the "packed" layout, built from tiny components (diffusers' own pipeline tests' configs; no
hub): QwenImagePipeline, QwenImageEditPipeline (the reference image's tokens joined after the target's pass whole)
and LTXPipeline. apply_patch(pipe) merges in every call, reuse_steps counts the pipeline's own steps, and
remove_patch gives back the pipeline's own outputs; LTXImageToVideoPipeline gives a timestep per token. The text
encoders are left out: prompt embeddings are given."""
import pytest
import torch

import tiny_packed_families as P
import tomesd

pytest.importorskip("diffusers.pipelines.qwenimage.pipeline_qwenimage_edit")

SIZE = 32  # Qwen-Image's pixels: the tiny vae's 4x and 2x2 packing give a 4x4 token grid


def _qwen_vae():
    from diffusers import AutoencoderKLQwenImage

    torch.manual_seed(0)
    return AutoencoderKLQwenImage(base_dim=24, z_dim=4, dim_mult=[1, 2, 4], num_res_blocks=1,
                                  temperal_downsample=[False, True], latents_mean=[0.0] * 4,
                                  latents_std=[1.0] * 4).eval()


def qwen_pipeline(edit=False):
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImageEditPipeline, QwenImagePipeline

    cls = QwenImageEditPipeline if edit else QwenImagePipeline
    extra = dict(processor=None) if edit else {}
    pipe = cls(scheduler=FlowMatchEulerDiscreteScheduler(), vae=_qwen_vae(), text_encoder=None, tokenizer=None,
               transformer=P.qwen().eval(), **extra)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run_qwen(pipe, steps=2, image=None):
    embeds = torch.randn(1, 5, 16, generator=torch.Generator().manual_seed(5))
    extra = {} if image is None else dict(image=image)
    return pipe(prompt_embeds=embeds, negative_prompt_embeds=torch.zeros_like(embeds), true_cfg_scale=2.0,
                num_inference_steps=steps, height=SIZE, width=SIZE, output_type="pt",
                generator=torch.Generator().manual_seed(0), **extra).images


def ltx_pipeline(image_to_video=False):
    """LTXPipeline, or LTXImageToVideoPipeline (`image_to_video`: the image is the first latent frame, a timestep per
    token with the first frame's at 0)."""
    from diffusers import AutoencoderKLLTXVideo, FlowMatchEulerDiscreteScheduler, LTXImageToVideoPipeline, \
        LTXPipeline, LTXVideoTransformer3DModel

    torch.manual_seed(0)
    vae = AutoencoderKLLTXVideo(in_channels=3, out_channels=3, latent_channels=8, block_out_channels=(8, 8, 8, 8),
                                decoder_block_out_channels=(8, 8, 8, 8), layers_per_block=(1, 1, 1, 1, 1),
                                decoder_layers_per_block=(1, 1, 1, 1, 1),
                                spatio_temporal_scaling=(True, True, False, False),
                                decoder_spatio_temporal_scaling=(True, True, False, False),
                                decoder_inject_noise=(False, False, False, False, False),
                                upsample_residual=(False, False, False, False), upsample_factor=(1, 1, 1, 1),
                                timestep_conditioning=False, patch_size=1, patch_size_t=1, encoder_causal=True,
                                decoder_causal=False).eval()
    vae.use_framewise_encoding = vae.use_framewise_decoding = False
    transformer = P.randomize_(LTXVideoTransformer3DModel(**dict(P.LTX, in_channels=8, out_channels=8))).eval()
    cls = LTXImageToVideoPipeline if image_to_video else LTXPipeline
    pipe = cls(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=None, tokenizer=None,
               transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run_ltx(pipe, steps=2):
    embeds = torch.randn(1, 5, 16, generator=torch.Generator().manual_seed(5))
    mask = torch.ones(1, 5, dtype=torch.long)
    extra = {}
    if "ImageToVideo" in type(pipe).__name__:
        extra["image"] = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(3))
    return pipe(**extra, prompt_embeds=embeds, prompt_attention_mask=mask,
                negative_prompt_embeds=torch.zeros_like(embeds), negative_prompt_attention_mask=mask,
                guidance_scale=3.0, num_inference_steps=steps, height=64,
                width=64, num_frames=9, output_type="pt", generator=torch.Generator().manual_seed(0)).frames


PIPELINES = {"qwen-image": (qwen_pipeline, run_qwen), "ltx-video": (ltx_pipeline, run_ltx),
             "ltx-image-to-video": (lambda: ltx_pipeline(image_to_video=True), run_ltx)}


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_reuse_steps_on_a_pipeline_counts_its_steps_and_removal_gives_back_its_outputs(name):
    build, run = PIPELINES[name]
    pipe = build()
    base = run(pipe, steps=4)
    tomesd.apply_patch(pipe, ratio=0.5, reuse_steps=2)
    try:
        with tomesd.observe(pipe.transformer) as seen:
            out = run(pipe, steps=4)
    finally:
        tomesd.remove_patch(pipe)
    blocks = len(pipe.transformer.transformer_blocks)
    per_step = 2 if name == "qwen-image" else 1  # guidance as two calls a step (Qwen-Image), one batch (LTX)
    # Each window of two steps computes at its first call; its other calls (the second guidance call too) reuse.
    window = [(blocks, 0)] + [(0, blocks)] * (2 * per_step - 1)
    assert [(call.computed, call.reused) for call in seen.calls] == window * 2
    assert all(call.merged_blocks("attn") == list(range(blocks)) for call in seen.calls)
    assert (out - base).abs().max() > 1e-3
    assert torch.equal(run(pipe, steps=4), base)


def test_qwen_image_edit_pipeline_merges_the_target_and_passes_the_reference_whole(monkeypatch):
    from PIL import Image

    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit as module

    # The pipeline sizes the reference to about a megapixel: 48x32 here, so its tokens (6x4) differ from the target's.
    monkeypatch.setattr(module, "calculate_dimensions", lambda area, ratio: (48, 32, None))
    pipe = qwen_pipeline(edit=True)
    reference = Image.fromarray((torch.rand(32, 48, 3, generator=torch.Generator().manual_seed(3)) * 255)
                                .byte().numpy())
    base = run_qwen(pipe, image=reference)
    tomesd.apply_patch(pipe, ratio=0.5)
    try:
        with tomesd.observe(pipe.transformer) as seen:
            out = run_qwen(pipe, image=reference)
    finally:
        tomesd.remove_patch(pipe)
    scale = pipe.vae_scale_factor * 2  # the vae's, then 2x2 packing
    target = (SIZE // scale) ** 2
    joined = target + (48 // scale) * (32 // scale)
    assert len(seen.calls) == 4  # two steps, each with and without the prompt
    for call in seen.calls:
        for block in call.blocks.values():
            (n, m), = block.sites["attn"]
            assert n == joined and n - m == target // 2, (n, m)  # only the target's tokens merge
    assert (out - base).abs().max() > 1e-3
    assert torch.equal(run_qwen(pipe, image=reference), base)
