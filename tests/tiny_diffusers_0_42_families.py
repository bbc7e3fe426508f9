"""Tiny denoisers of diffusers 0.42's later families (tomesd/families/), from diffusers' own test
configs (tests/models/transformers/test_models_transformer_<name>.py) with one block, and keyword inputs for one
forward as their pipelines build them."""
import torch

from tiny_torch import randomize_

TEXT = 5  # text tokens


def run(model, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).sample


# ---- JoyImage Edit: Wan-style latent; an edit's [B, items, C, F, H, W] holds the references, then the target ----
JOYIMAGE = dict(patch_size=[1, 2, 2], in_channels=16, hidden_size=32, num_attention_heads=2, text_dim=16, num_layers=1,
                rope_dim_list=[4, 6, 6], theta=256)


def joyimage(seed=0):
    from diffusers import JoyImageEditTransformer3DModel

    return randomize_(JoyImageEditTransformer3DModel(**JOYIMAGE), seed)


def joyimage_inputs(model=None, batch=2, frames=1, h=8, w=8, items=2, seed=1):
    """As JoyImageEditPipeline calls it: torch.cat([image_latents, noise_latents], dim=1), one reference image before
    the target (items=2); items=0 gives a text-to-image latent [B, C, F, H, W]."""
    gen = torch.Generator().manual_seed(seed)
    shape = (batch, items, 16, frames, h, w) if items else (batch, 16, frames, h, w)
    return dict(hidden_states=torch.randn(shape, generator=gen), timestep=torch.full((batch,), 500.0),
                encoder_hidden_states=torch.randn(batch, TEXT, 16, generator=gen))


# ---- Krea 2: packed latent [B, N, C]; position_ids [text + N, 3] over the joined [text, image] ----
KREA2 = dict(in_channels=16, num_layers=1, attention_head_dim=8, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=32, timestep_embed_dim=8, text_hidden_dim=16, num_text_layers=3,
             text_num_attention_heads=2, text_num_key_value_heads=1, text_intermediate_size=16,
             num_layerwise_text_blocks=1, num_refiner_text_blocks=1, axes_dims_rope=(4, 2, 2), rope_theta=1000.0)


def krea2(seed=0):
    from diffusers import Krea2Transformer2DModel

    return randomize_(Krea2Transformer2DModel(**KREA2), seed, gain=1.0)


def krea2_inputs(model=None, batch=2, h=8, w=8, seed=1, mask=False, text=TEXT, valid=None):
    """As Krea2Pipeline calls it (prepare_position_ids), without its text mask unless `mask`: over `text` tokens,
    the first `valid` unmasked (None: all of the first sample's, two fewer of the second's)."""
    from diffusers import Krea2Pipeline

    gen = torch.Generator().manual_seed(seed)
    inputs = dict(hidden_states=torch.randn(batch, h * w, 16, generator=gen),
                  encoder_hidden_states=torch.randn(batch, text, 3, 16, generator=gen),
                  timestep=torch.full((batch,), 0.5),
                  position_ids=Krea2Pipeline.prepare_position_ids(text, h, w, "cpu"))
    if mask:
        valid = torch.tensor([text, text - 2])[:batch] if valid is None else torch.full((batch,), valid)
        inputs["encoder_attention_mask"] = torch.arange(text)[None, :] < valid[:, None]
    return inputs


# ---- Flux.3: packed latent [B, N, C], img_ids [N, 4] rows (t, row, col, l); per-mode blocks, then single blocks ----
# No diffusers test file: the smallest config its __init__ takes (head 16 = axes 4 + 4 + 4 + 4).
FLUX3 = dict(in_channels=8, cond_in_channels=8, num_layers=1, num_single_layers=1, attention_head_dim=16,
             num_attention_heads=2, joint_attention_dim=16, timestep_channels=16, mlp_ratio=2.0,
             axes_dims_rope=(4, 4, 4, 4))


def flux3(seed=0):
    from diffusers import Flux3Transformer2DModel

    return randomize_(Flux3Transformer2DModel(**FLUX3), seed)


def _ids4(h, w, t=0):
    """ids [h * w, 4]: rows (t, row, col, 0), row-major, as Flux.2's pipelines make them."""
    ids = torch.zeros(h, w, 4)
    ids[..., 0] = t
    ids[..., 1] = torch.arange(h)[:, None]
    ids[..., 2] = torch.arange(w)[None, :]
    return ids.reshape(h * w, 4)


def flux3_inputs(model=None, batch=2, h=8, w=8, seed=1, reference=False):
    """A text-to-image call (reference=True: with a reference image of the same size, its ids at t=1)."""
    gen = torch.Generator().manual_seed(seed)
    inputs = dict(hidden_states=torch.randn(batch, h * w, 8, generator=gen),
                  encoder_hidden_states=torch.randn(batch, TEXT, 16, generator=gen),
                  timestep=torch.full((batch,), 0.5), img_ids=_ids4(h, w), txt_ids=torch.zeros(TEXT, 4))
    if reference:
        inputs.update(image_cond_hidden_states=torch.randn(batch, h * w, 8, generator=gen),
                      image_cond_ids=_ids4(h, w, 1))
    return inputs


# ---- AnyFlow: latent [B, F, C, H, W], Wan's blocks, a timestep per frame ----
ANYFLOW = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
               text_dim=16, freq_dim=256, ffn_dim=32, num_layers=1, cross_attn_norm=True, rope_max_seq_len=32,
               gate_value=0.25, deltatime_type="r")


def anyflow(seed=0):
    from diffusers import AnyFlowTransformer3DModel

    return randomize_(AnyFlowTransformer3DModel(**ANYFLOW), seed)


def anyflow_inputs(model=None, batch=2, frames=3, h=8, w=8, seed=1):
    """As diffusers' test calls it: source and target timesteps per frame."""
    gen = torch.Generator().manual_seed(seed)
    return dict(hidden_states=torch.randn(batch, frames, 4, h, w, generator=gen),
                timestep=torch.full((batch, frames), 500.0), r_timestep=torch.full((batch, frames), 250.0),
                encoder_hidden_states=torch.randn(batch, TEXT, 16, generator=gen))


# ---- Helios: Wan's latent [B, C, F, H, W]; history latents (short, mid, long) joined before the target's tokens ----
HELIOS = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
              text_dim=16, freq_dim=256, ffn_dim=32, num_layers=1, cross_attn_norm=True,
              qk_norm="rms_norm_across_heads", rope_dim=(4, 4, 4), has_multi_term_memory_patch=True,
              guidance_cross_attn=True, zero_history_timestep=True, is_amplify_history=False)


def helios(seed=0, **config):
    from diffusers import HeliosTransformer3DModel

    return randomize_(HeliosTransformer3DModel(**{**HELIOS, **config}), seed)


def helios_inputs(model=None, batch=2, frames=2, h=8, w=8, seed=1):
    """As diffusers' test calls it: a short and a mid history of frames - 1 frames and a long one of 4 (frames - 1);
    every history's tokens come before the target's."""
    gen = torch.Generator().manual_seed(seed)
    past = frames - 1

    def latent(f):
        return torch.randn(batch, 4, f, h, w, generator=gen)

    return dict(hidden_states=latent(frames), timestep=torch.full((batch,), 500),
                encoder_hidden_states=torch.randn(batch, TEXT, 16, generator=gen),
                indices_hidden_states=torch.ones(batch, frames), indices_latents_history_short=torch.ones(batch, past),
                indices_latents_history_mid=torch.ones(batch, past),
                indices_latents_history_long=torch.ones(batch, past * 4), latents_history_short=latent(past),
                latents_history_mid=latent(past), latents_history_long=latent(past * 4))


# ---- NucleusMoE-Image: packed latent [B, N, C], img_shapes; one dense and one mixture-of-experts block ----
NUCLEUS = dict(patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=2,
               joint_attention_dim=16, axes_dims_rope=(8, 4, 4), dense_moe_strategy="leave_first_block_dense",
               num_experts=4, moe_intermediate_dim=16, mlp_ratio=6.0,  # a dense MLP of 128 (whole 128s)
               capacity_factors=[1.0, 1.0])


def nucleus(seed=0):
    from diffusers import NucleusMoEImageTransformer2DModel

    return randomize_(NucleusMoEImageTransformer2DModel(**NUCLEUS), seed, gain=1.0)


def nucleus_inputs(model=None, batch=2, h=8, w=8, seed=1, mask=False, text=TEXT, valid=None):
    """As NucleusMoEImagePipeline calls it, without its text mask unless `mask`: `text` tokens, the first `valid`
    (all if None) unmasked."""
    gen = torch.Generator().manual_seed(seed)
    inputs = dict(hidden_states=torch.randn(batch, h * w, 16, generator=gen),
                  encoder_hidden_states=torch.randn(batch, text, 16, generator=gen), timestep=torch.full((batch,), 0.5),
                  img_shapes=[(1, h, w)] * batch)
    if mask:
        inputs["encoder_hidden_states_mask"] = (torch.arange(text) < (text if valid is None else valid)).long()[
            None].repeat(batch, 1)
    return inputs
