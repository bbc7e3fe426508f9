"""Tiny torch models and pipelines built from configs, with random weights strong enough that
attention, and so ToMe, changes the output measurably (default inits zero output layers)."""
from __future__ import annotations

import math

import torch

from tiny_configs import CLIP_TEXT, VAE, write_clip_vocab

SD1_UNET = dict(
    sample_size=16, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64, 64),
    down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
    cross_attention_dim=32, attention_head_dim=8, norm_num_groups=8,
)
# SDXL's layout: no attention at full resolution.
SDXL_UNET = dict(
    SD1_UNET,
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
)


def randomize_(module: torch.nn.Module, seed: int = 0, gain: float = 1.5) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.ndim >= 2:
                fan_in = p[0].numel()
                p.copy_(torch.randn(p.shape, generator=gen) * gain / math.sqrt(fan_in))
            elif name.endswith("weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    return module.eval()


def unet(config: dict = SD1_UNET, seed: int = 0):
    from diffusers import UNet2DConditionModel

    return randomize_(UNet2DConditionModel(**config), seed)


def unet_inputs(batch: int = 2, h: int = 16, w: int = 16, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 4, h, w, generator=gen), torch.tensor(10), torch.randn(batch, 7, 32, generator=gen)


class LDMWrapper(torch.nn.Module):
    """The shape of an LDM / SD v1-v2 model as tomesd expects it: `.model.diffusion_model`."""

    def __init__(self, diffusion_model: torch.nn.Module):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.diffusion_model = diffusion_model


def ldm_model(sd2: bool = False, seed: int = 0) -> LDMWrapper:
    from ldm.modules.diffusionmodules.openaimodel import UNetModel

    net = UNetModel(
        image_size=16, in_channels=4, model_channels=32, out_channels=4, num_res_blocks=1,
        attention_resolutions=[1, 2], channel_mult=(1, 2), num_head_channels=8,
        use_spatial_transformer=True, transformer_depth=1, context_dim=32, legacy=False,
        use_checkpoint=True, use_linear_in_transformer=sd2,
        disable_self_attentions=[True, False] if sd2 else None,
    )
    return LDMWrapper(randomize_(net, seed))


def components(tmp_path) -> dict:
    """Tiny text encoder, tokenizer, UNet, VAE and scheduler of an SD pipeline."""
    from diffusers import AutoencoderKL, DDIMScheduler
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    vocab_file, merges_file, vocab_size = write_clip_vocab(str(tmp_path))
    tokenizer = CLIPTokenizer(vocab_file, merges_file, model_max_length=77)
    torch.manual_seed(0)
    text_encoder = CLIPTextModel(CLIPTextConfig(vocab_size=vocab_size, **CLIP_TEXT)).eval()
    vae = AutoencoderKL(**VAE).eval()
    return dict(vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet(), scheduler=DDIMScheduler())


def sd_pipeline(tmp_path):
    from diffusers import StableDiffusionPipeline

    return StableDiffusionPipeline(
        **components(tmp_path), safety_checker=None, feature_extractor=None, requires_safety_checker=False
    )


def controlnet_pipeline(tmp_path, num_controlnets: int = 1):
    from diffusers import ControlNetModel, StableDiffusionControlNetPipeline

    parts = components(tmp_path)
    controlnets = [
        randomize_(ControlNetModel.from_unet(parts["unet"], conditioning_embedding_out_channels=(8, 16)), seed=10 + i)
        for i in range(num_controlnets)
    ]
    pipe = StableDiffusionControlNetPipeline(
        **parts, controlnet=controlnets[0] if num_controlnets == 1 else controlnets,
        safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run_pipeline(pipe, num_controlnets: int = 1):
    image = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    return pipe(
        "a tiny test", image=image if num_controlnets == 1 else [image] * num_controlnets,
        num_inference_steps=2, height=32, width=32, output_type="np",
        generator=torch.Generator().manual_seed(0),
    ).images


# ---- diffusion transformers: tiny widths, the real block classes ----
SD3 = dict(
    sample_size=16, patch_size=2, in_channels=4, num_layers=3, attention_head_dim=8, num_attention_heads=2,
    joint_attention_dim=16, caption_projection_dim=16, pooled_projection_dim=8, out_channels=4, pos_embed_max_size=16,
)
SD35 = dict(SD3, dual_attention_layers=(0, 1), qk_norm="rms_norm")  # SD3.5's image-only attn2 and qk-norm
PIXART = dict(
    num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8, num_layers=3,
    cross_attention_dim=16, sample_size=8, patch_size=2, caption_channels=16, use_additional_conditions=False,
)
DIT = dict(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8, num_layers=3,
           sample_size=8, patch_size=2, num_embeds_ada_norm=10)


def transformer(kind: str, seed: int = 0):
    """A tiny SD3 / SD3.5 / PixArt / DiT transformer with strong random weights."""
    from diffusers import DiTTransformer2DModel, PixArtTransformer2DModel, SD3Transformer2DModel

    cls, config = {"sd3": (SD3Transformer2DModel, SD3), "sd35": (SD3Transformer2DModel, SD35),
                   "pixart": (PixArtTransformer2DModel, PIXART), "dit": (DiTTransformer2DModel, DIT)}[kind]
    return randomize_(cls(**config), seed)


def transformer_inputs(kind: str, batch: int = 2, h: int = 16, w: int = 16, t: float = 10.0, seed: int = 1) -> dict:
    """Keyword inputs of one forward: latent [B, 4, h, w] (a grid of h/2 x w/2 patches), text, timestep."""
    gen = torch.Generator().manual_seed(seed)
    inputs = dict(hidden_states=torch.randn(batch, 4, h, w, generator=gen), timestep=torch.full((batch,), t))
    if kind in ("sd3", "sd35"):
        inputs.update(encoder_hidden_states=torch.randn(batch, 5, 16, generator=gen),
                      pooled_projections=torch.randn(batch, 8, generator=gen))
    elif kind == "pixart":
        inputs.update(encoder_hidden_states=torch.randn(batch, 5, 16, generator=gen),
                      added_cond_kwargs={"resolution": None, "aspect_ratio": None})
    else:
        inputs.update(timestep=torch.full((batch,), int(t)), class_labels=torch.arange(batch) % 10)
    return inputs


def run_transformer(model, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).sample


def sd3_pipeline(tmp_path, controlnet=None):
    """A tiny StableDiffusion3Pipeline: two CLIP text encoders, no T5 (the pipeline pads its place with
    zeros), the tiny SD3 transformer with a joint width of 64 (the two CLIPs' 32 each), a tiny VAE."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, CLIPTokenizer

    vocab_file, merges_file, vocab_size = write_clip_vocab(str(tmp_path))
    torch.manual_seed(0)
    encoders = [CLIPTextModelWithProjection(CLIPTextConfig(vocab_size=vocab_size, projection_dim=32, **CLIP_TEXT)).eval()
                for _ in range(2)]
    tokenizers = [CLIPTokenizer(vocab_file, merges_file, model_max_length=77) for _ in range(2)]
    transformer = randomize_(SD3Transformer2DModel(**dict(SD3, joint_attention_dim=64, pooled_projection_dim=64)))
    vae = AutoencoderKL(**dict(VAE, shift_factor=0.0, scaling_factor=1.0, use_quant_conv=False,
                               use_post_quant_conv=False)).eval()
    parts = dict(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae,
        text_encoder=encoders[0], tokenizer=tokenizers[0], text_encoder_2=encoders[1], tokenizer_2=tokenizers[1],
        text_encoder_3=None, tokenizer_3=None,
    )
    if controlnet is None:
        pipe = StableDiffusion3Pipeline(**parts)
    else:
        from diffusers import StableDiffusion3ControlNetPipeline

        pipe = StableDiffusion3ControlNetPipeline(**parts, controlnet=controlnet)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run_sd3_pipeline(pipe):
    return pipe("a tiny test", num_inference_steps=2, height=32, width=32, guidance_scale=2.0, output_type="np",
                generator=torch.Generator().manual_seed(0)).images


FLUX = dict(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
            joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=False, axes_dims_rope=(4, 6, 6))


def flux(seed: int = 0):
    from diffusers import FluxTransformer2DModel

    return randomize_(FluxTransformer2DModel(**FLUX), seed)


def flux_inputs(batch: int = 2, h: int = 8, w: int = 8, t: float = 0.5, text: int = 5, seed: int = 1) -> dict:
    """A packed latent of h x w tokens with its img_ids rows (0, row, col), as Flux pipelines build them."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.zeros(h, w, 3)
    ids[..., 1] += torch.arange(h)[:, None]
    ids[..., 2] += torch.arange(w)[None, :]
    return dict(hidden_states=torch.randn(batch, h * w, 16, generator=gen),
                encoder_hidden_states=torch.randn(batch, text, 32, generator=gen),
                pooled_projections=torch.randn(batch, 32, generator=gen), timestep=torch.full((batch,), t),
                img_ids=ids.reshape(h * w, 3), txt_ids=torch.zeros(text, 3))


def _latent_vae(**overrides):
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    return AutoencoderKL(**dict(VAE, **overrides)).eval()


def flux_pipeline(controlnet: bool = False):
    """A tiny FluxPipeline (or FluxControlNetPipeline) run on prompt embeddings: no text encoders (the
    pipeline takes `prompt_embeds` and `pooled_prompt_embeds` as given), the tiny Flux transformer."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxControlNetModel, FluxControlNetPipeline, FluxPipeline

    parts = dict(scheduler=FlowMatchEulerDiscreteScheduler(), text_encoder=None, tokenizer=None, text_encoder_2=None,
                 tokenizer_2=None, transformer=flux(),
                 vae=_latent_vae(shift_factor=0.0, scaling_factor=1.0, use_quant_conv=False, use_post_quant_conv=False))
    if controlnet:
        pipe = FluxControlNetPipeline(**parts, controlnet=randomize_(FluxControlNetModel(**FLUX), 2))
    else:
        pipe = FluxPipeline(**parts)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run_flux_pipeline(pipe, steps: int = 2):
    gen = torch.Generator().manual_seed(5)
    extra = {}
    if type(pipe).__name__ == "FluxControlNetPipeline":
        extra["control_image"] = torch.rand(1, 3, 32, 32, generator=gen)
    return pipe(prompt_embeds=torch.randn(1, 5, 32, generator=gen), pooled_prompt_embeds=torch.randn(1, 32, generator=gen),
                num_inference_steps=steps, height=32, width=32, output_type="np",
                generator=torch.Generator().manual_seed(0), **extra).images


def pixart_pipeline(sigma: bool = False):
    """A tiny PixArtAlphaPipeline / PixArtSigmaPipeline run on prompt embeddings (no T5)."""
    from diffusers import DPMSolverMultistepScheduler, PixArtAlphaPipeline, PixArtSigmaPipeline

    cls = PixArtSigmaPipeline if sigma else PixArtAlphaPipeline
    pipe = cls(tokenizer=None, text_encoder=None, vae=_latent_vae(), transformer=transformer("pixart"),
               scheduler=DPMSolverMultistepScheduler())
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run_pixart_pipeline(pipe, steps: int = 2):
    gen = torch.Generator().manual_seed(5)
    embeds, mask = torch.randn(1, 6, 16, generator=gen), torch.ones(1, 6)
    return pipe(prompt=None, negative_prompt=None, prompt_embeds=embeds, prompt_attention_mask=mask,
                negative_prompt_embeds=torch.zeros_like(embeds), negative_prompt_attention_mask=mask,
                num_inference_steps=steps, height=32, width=32, output_type="np", use_resolution_binning=False,
                generator=torch.Generator().manual_seed(0)).images


# ---- video UNets: tiny widths, the real classes; spatial blocks see one frame per batch row ----
VIDEO_KINDS = ("animatediff", "unet3d", "svd", "i2vgenxl")
UNET3D = dict(block_out_channels=(32, 32), layers_per_block=1, cross_attention_dim=32, attention_head_dim=8,
              norm_num_groups=8, down_block_types=("CrossAttnDownBlock3D", "DownBlock3D"),
              up_block_types=("UpBlock3D", "CrossAttnUpBlock3D"))
SVD = dict(sample_size=16, in_channels=8, out_channels=4, block_out_channels=(32, 64),
           down_block_types=("CrossAttnDownBlockSpatioTemporal", "DownBlockSpatioTemporal"),
           up_block_types=("UpBlockSpatioTemporal", "CrossAttnUpBlockSpatioTemporal"), cross_attention_dim=32,
           num_attention_heads=(2, 4), layers_per_block=1, addition_time_embed_dim=8,
           projection_class_embeddings_input_dim=24)
MOTION_ADAPTER = dict(block_out_channels=(32, 64, 64), motion_layers_per_block=1, motion_num_attention_heads=2,
                      motion_norm_num_groups=8, motion_max_seq_length=32)


def video_unet(kind: str, seed: int = 0):
    """AnimateDiff (the tiny SD1 UNet with a motion adapter), UNet3DConditionModel or SVD's UNet."""
    import diffusers

    if kind == "animatediff":
        model = diffusers.UNetMotionModel.from_unet2d(unet(seed=seed), diffusers.MotionAdapter(**MOTION_ADAPTER))
        for i, module in enumerate(model.modules()):  # the adapter's output layers start at zero: wake them
            if any(n in ("AnimateDiffTransformer3D", "TransformerTemporalModel") for n in
                   (c.__name__ for c in type(module).__mro__)):
                randomize_(module, seed + 10 + i)
        return model.eval()
    if kind == "unet3d":
        return randomize_(diffusers.UNet3DConditionModel(**UNET3D), seed)
    if kind == "i2vgenxl":  # UNet3D's layout with an image-conditioning path and a `transformer_in` over frames
        return randomize_(diffusers.I2VGenXLUNet(**{k: v for k, v in UNET3D.items() if k != "attention_head_dim"},
                                                  attention_head_dim=8, num_attention_heads=None), seed)
    return randomize_(diffusers.UNetSpatioTemporalConditionModel(**SVD), seed)


def video_inputs(kind: str, batch: int = 1, frames: int = 4, h: int = 16, w: int = 16, t: float = 500.0,
                 seed: int = 1) -> dict:
    """[B, C, F, H, W] latents ([B, F, C, H, W] for SVD) and what each forward needs. AnimateDiff's text
    comes per frame, as its pipeline repeats it."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "svd":
        return dict(sample=torch.randn(batch, frames, 8, h, w, generator=gen), timestep=torch.tensor(t),
                    encoder_hidden_states=torch.randn(batch, 1, 32, generator=gen),
                    added_time_ids=torch.randn(batch, 3, generator=gen))
    text = batch * frames if kind == "animatediff" else batch
    inputs = dict(sample=torch.randn(batch, 4, frames, h, w, generator=gen), timestep=torch.tensor(t),
                  encoder_hidden_states=torch.randn(text, 7, 32, generator=gen))
    if kind == "i2vgenxl":  # the first frame's latent, its image embedding, and the frame rate
        inputs.update(image_latents=torch.randn(batch, 4, frames, h, w, generator=gen),
                      image_embeddings=torch.randn(batch, 32, generator=gen), fps=torch.tensor([8] * batch))
    return inputs


def run_video(model, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).sample


# ---- Wan: a video transformer, every frame's patches in one sequence (frames x rows x columns) ----
WAN = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
           text_dim=24, freq_dim=16, ffn_dim=48, num_layers=2, rope_max_seq_len=64)


def wan(seed: int = 0, **overrides):
    from diffusers import WanTransformer3DModel

    return randomize_(WanTransformer3DModel(**dict(WAN, **overrides)), seed)


def wan_inputs(batch: int = 2, frames: int = 3, h: int = 8, w: int = 8, t: float = 500.0, text: int = 6,
               seed: int = 1) -> dict:
    """A latent [B, C, F, H, W]: (frames, h / 2, w / 2) tokens."""
    gen = torch.Generator().manual_seed(seed)
    return dict(hidden_states=torch.randn(batch, 4, frames, h, w, generator=gen), timestep=torch.full((batch,), t),
                encoder_hidden_states=torch.randn(batch, text, 24, generator=gen))


def run_wan(model, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).sample


def wan_pipeline(two_experts: bool = False):
    """A tiny WanPipeline run on prompt embeddings (no umT5): the tiny Wan transformer and a tiny Wan VAE;
    with `two_experts`, Wan 2.2's layout: a second transformer for the low-noise half of the steps."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline

    torch.manual_seed(0)
    vae = AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True], latents_mean=[0.0] * 4, latents_std=[1.0] * 4).eval()
    extra = dict(transformer_2=wan(seed=7), boundary_ratio=0.5) if two_experts else {}
    pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
                       transformer=wan(), **extra)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run_wan_pipeline(pipe, steps: int = 2):
    gen = torch.Generator().manual_seed(5)
    embeds = torch.randn(1, 6, 24, generator=gen)
    return pipe(prompt_embeds=embeds, negative_prompt_embeds=torch.zeros_like(embeds), num_inference_steps=steps,
                height=64, width=64, num_frames=5, guidance_scale=3.0, output_type="np",
                generator=torch.Generator().manual_seed(0)).frames


# ---- CogVideoX: a video transformer with joint [text, image] attention; 1.5 patches 2 frames at once ----
COGVIDEOX = dict(num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4, time_embed_dim=8,
                 text_embed_dim=24, num_layers=2, sample_width=16, sample_height=16, sample_frames=9,
                 max_text_seq_length=6, norm_eps=1e-5)


def cogvideox(version: str = "1.5", seed: int = 0):
    """CogVideoX 1.0 (frames patched one by one, sin-cos positions, no rotary) or 1.5 (2 frames per patch,
    rotary rows given by the pipeline)."""
    from diffusers import CogVideoXTransformer3DModel

    extra = dict(patch_size_t=2, use_rotary_positional_embeddings=True) if version == "1.5" else {}
    return randomize_(CogVideoXTransformer3DModel(**COGVIDEOX, **extra), seed)


def cogvideox_inputs(model, batch: int = 2, frames: int = 4, h: int = 8, w: int = 8, t: float = 500.0,
                     seed: int = 1) -> dict:
    """A latent [B, F, C, H, W], 6 text tokens, and (1.5) the rotary rows [image tokens, D] that CogVideoX's
    pipeline builds for the grid."""
    from diffusers.models.embeddings import get_3d_rotary_pos_embed

    gen = torch.Generator().manual_seed(seed)
    inputs = dict(hidden_states=torch.randn(batch, frames, 4, h, w, generator=gen), timestep=torch.full((batch,), t),
                  encoder_hidden_states=torch.randn(batch, 6, 24, generator=gen))
    config = model.config
    if config.use_rotary_positional_embeddings:
        p, pt = config.patch_size, config.patch_size_t or 1
        inputs["image_rotary_emb"] = get_3d_rotary_pos_embed(
            embed_dim=config.attention_head_dim, crops_coords=None, grid_size=(h // p, w // p),
            temporal_size=frames // pt, grid_type="slice", max_size=(h // p, w // p))
    return inputs


def run_cogvideox(model, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).sample
