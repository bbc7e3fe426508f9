"""Flux.2 (Klein) editing: the real Flux2KleinPipeline joins the reference image's tokens after the target's in
one sequence; ToMe merges the target's tokens only (roots' joined_references, references.py) and the reference's
pass whole, and remove_patch gives the exact images back."""
import torch

import tiny_transformers as X
import tomesd


def klein_pipeline():
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline, \
        Flux2Transformer2DModel

    torch.manual_seed(0)
    vae = AutoencoderKLFlux2(sample_size=32, in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",),
                             up_block_types=("UpDecoderBlock2D",), block_out_channels=(4,), layers_per_block=1,
                             latent_channels=1, norm_num_groups=1, use_quant_conv=False,
                             use_post_quant_conv=False).eval()
    transformer = X.randomize_(Flux2Transformer2DModel(**dict(X.FLUX2, joint_attention_dim=16, guidance_embeds=False)))
    pipe = Flux2KleinPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=None, tokenizer=None,
                              transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run(pipe, reference):
    embeds = torch.randn(1, 5, 16, generator=torch.Generator().manual_seed(5))
    return pipe(image=reference, prompt_embeds=embeds, negative_prompt_embeds=torch.zeros_like(embeds), height=32,
                width=32, num_inference_steps=2, guidance_scale=1.0, output_type="pt",
                generator=torch.Generator().manual_seed(0)).images


def test_the_reference_images_tokens_pass_whole():
    from PIL import Image

    pipe = klein_pipeline()
    reference = Image.fromarray((torch.rand(64, 64, 3, generator=torch.Generator().manual_seed(3)) * 255).byte().numpy())
    base = run(pipe, reference)
    tomesd.apply_patch(pipe, ratio=0.5)
    try:
        with tomesd.observe(pipe) as seen:
            out = run(pipe, reference)
    finally:
        tomesd.remove_patch(pipe)
    target, joined = 16 * 16, 16 * 16 + 32 * 32  # the 32x32 target's tokens; the 64x64 reference's after them
    for call in seen.calls:
        for block in call.blocks.values():
            for n, m in block.sites.get("attn", []):
                # the image sequence holds both; only the target's half merges (a single block's record has text too)
                assert n - m == target // 2 and n >= joined, (n, m)
    assert seen.calls and (out - base).abs().max() > 1e-3
    assert torch.equal(run(pipe, reference), base)
