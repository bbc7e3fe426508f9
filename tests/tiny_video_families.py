"""Tiny video denoisers of the families added from diffusers 0.42 (Cosmos, ConsisID, EasyAnimate, Sana-Video, Wan
Animate, Latte) and keyword inputs for one forward, as their pipelines build them: configs from diffusers' own tests,
cut to two layers and a few frames so one family's whole contract runs in seconds on a CPU."""
import torch

from tiny_torch import randomize_


def run(model, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).sample


def _video(gen, batch, channels, frames, h, w):
    return torch.randn(batch, channels, frames, h, w, generator=gen)


# ---- Cosmos (Predict 2): latent [B, C, F, H, W], patch (1, 2, 2), rotary rows (cos, sin) [image, D] built inside ----
# concat_padding_mask=False: the padding mask channel is resized with torchvision, which the test environments lack;
# it is joined to the latent before the patch embedding and changes nothing ToMe sees.
COSMOS = dict(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=12, num_layers=2, mlp_ratio=2,
              text_embed_dim=16, adaln_lora_dim=4, max_size=(4, 32, 32), patch_size=(1, 2, 2),
              rope_scale=(2.0, 1.0, 1.0), concat_padding_mask=False, extra_pos_embed_type="learnable")


def cosmos(seed=0):
    from diffusers import CosmosTransformer3DModel

    return randomize_(CosmosTransformer3DModel(**COSMOS), seed)


def cosmos_inputs(model=None, batch=2, frames=3, h=8, w=8, text=6, seed=1):
    """As Cosmos2TextToImagePipeline / Cosmos2VideoToWorldPipeline call it (no text mask: they pass none)."""
    gen = torch.Generator().manual_seed(seed)
    return dict(hidden_states=_video(gen, batch, 4, frames, h, w), timestep=torch.full((batch,), 0.5),
                encoder_hidden_states=torch.randn(batch, text, 16, generator=gen), fps=24)


# ---- ConsisID: CogVideoX's layout [B, F, C, H, W] and blocks, rotary rows [image, D] from the pipeline, and face
# features (a local facial extractor's tokens) cross-attended between blocks on every image token ----
CONSISID = dict(num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4, time_embed_dim=8,
                text_embed_dim=24, num_layers=2, sample_width=16, sample_height=16, sample_frames=9, patch_size=2,
                max_text_seq_length=6, use_rotary_positional_embeddings=True, is_train_face=True,
                cross_attn_interval=1,
                cross_attn_dim_head=8, cross_attn_num_heads=2, LFE_id_dim=4, LFE_vit_dim=8, LFE_depth=1,
                LFE_dim_head=8, LFE_num_heads=1, LFE_num_id_token=1, LFE_num_querie=2,
                # The perceiver's keys are LFE_output_dim wide: int(inner_dim * 2 / 3) of the 32-wide blocks.
                LFE_output_dim=21, LFE_ff_mult=1, LFE_num_scale=1)


def consisid(seed=0):
    from diffusers import ConsisIDTransformer3DModel

    return randomize_(ConsisIDTransformer3DModel(**CONSISID), seed)


def consisid_inputs(model=None, batch=2, frames=3, h=8, w=8, seed=1):
    """As ConsisIDPipeline builds them (_prepare_rotary_positional_embeddings). One face for the whole batch, as the
    pipeline repeats it for guidance: its features carry no batch order to flip. id_vit_hidden is a tuple (the model
    takes any sequence) so the meta-device test moves it."""
    from diffusers.models.embeddings import get_3d_rotary_pos_embed
    from diffusers.pipelines.consisid.pipeline_consisid import get_resize_crop_region_for_grid

    gen = torch.Generator().manual_seed(seed)
    p = CONSISID["patch_size"]
    grid = (h // p, w // p)
    base = (CONSISID["sample_width"] // p, CONSISID["sample_height"] // p)
    rows = get_3d_rotary_pos_embed(embed_dim=CONSISID["attention_head_dim"],
                                   crops_coords=get_resize_crop_region_for_grid(grid, *base), grid_size=grid,
                                   temporal_size=frames)
    face = torch.randn(1, 3, CONSISID["LFE_vit_dim"], generator=gen)
    return dict(hidden_states=torch.randn(batch, frames, 4, h, w, generator=gen),
                encoder_hidden_states=torch.randn(batch, 6, 24, generator=gen), timestep=torch.full((batch,), 500),
                image_rotary_emb=rows, id_cond=torch.randn(1, CONSISID["LFE_id_dim"], generator=gen).expand(batch, -1),
                id_vit_hidden=(face.expand(batch, -1, -1),))


# ---- EasyAnimate: latent [B, C, F, H, W], patch 2 per frame, MMDiT blocks over [text, image], rows [image, D] ----
EASYANIMATE = dict(attention_head_dim=16, num_attention_heads=2, in_channels=4, out_channels=4, mmdit_layers=2,
                   num_layers=2, patch_size=2, sample_height=60, sample_width=90, text_embed_dim=16, time_embed_dim=8,
                   time_position_encoding_type="3d_rope", timestep_activation_fn="silu")


def easyanimate(seed=0):
    from diffusers import EasyAnimateTransformer3DModel

    return randomize_(EasyAnimateTransformer3DModel(**EASYANIMATE), seed)


def easyanimate_inputs(model=None, batch=2, frames=3, h=8, w=8, text=6, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return dict(hidden_states=_video(gen, batch, 4, frames, h, w), timestep=torch.full((batch,), 500),
                encoder_hidden_states=torch.randn(batch, text, 16, generator=gen))


# ---- Sana-Video: latent [B, C, F, H, W], patch (1, 2, 2), linear self-attention with Wan's rows [1, S, 1, D] ----
SANA_VIDEO = dict(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=12, num_layers=2,
                  num_cross_attention_heads=2, cross_attention_head_dim=12, cross_attention_dim=24,
                  caption_channels=16,
                  mlp_ratio=2.5, sample_size=8, patch_size=(1, 2, 2), qk_norm="rms_norm_across_heads",
                  rope_max_seq_len=32)


def sana_video(seed=0):
    from diffusers import SanaVideoTransformer3DModel

    return randomize_(SanaVideoTransformer3DModel(**SANA_VIDEO), seed)


def sana_video_inputs(model=None, batch=2, frames=3, h=8, w=8, text=6, seed=1):
    """As SanaVideoPipeline calls it: the prompt's attention mask for the cross-attention."""
    gen = torch.Generator().manual_seed(seed)
    return dict(hidden_states=_video(gen, batch, 4, frames, h, w),
                encoder_hidden_states=torch.randn(batch, text, 16, generator=gen), timestep=torch.full((batch,), 500),
                encoder_attention_mask=torch.ones(batch, text))


# ---- Wan Animate: Wan's blocks on [B, 2C + 4, T + 1, H, W]; pose latents added to frames 1..T, face motion
# features cross-attended by face adapters between blocks (frame by frame) ----
WAN_ANIMATE = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=12,
                   latent_channels=4, out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2,
                   cross_attn_norm=True,
                   qk_norm="rms_norm_across_heads", image_dim=16, rope_max_seq_len=32,
                   motion_encoder_channel_sizes={"4": 16, "8": 16, "16": 16}, motion_encoder_size=16,
                   motion_style_dim=8, motion_dim=4, motion_encoder_dim=16, face_encoder_hidden_dim=16,
                   face_encoder_num_heads=2, inject_face_latents_blocks=2)


def wan_animate(seed=0):
    from diffusers import WanAnimateTransformer3DModel

    return randomize_(WanAnimateTransformer3DModel(**WAN_ANIMATE), seed)


# The face encoder's causal convolutions (strides 2, 2) take S face frames to (S + 3) // 4 (S = 4k + 1), and one
# padding frame joins them: the latent's frames must equal that, so S = 4 * (frames - 2) + 1.
def wan_animate_inputs(model=None, batch=2, frames=3, h=8, w=8, text=6, seed=1):
    gen = torch.Generator().manual_seed(seed)
    faces = 4 * (frames - 2) + 1
    return dict(hidden_states=_video(gen, batch, 12, frames, h, w), timestep=torch.full((batch,), 500.0),
                encoder_hidden_states=torch.randn(batch, text, 16, generator=gen),
                encoder_hidden_states_image=torch.randn(batch, 4, 16, generator=gen),
                pose_hidden_states=_video(gen, batch, 4, frames - 1, h, w),
                face_pixel_values=_video(gen, batch, 3, faces, 16, 16))


# ---- Latte: latent [B, C, F, H, W]; spatial blocks see one frame per batch row, temporal blocks one cell's frames.
# Its temporal position table has video_length rows, so every grid keeps that many frames ----
LATTE = dict(sample_size=8, num_layers=2, patch_size=2, attention_head_dim=8, num_attention_heads=2,
             caption_channels=8,
             in_channels=4, cross_attention_dim=16, out_channels=8, attention_bias=True,
             activation_fn="gelu-approximate", num_embeds_ada_norm=1000, norm_type="ada_norm_single",
             norm_elementwise_affine=False, norm_eps=1e-6, video_length=2)


def latte(seed=0):
    from diffusers import LatteTransformer3DModel

    return randomize_(LatteTransformer3DModel(**LATTE), seed)


def latte_inputs(model=None, batch=2, frames=2, h=8, w=8, text=6, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return dict(hidden_states=_video(gen, batch, 4, frames, h, w),
                encoder_hidden_states=torch.randn(batch, text, 8, generator=gen), timestep=torch.full((batch,), 500),
                enable_temporal_attentions=True)
