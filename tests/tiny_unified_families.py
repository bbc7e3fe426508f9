"""Tiny denoisers whose main layers run on one unified sequence of image and text tokens with padding (layout
"unified", tomesd/layouts/unified.py): Z-Image and Lumina 2, with keyword inputs for one forward as their
pipelines build them. Configs from diffusers' own tests (tests/models/transformers/test_models_transformer_z_image.py,
..._lumina2.py): one refiner layer of each kind, one or two main layers."""
import torch

from tiny_torch import randomize_

# ---- Z-Image: a list of per-sample latents [C, 1, H, W] and of captions [L_i, D]; image first in the sequence ----
ZIMAGE = dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=16, n_layers=1, n_refiner_layers=1,
              n_heads=1, n_kv_heads=2, qk_norm=True, cap_feat_dim=16, rope_theta=256.0, t_scale=1000.0,
              axes_dims=[8, 4, 4], axes_lens=[256, 32, 32])


def z_image(seed=0):
    from diffusers import ZImageTransformer2DModel

    return randomize_(ZImageTransformer2DModel(**ZIMAGE), seed)


def z_image_inputs(model=None, batch=2, h=16, w=16, seed=1, texts=(16, 40), as_list=False):
    """As ZImagePipeline calls it: a latent and a caption per sample, each caption of its own valid length (with
    guidance, the prompt's and the negative prompt's in one batch), so the unified sequence is padded under a mask.
    Tuples by default (the family contract moves tuples to the meta device); `as_list`: the pipeline's lists."""
    gen = torch.Generator().manual_seed(seed)
    latents = [torch.randn(16, 1, h, w, generator=gen) for _ in range(batch)]
    captions = [torch.randn(texts[i % len(texts)], 16, generator=gen) for i in range(batch)]
    pack = list if as_list else tuple
    return dict(x=pack(latents), cap_feats=pack(captions), t=torch.full((batch,), 0.5))


def z_image_run(model, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return torch.stack(model(**inputs, return_dict=False)[0])


# ---- Lumina 2: a latent [B, C, H, W], the text [B, L, D] and its mask [B, L]; each sample's image after its text ----
LUMINA2 = dict(sample_size=16, patch_size=2, in_channels=4, hidden_size=24, num_layers=2, num_refiner_layers=1,
               num_attention_heads=3, num_kv_heads=1, multiple_of=2, ffn_dim_multiplier=None, norm_eps=1e-5,
               scaling_factor=1.0, axes_dim_rope=(4, 2, 2), axes_lens=(128, 128, 128), cap_feat_dim=32)


def lumina2(seed=0):
    from diffusers import Lumina2Transformer2DModel

    return randomize_(Lumina2Transformer2DModel(**LUMINA2), seed)


def lumina2_inputs(model=None, batch=2, h=16, w=16, seed=1, text=16, valid=(16, 10)):
    """As Lumina2Pipeline calls it: prompts padded to `text` tokens, sample i's first valid[i] of them real (prompts
    of different lengths in one batch: its joint layers get a padding mask)."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.zeros(batch, text, dtype=torch.bool)
    for i in range(batch):
        mask[i, :valid[i % len(valid)]] = True
    return dict(hidden_states=torch.randn(batch, 4, h, w, generator=gen),
                encoder_hidden_states=torch.randn(batch, text, 32, generator=gen),
                timestep=torch.full((batch,), 0.3), encoder_attention_mask=mask)


def run(model, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).sample


# ---- OmniGen: [condition tokens (text, an input image's tokens in it), time token, image]; the image last ----
OMNIGEN = dict(hidden_size=16, num_attention_heads=4, num_key_value_heads=4, intermediate_size=32, num_layers=2,
               pad_token_id=0, vocab_size=1000, in_channels=4, time_step_dim=4,
               rope_scaling={"long_factor": list(range(1, 3)), "short_factor": list(range(1, 3))})


def omnigen(seed=0):
    from diffusers import OmniGenTransformer2DModel

    return randomize_(OmniGenTransformer2DModel(**OMNIGEN), seed)


def omnigen_inputs(model=None, batch=2, h=16, w=16, seed=1, lengths=(24, 24), edit=False):
    """As OmniGenPipeline calls it, its collator making the inputs: prompts of `lengths` tokens left-padded to the
    longest (its guidance halves differ so), the position ids and the mask [B, S, S] (causal over the conditions,
    bidirectional over the images, padding masked) its collator builds; `edit`: sample 0's prompt holds an input
    image's 16 tokens (tokens 2 to 18), as an edit's does. Of one length by default: with prompts of different
    lengths the host rotates every sample by the first sample's positions (its rotary embedding takes [0]), so its
    own outputs depend on the batch's order."""
    from diffusers.pipelines.omnigen.processor_omnigen import OmniGenCollator

    gen = torch.Generator().manual_seed(seed)
    collator = OmniGenCollator(pad_token_id=0, hidden_size=16)
    ids = [torch.randint(1, 10, (lengths[i % len(lengths)],), generator=gen).tolist() for i in range(batch)]
    padded, text_mask, sizes = collator.pad_input_ids(ids, {0: [[2, 18]]} if edit else {})
    tokens = [(h // 2) * (w // 2)] * batch
    positions = collator.create_position(text_mask, tokens)
    mask, _ = collator.create_mask(text_mask, tokens)
    mask = collator.adjust_attention_for_input_images(mask, sizes)
    return dict(hidden_states=torch.randn(batch, 4, h, w, generator=gen), timestep=torch.full((batch,), 0.4),
                input_ids=padded, input_img_latents=[torch.randn(1, 4, 8, 8, generator=gen)] if edit else [],
                input_image_sizes=sizes, attention_mask=mask, position_ids=positions)


def z_image_controlnet(transformer):
    """Z-Image's ControlNet (no diffusers test config: Z-Image's, one control layer), sharing the transformer's
    refiners and embedders as ZImageControlNetModel.from_transformer makes it."""
    from diffusers import ZImageControlNetModel

    controlnet = ZImageControlNetModel(control_layers_places=[0], control_in_dim=16, all_patch_size=(2,),
                                       all_f_patch_size=(1,), dim=16, n_refiner_layers=1, n_heads=1, n_kv_heads=2)
    return ZImageControlNetModel.from_transformer(randomize_(controlnet, 3), transformer).eval()
