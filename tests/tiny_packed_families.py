"""Tiny denoisers over a packed latent [B, N, C] whose token grid comes from the forward's arguments (layout
"packed", tomesd/layouts/packed.py): LTX-Video and Qwen-Image (and Qwen-Image-Edit's reference tokens), with
keyword inputs for one forward as their pipelines build them. Configs from diffusers' own tests
(tests/models/transformers/test_models_transformer_ltx.py, ..._qwenimage.py), two layers each."""
import torch

from tiny_torch import randomize_


def run(model, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).sample


# ---- LTX-Video: tokens in (frame, row, col) order; num_frames, height, width in tokens (patch size 1) ----
LTX = dict(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16,
           num_layers=2, qk_norm="rms_norm_across_heads", caption_channels=16)


def ltx(seed=0):
    from diffusers import LTXVideoTransformer3DModel

    return randomize_(LTXVideoTransformer3DModel(**LTX), seed)


def ltx_inputs(model=None, batch=2, frames=3, h=8, w=8, text=6, seed=1, per_token_timestep=False):
    """As LTXPipeline calls it; `per_token_timestep`: as LTXImageToVideoPipeline does, a timestep per token (the first
    frame's, the conditioning image, at 0)."""
    gen = torch.Generator().manual_seed(seed)
    timestep = torch.full((batch,), 500.0)
    if per_token_timestep:
        timestep = torch.full((batch, frames * h * w), 500.0)
        timestep[:, :h * w] = 0.0
    return dict(hidden_states=torch.randn(batch, frames * h * w, 4, generator=gen),
                encoder_hidden_states=torch.randn(batch, text, 16, generator=gen), timestep=timestep,
                encoder_attention_mask=torch.ones(batch, text, dtype=torch.bool), num_frames=frames, height=h,
                width=w)


# ---- Qwen-Image: img_shapes per sample, [(1, rows, cols)] (Qwen-Image) or the target's then each reference's
# (Qwen-Image-Edit), the packed latent holding those images' tokens in that order ----
QWEN = dict(patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=4,
            joint_attention_dim=16, guidance_embeds=False, axes_dims_rope=(8, 4, 4))


def qwen(seed=0, **config):
    from diffusers import QwenImageTransformer2DModel

    return randomize_(QwenImageTransformer2DModel(**{**QWEN, **config}), seed)


def qwen_inputs(model=None, batch=2, h=8, w=8, text=6, seed=1, references=()):
    """As QwenImagePipeline calls it (no text mask: it passes none when no prompt is padded); `references`: (rows,
    cols) of reference images joined after the target's tokens, as QwenImageEditPipeline / ...EditPlusPipeline do."""
    gen = torch.Generator().manual_seed(seed)
    images = [(1, h, w)] + [(1, rh, rw) for rh, rw in references]
    tokens = sum(f * rh * rw for f, rh, rw in images)
    return dict(hidden_states=torch.randn(batch, tokens, 16, generator=gen),
                encoder_hidden_states=torch.randn(batch, text, 16, generator=gen),
                timestep=torch.full((batch,), 0.5), img_shapes=[images] * batch)
