"""Tiny transformers whose blocks join [image, text] with the image first under the root's key-padding mask
(tomesd/families/video/hunyuan_video.py, image/hunyuan_image.py): HunyuanVideo and HunyuanImage 2.1, configs from
diffusers' own tests (one double-stream and one single-stream block each), random weights, and keyword inputs for one
forward as their pipelines build them."""
import torch

from tiny_torch import randomize_

# ---- HunyuanVideo: latent [B, C, F, H, W], patch 1; rows (cos, sin) [image, D] built inside; the text's mask ----
HUNYUAN_VIDEO = dict(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=10, num_layers=1,
                     num_single_layers=1, num_refiner_layers=1, patch_size=1, patch_size_t=1, guidance_embeds=True,
                     text_embed_dim=16, pooled_projection_dim=8, rope_axes_dim=(2, 4, 4))


def hunyuan_video(seed=0, **config):
    from diffusers import HunyuanVideoTransformer3DModel

    return randomize_(HunyuanVideoTransformer3DModel(**{**HUNYUAN_VIDEO, **config}), seed)


def hunyuan_video_host_reads():
    """Why the installed diffusers' HunyuanVideo forward cannot run on the meta device ("": it can)."""
    import inspect

    from diffusers import HunyuanVideoTransformer3DModel

    looped = "for i in range(batch_size)" in inspect.getsource(HunyuanVideoTransformer3DModel.forward)
    return "its forward (older diffusers) fills the mask sample by sample, up to each prompt's length" if looped else ""


def _text_mask(batch, text, valid):
    """Prompt tokens first, then `text - valid` padding tokens (None: no padding), as the pipelines' tokenizers pad."""
    return (torch.arange(text) < (text if valid is None else valid)).float().expand(batch, text).clone()


def hunyuan_video_inputs(model=None, batch=2, frames=2, h=8, w=8, text=6, valid=None, seed=1):
    """As HunyuanVideoPipeline calls it; `valid`: how many prompt tokens the mask keeps (None: all)."""
    gen = torch.Generator().manual_seed(seed)
    return dict(hidden_states=torch.randn(batch, 4, frames, h, w, generator=gen), timestep=torch.full((batch,), 500.0),
                encoder_hidden_states=torch.randn(batch, text, 16, generator=gen),
                pooled_projections=torch.randn(batch, 8, generator=gen),
                encoder_attention_mask=_text_mask(batch, text, valid), guidance=torch.full((batch,), 6000.0))


# ---- HunyuanImage 2.1: latent [B, C, H, W], patch (1, 1); rows [image, D]; one text encoder (no byT5 glyph text,
# whose tokens the root reorders by boolean masks, a host read of its own) ----
HUNYUAN_IMAGE = dict(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=1,
                     num_single_layers=1, num_refiner_layers=1, patch_size=(1, 1), guidance_embeds=False,
                     text_embed_dim=16, rope_axes_dim=(4, 4))


def hunyuan_image(seed=0):
    from diffusers import HunyuanImageTransformer2DModel

    return randomize_(HunyuanImageTransformer2DModel(**HUNYUAN_IMAGE), seed)


def hunyuan_image_inputs(model=None, batch=2, h=8, w=8, text=6, valid=None, seed=1):
    """As HunyuanImagePipeline calls it; `valid`: how many prompt tokens the mask keeps (None: all)."""
    gen = torch.Generator().manual_seed(seed)
    return dict(hidden_states=torch.randn(batch, 4, h, w, generator=gen), timestep=torch.full((batch,), 500.0),
                encoder_hidden_states=torch.randn(batch, text, 16, generator=gen),
                encoder_attention_mask=_text_mask(batch, text, valid))


# ---- HunyuanVideo Framepack: HunyuanVideo's blocks; the history's latents (clean, 2x, 4x) patchified and joined
# before the target's tokens; image embeddings joined before the text ----
FRAMEPACK = dict(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=10, num_layers=1,
                 num_single_layers=1, num_refiner_layers=1, patch_size=2, patch_size_t=1, guidance_embeds=True,
                 text_embed_dim=16, pooled_projection_dim=8, rope_axes_dim=(2, 4, 4), has_image_proj=True,
                 image_proj_dim=16, has_clean_x_embedder=True)


def framepack(seed=0):
    from diffusers import HunyuanVideoFramepackTransformer3DModel

    return randomize_(HunyuanVideoFramepackTransformer3DModel(**FRAMEPACK), seed)


def framepack_history(h, w):
    """The history's tokens the root joins before a target of h x w (latent pixels): clean latents of one frame
    (patch 2), 2x latents of two frames (patch 4), 4x latents of four frames (patch 8, the grid padded)."""
    return h * w // 4 + -(-h // 4) * -(-w // 4) + -(-h // 8) * -(-w // 8)


def framepack_inputs(model=None, batch=2, frames=2, h=8, w=8, text=6, valid=None, seed=1):
    """As HunyuanVideoFramepackPipeline calls it (history of 1 clean, 2 2x and 4 4x frames); `valid`: how many prompt
    tokens the mask keeps (None: all)."""
    gen = torch.Generator().manual_seed(seed)

    def latent(f):
        return torch.randn(batch, 4, f, h, w, generator=gen)

    return dict(hidden_states=latent(frames), timestep=torch.full((batch,), 500.0),
                encoder_hidden_states=torch.randn(batch, text, 16, generator=gen),
                encoder_attention_mask=_text_mask(batch, text, valid),
                pooled_projections=torch.randn(batch, 8, generator=gen),
                image_embeds=torch.randn(batch, 4, 16, generator=gen), indices_latents=torch.arange(frames) + 7.0,
                guidance=torch.full((batch,), 6000.0), latents_clean=latent(1), indices_latents_clean=torch.zeros(1),
                latents_history_2x=latent(2), indices_latents_history_2x=torch.arange(2) + 1.0,
                latents_history_4x=latent(4), indices_latents_history_4x=torch.arange(4) + 3.0)


# ---- HiDream-I1: latent [B, C, H, W] patchified inside (patch 2; a non-square one padded to max_resolution's tokens
# under a mask); T5 and Llama layers' text; mixture-of-experts feed-forwards ----
HIDREAM = dict(patch_size=2, in_channels=4, out_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=8,
               num_attention_heads=2, caption_channels=[8, 4], text_emb_dim=8, num_routed_experts=2,
               num_activated_experts=2, axes_dims_rope=(4, 2, 2), max_resolution=(16, 16), llama_layers=(0, 1),
               force_inference_output=True)


def hidream(seed=0):
    from diffusers import HiDreamImageTransformer2DModel

    return randomize_(HiDreamImageTransformer2DModel(**HIDREAM), seed)


def hidream_inputs(model=None, batch=2, h=16, w=16, text=6, seed=1):
    """As HiDreamImagePipeline calls it: T5's tokens, and each of two Llama layers' ([layers, B, S, C]; one prompt's
    for the batch, so that reversing the batch along the first axis of the other inputs reverses the samples)."""
    gen = torch.Generator().manual_seed(seed)
    return dict(hidden_states=torch.randn(batch, 4, h, w, generator=gen), timesteps=torch.full((batch,), 500.0),
                encoder_hidden_states_t5=torch.randn(batch, text, 8, generator=gen),
                encoder_hidden_states_llama3=torch.randn(2, 1, text, 4, generator=gen).expand(2, batch, text, 4),
                pooled_embeds=torch.randn(batch, 8, generator=gen))


# ---- Motif-Video: HunyuanVideo's layout and blocks under its own names; latent [B, C, F, H, W] (the text-to-video
# pipeline's latent with its condition channels), patch 1; diffusers' test config, which has an image embedding ----
MOTIF_VIDEO = dict(in_channels=33, out_channels=16, num_attention_heads=2, attention_head_dim=12, num_layers=1,
                   num_single_layers=1, num_decoder_layers=0, mlp_ratio=4.0, patch_size=1, patch_size_t=1,
                   text_embed_dim=32, image_embed_dim=4, rope_axes_dim=(4, 4, 4))


def motif_video(seed=0, **config):
    from diffusers import MotifVideoTransformer3DModel

    return randomize_(MotifVideoTransformer3DModel(**{**MOTIF_VIDEO, **config}), seed)


def motif_video_inputs(model=None, batch=2, frames=2, h=8, w=8, text=6, valid=None, seed=1, image=False):
    """As MotifVideoPipeline calls it; `valid`: how many prompt tokens the mask keeps (None: all); `image`: an
    image-to-video call's image embedding (2 tokens, joined before the text by the root)."""
    gen = torch.Generator().manual_seed(seed)
    inputs = dict(hidden_states=torch.randn(batch, 33, frames, h, w, generator=gen),
                  timestep=torch.full((batch,), 500.0),
                  encoder_hidden_states=torch.randn(batch, text, 32, generator=gen),
                  encoder_attention_mask=_text_mask(batch, text, valid))
    if image:
        inputs["image_embeds"] = torch.randn(batch, 2, 4, generator=gen)
    return inputs
