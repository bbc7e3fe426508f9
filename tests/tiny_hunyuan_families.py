"""Tiny video denoisers whose self-attention takes a mask over the text only (HunyuanVideo 1.5, Mochi), and keyword
inputs for one forward as their pipelines build them: configs from diffusers' own tests, random weights."""
import torch

from tiny_torch import randomize_


# ---- HunyuanVideo 1.5: latent [B, C, F, H, W], patch 1, rotary rows (cos, sin) [image, D] built inside; two text
# encoders' tokens with their masks (joined valid-first inside), image embeddings zero for text-to-video ----
HUNYUAN_VIDEO15 = dict(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=2,
                       num_refiner_layers=1, mlp_ratio=2.0, patch_size=1, patch_size_t=1, text_embed_dim=16,
                       text_embed_2_dim=8, image_embed_dim=12, rope_axes_dim=(2, 2, 4), target_size=16,
                       task_type="t2v")


def hunyuan_video15(seed=0):
    from diffusers import HunyuanVideo15Transformer3DModel

    return randomize_(HunyuanVideo15Transformer3DModel(**HUNYUAN_VIDEO15), seed)


def hunyuan_video15_inputs(model=None, batch=2, frames=2, h=8, w=8, text=6, text2=4, valid=None, seed=1):
    """As HunyuanVideo15Pipeline calls it; `valid`: how many of the first text encoder's tokens the mask keeps
    (None: all), the rest being padding."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.ones(batch, text)
    if valid is not None:
        mask[:, valid:] = 0
    return dict(hidden_states=torch.randn(batch, 4, frames, h, w, generator=gen), timestep=torch.full((batch,), 500.0),
                encoder_hidden_states=torch.randn(batch, text, 16, generator=gen),
                encoder_hidden_states_2=torch.randn(batch, text2, 8, generator=gen), encoder_attention_mask=mask,
                encoder_attention_mask_2=torch.ones(batch, text2), image_embeds=torch.zeros(batch, 3, 12))


# ---- Mochi: latent [B, C, F, H, W], patch 2 per frame, rotary rows (cos, sin) [image, heads, D/2] built inside; the
# text's mask, by which its processor keeps each sample's valid text ----
MOCHI = dict(patch_size=2, num_attention_heads=2, attention_head_dim=8, num_layers=2, pooled_projection_dim=16,
             in_channels=4, out_channels=None, qk_norm="rms_norm", text_embed_dim=16, time_embed_dim=4,
             activation_fn="swiglu", max_sequence_length=16)


def mochi(seed=0):
    from diffusers import MochiTransformer3DModel

    return randomize_(MochiTransformer3DModel(**MOCHI), seed)


def mochi_inputs(model=None, batch=2, frames=2, h=16, w=16, text=8, valid=None, seed=1):
    """As MochiPipeline calls it; `valid`: how many prompt tokens the mask keeps (None: all)."""
    gen = torch.Generator().manual_seed(seed)
    return dict(hidden_states=torch.randn(batch, 4, frames, h, w, generator=gen),
                encoder_hidden_states=torch.randn(batch, text, 16, generator=gen), timestep=torch.full((batch,), 500),
                encoder_attention_mask=torch.arange(text).expand(batch, text) < (text if valid is None else valid))
