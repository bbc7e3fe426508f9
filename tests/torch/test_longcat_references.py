"""LongCat-Image editing: the real LongCatImageEditPipeline joins the reference image's tokens after the target's in
one sequence (ids from (prompt length, prompt length), modality 1 then 2); ToMe merges the target's tokens only
(roots' joined_references, references.py), the reference's pass whole, and remove_patch gives the exact images back.

The pipeline's text encoder (Qwen2.5-VL) is left out: its encode_prompt is replaced by prompt embeddings with the
pipeline's own text ids, and its size rule (about a megapixel, whatever the image) by 32x32, so the tiny transformer
sees 256 target and 256 reference tokens."""
import pytest
import torch

import tiny_image_families as I
import tomesd

pytest.importorskip("diffusers.pipelines.longcat_image.pipeline_longcat_image_edit")

SIZE = 32


class TextProcessor:
    """Stands for Qwen2VLProcessor, whose image processor only the replaced encode_prompt would use."""

    image_processor = None


def edit_pipeline(monkeypatch):
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, LongCatImageEditPipeline, \
        LongCatImageTransformer2DModel
    from diffusers.pipelines.longcat_image import pipeline_longcat_image_edit as module

    torch.manual_seed(0)
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",),
                        up_block_types=("UpDecoderBlock2D",), block_out_channels=(4,), layers_per_block=1,
                        latent_channels=16, norm_num_groups=1, shift_factor=0.0, scaling_factor=1.0).eval()
    # The pipeline packs 16 latent channels in 2x2 patches: 64 channels a token.
    transformer = I.randomize_(LongCatImageTransformer2DModel(**dict(I.LONGCAT, in_channels=64)))
    pipe = LongCatImageEditPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=None,
                                    tokenizer=None, text_processor=TextProcessor(),
                                    transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    monkeypatch.setattr(module, "calculate_dimensions", lambda area, ratio: (SIZE, SIZE))

    def encode_prompt(prompt=None, image=None, num_images_per_prompt=1, prompt_embeds=None):
        ids = module.prepare_pos_ids(modality_id=0, type="text", start=(0, 0), num_token=prompt_embeds.shape[1])
        return prompt_embeds, ids

    pipe.encode_prompt = encode_prompt
    return pipe


def run(pipe, reference):
    embeds = torch.randn(1, 5, 32, generator=torch.Generator().manual_seed(5))
    return pipe(image=reference, prompt_embeds=embeds, negative_prompt_embeds=torch.zeros_like(embeds),
                num_inference_steps=2, guidance_scale=2.0, output_type="pt",
                generator=torch.Generator().manual_seed(0)).images


def test_the_reference_images_tokens_pass_whole(monkeypatch):
    from PIL import Image

    pipe = edit_pipeline(monkeypatch)
    reference = Image.fromarray((torch.rand(SIZE, SIZE, 3, generator=torch.Generator().manual_seed(3)) * 255)
                                .byte().numpy())
    base = run(pipe, reference)
    tomesd.apply_patch(pipe, ratio=0.5)
    try:
        with tomesd.observe(pipe) as seen:
            out = run(pipe, reference)
    finally:
        tomesd.remove_patch(pipe)
    target = joined = (SIZE // 2) ** 2  # the target's tokens (2x2 patches of the latent); the reference's after them
    joined += target
    assert len(seen.calls) == 4  # two steps, each with and without the prompt
    for call in seen.calls:
        for block in call.blocks.values():
            for n, m in block.sites.get("attn", []):
                # the image sequence holds both; only the target's half merges (a single block's record has text too)
                assert n - m == target // 2 and n >= joined, (n, m)
    assert (out - base).abs().max() > 1e-3
    assert torch.equal(run(pipe, reference), base)
