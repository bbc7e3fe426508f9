"""Tiny diffusion transformers of the families added from diffusers 0.42 (Chroma, Flux.2, CogView4, Sana,
HunyuanDiT, AuraFlow) and keyword inputs for one forward, as their pipelines build them: configs from diffusers' own
tests, widened a little where the grid must be big enough to merge."""
import torch

from tiny_torch import randomize_


# ---- Chroma: Flux's packed latent and img_ids (0, row, col) ----
CHROMA = dict(patch_size=1, in_channels=4, num_layers=2, num_single_layers=2, attention_head_dim=16,
              num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 4, 8),
              approximator_num_channels=8, approximator_hidden_dim=16, approximator_layers=1)


def chroma(seed=0):
    from diffusers import ChromaTransformer2DModel

    return randomize_(ChromaTransformer2DModel(**CHROMA), seed)


def _flux_ids(h, w, axes=3):
    ids = torch.zeros(h, w, axes)
    ids[..., 1] += torch.arange(h)[:, None]
    ids[..., 2] += torch.arange(w)[None, :]
    return ids.reshape(h * w, axes)


def chroma_inputs(model=None, batch=2, h=8, w=8, text=5, seed=1, mask=False):
    gen = torch.Generator().manual_seed(seed)
    inputs = dict(hidden_states=torch.randn(batch, h * w, 4, generator=gen),
                  encoder_hidden_states=torch.randn(batch, text, 32, generator=gen),
                  timestep=torch.full((batch,), 0.5), img_ids=_flux_ids(h, w), txt_ids=torch.zeros(text, 3))
    if mask:  # as ChromaPipeline._prepare_attention_mask: the text's padding mask, then ones for the image
        text_mask = torch.ones(batch, text, dtype=torch.bool)
        text_mask[:, -2:] = False
        inputs["attention_mask"] = torch.cat([text_mask, torch.ones(batch, h * w, dtype=torch.bool)], 1)
    return inputs


# ---- Flux.2: packed latent, img_ids [B, N, 4] rows (t=0, row, col, l=0), txt_ids (0, 0, 0, k) ----
FLUX2 = dict(patch_size=1, in_channels=4, num_layers=2, num_single_layers=2, attention_head_dim=16,
             num_attention_heads=2, joint_attention_dim=32, timestep_guidance_channels=256,
             axes_dims_rope=(4, 4, 4, 4))


def flux2(seed=0):
    from diffusers import Flux2Transformer2DModel

    return randomize_(Flux2Transformer2DModel(**FLUX2), seed)


def flux2_inputs(model=None, batch=2, h=8, w=8, text=5, seed=1):
    """As Flux2Pipeline builds them (_prepare_latent_ids, _prepare_text_ids): ids with a batch axis."""
    gen = torch.Generator().manual_seed(seed)
    img_ids = torch.cartesian_prod(torch.arange(1), torch.arange(h), torch.arange(w), torch.arange(1))
    txt_ids = torch.cartesian_prod(torch.arange(1), torch.arange(1), torch.arange(1), torch.arange(text))
    return dict(hidden_states=torch.randn(batch, h * w, 4, generator=gen),
                encoder_hidden_states=torch.randn(batch, text, 32, generator=gen),
                timestep=torch.full((batch,), 0.5), guidance=torch.full((batch,), 1.0),
                img_ids=img_ids[None].expand(batch, -1, -1), txt_ids=txt_ids[None].expand(batch, -1, -1))


# ---- CogView4: latent [B, C, H, W], patch 2, rotary rows [image, D] built inside ----
COGVIEW4 = dict(patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=4,
                out_channels=4, text_embed_dim=8, time_embed_dim=8, condition_dim=4)


def cogview4(seed=0):
    from diffusers import CogView4Transformer2DModel

    return randomize_(CogView4Transformer2DModel(**COGVIEW4), seed)


def cogview4_inputs(model=None, batch=2, h=16, w=16, text=8, seed=1):
    gen = torch.Generator().manual_seed(seed)
    size = torch.tensor([[h * 8, w * 8]] * batch)
    return dict(hidden_states=torch.randn(batch, 4, h, w, generator=gen),
                encoder_hidden_states=torch.randn(batch, text, 8, generator=gen),
                timestep=torch.full((batch,), 500), original_size=size, target_size=size,
                crop_coords=torch.zeros(batch, 2, dtype=torch.long))


# ---- Sana: latent [B, C, H, W], patch 1, linear self-attention, conv feed-forward ----
SANA = dict(patch_size=1, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=4, num_attention_heads=2,
            num_cross_attention_heads=2, cross_attention_head_dim=4, cross_attention_dim=8, caption_channels=8,
            sample_size=16)


def sana(seed=0):
    from diffusers import SanaTransformer2DModel

    return randomize_(SanaTransformer2DModel(**SANA), seed)


def sana_inputs(model=None, batch=2, h=8, w=8, text=8, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return dict(hidden_states=torch.randn(batch, 4, h, w, generator=gen),
                encoder_hidden_states=torch.randn(batch, text, 8, generator=gen),
                timestep=torch.full((batch,), 500), encoder_attention_mask=torch.ones(batch, text))


# ---- HunyuanDiT: latent [B, C, H, W], patch 2, rotary rows [image, D] from the pipeline ----
HUNYUAN_DIT = dict(sample_size=8, patch_size=2, in_channels=4, num_layers=4, attention_head_dim=8,
                   num_attention_heads=2, cross_attention_dim=8, cross_attention_dim_t5=8, pooled_projection_dim=4,
                   hidden_size=16, text_len=4, text_len_t5=4, activation_fn="gelu-approximate")


def hunyuan_dit(seed=0):
    from diffusers import HunyuanDiT2DModel

    return randomize_(HunyuanDiT2DModel(**HUNYUAN_DIT), seed)


def hunyuan_dit_inputs(model=None, batch=2, h=16, w=16, seed=1):
    """As HunyuanDiTPipeline builds them: rotary rows get_2d_rotary_pos_embed(head_dim, crops, grid)."""
    from diffusers.models.embeddings import get_2d_rotary_pos_embed
    from diffusers.pipelines.hunyuandit.pipeline_hunyuandit import get_resize_crop_region_for_grid

    gen = torch.Generator().manual_seed(seed)
    p = 2
    gh, gw = h // p, w // p
    rows = get_2d_rotary_pos_embed(16 // 2, get_resize_crop_region_for_grid((gh, gw), 512 // 8 // p), (gh, gw),
                                   output_type="pt")
    return dict(hidden_states=torch.randn(batch, 4, h, w, generator=gen),
                encoder_hidden_states=torch.randn(batch, 4, 8, generator=gen), text_embedding_mask=torch.ones(batch, 4),
                encoder_hidden_states_t5=torch.randn(batch, 4, 8, generator=gen),
                text_embedding_mask_t5=torch.ones(batch, 4), timestep=torch.full((batch,), 500.0),
                image_meta_size=torch.tensor([[64.0, 64, h * 8, w * 8, 0, 0]] * batch),
                style=torch.zeros(batch, dtype=torch.long), image_rotary_emb=rows)


# ---- AuraFlow: latent [B, C, H, W], patch 2, MMDiT blocks then single blocks over [text, image] ----
AURAFLOW = dict(sample_size=32, patch_size=2, in_channels=4, num_mmdit_layers=2, num_single_dit_layers=2,
                attention_head_dim=8, num_attention_heads=4, caption_projection_dim=32, joint_attention_dim=32,
                out_channels=4, pos_embed_max_size=256)


def auraflow(seed=0):
    from diffusers import AuraFlowTransformer2DModel

    return randomize_(AuraFlowTransformer2DModel(**AURAFLOW), seed)


def auraflow_inputs(model=None, batch=2, h=16, w=16, text=6, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return dict(hidden_states=torch.randn(batch, 4, h, w, generator=gen),
                encoder_hidden_states=torch.randn(batch, text, 32, generator=gen),
                timestep=torch.full((batch,), 500))


def run(model, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).sample
