"""Tiny image denoisers of diffusers 0.42 that run on a layout ToMe has (Flux's ids: Bria, Bria FIBO, LongCat-Image,
Ovis-Image; CogView4's patch grid: GLM-Image; SD3's patches: CogView3-Plus) and keyword inputs for one forward, as
their pipelines build them. One block of each kind, heads of 8 or 16 channels: the contract runs each family's
forward dozens of times."""
import torch

from tiny_torch import randomize_
from tiny_transformers import cogview4_inputs

TEXT = 5  # text tokens


def _ids(h, w, start=0, modality=0):
    """Image ids [h * w, 3]: rows (modality, start + row, start + col), row-major, as the pipelines make them."""
    ids = torch.zeros(h, w, 3)
    ids[..., 0] = modality
    ids[..., 1] += torch.arange(h)[:, None] + start
    ids[..., 2] += torch.arange(w)[None, :] + start
    return ids.reshape(h * w, 3)


def _packed(batch, h, w, channels, text_dim, seed):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, h * w, channels, generator=gen), torch.randn(batch, TEXT, text_dim, generator=gen),
            gen)


# ---- Bria: Flux's blocks, packed latent, img_ids rows (0, row, col), txt_ids zeros ----
BRIA = dict(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=[4, 4, 8])


def bria(seed=0):
    from diffusers import BriaTransformer2DModel

    return randomize_(BriaTransformer2DModel(**BRIA), seed)


def bria_inputs(model=None, batch=2, h=8, w=8, seed=1):
    latent, text, _ = _packed(batch, h, w, 4, 32, seed)
    return dict(hidden_states=latent, encoder_hidden_states=text, timestep=torch.full((batch,), 500.0),
                img_ids=_ids(h, w), txt_ids=torch.zeros(TEXT, 3))


# ---- Bria FIBO: Bria's blocks, a text-encoder layer per block; the single blocks get [text, image] joined ----
BRIA_FIBO = dict(BRIA, text_encoder_dim=8)


def bria_fibo(seed=0):
    from diffusers import BriaFiboTransformer2DModel

    return randomize_(BriaFiboTransformer2DModel(**BRIA_FIBO), seed)


def bria_fibo_inputs(model=None, batch=2, h=8, w=8, seed=1):
    """text_encoder_layers: a tuple (the meta-device test moves tuples), one layer per block, the same for every
    sample (a tuple is not flipped with the batch, encoder_hidden_states is)."""
    latent, text, gen = _packed(batch, h, w, 4, 32, seed)
    layers = tuple(torch.randn(1, TEXT, 8, generator=gen).expand(batch, -1, -1) for _ in range(2))
    return dict(hidden_states=latent, encoder_hidden_states=text, text_encoder_layers=layers,
                timestep=torch.full((batch,), 500.0), img_ids=_ids(h, w), txt_ids=torch.zeros(TEXT, 3))


# ---- LongCat-Image: Flux's blocks; ids (modality, row, col) from (512, 512), as LongCatImagePipeline's ----
LONGCAT = dict(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
               num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=[4, 4, 8])


def longcat(seed=0):
    from diffusers import LongCatImageTransformer2DModel

    return randomize_(LongCatImageTransformer2DModel(**LONGCAT), seed)


def longcat_inputs(model=None, batch=2, h=8, w=8, seed=1):
    latent, text, _ = _packed(batch, h, w, 4, 32, seed)
    txt_ids = torch.zeros(TEXT, 3)
    txt_ids[:, 1] = txt_ids[:, 2] = torch.arange(TEXT)
    return dict(hidden_states=latent, encoder_hidden_states=text, timestep=torch.full((batch,), 0.5),
                img_ids=_ids(h, w, start=512, modality=1), txt_ids=txt_ids)


# ---- Ovis-Image: Flux's blocks with SwiGLU MLPs; img_ids (0, row, col), txt_ids (0, k, k) ----
OVIS = dict(patch_size=1, in_channels=4, out_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 4, 8))


def ovis(seed=0):
    from diffusers import OvisImageTransformer2DModel

    return randomize_(OvisImageTransformer2DModel(**OVIS), seed)


def ovis_inputs(model=None, batch=2, h=8, w=8, seed=1):
    latent, text, _ = _packed(batch, h, w, 4, 32, seed)
    txt_ids = torch.zeros(TEXT, 3)
    txt_ids[:, 1] = txt_ids[:, 2] = torch.arange(TEXT)
    return dict(hidden_states=latent, encoder_hidden_states=text, timestep=torch.full((batch,), 0.5),
                img_ids=_ids(h, w), txt_ids=txt_ids)


# ---- CogView3-Plus: latent [B, C, H, W], patch 2, CogVideoX's joint processor, no rotary rows ----
COGVIEW3PLUS = dict(patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=4,
                    out_channels=4, text_embed_dim=8, time_embed_dim=8, condition_dim=4, pos_embed_max_size=16,
                    sample_size=16)


def cogview3plus(seed=0):
    from diffusers import CogView3PlusTransformer2DModel

    return randomize_(CogView3PlusTransformer2DModel(**COGVIEW3PLUS), seed)


# CogView3-Plus takes CogView4's inputs (latent, text, timestep, sizes and crop): the pipelines build them alike.
cogview3plus_inputs = cogview4_inputs


# ---- GLM-Image: CogView4's layout (latent [B, C, H, W], patch 2, rows [image, D] built inside), prior tokens ----
GLM_IMAGE = dict(patch_size=2, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=8,
                 num_attention_heads=4, text_embed_dim=8, time_embed_dim=8, condition_dim=4,
                 prior_vq_quantizer_codebook_size=16)


def glm_image(seed=0):
    from diffusers import GlmImageTransformer2DModel

    return randomize_(GlmImageTransformer2DModel(**GLM_IMAGE), seed)


def glm_image_inputs(model=None, batch=2, h=16, w=16, text=8, seed=1):
    """As GlmImagePipeline's conditional call: a prior token per image token, none dropped."""
    gen = torch.Generator().manual_seed(seed)
    tokens = (h // 2) * (w // 2)
    return dict(hidden_states=torch.randn(batch, 4, h, w, generator=gen),
                encoder_hidden_states=torch.randn(batch, text, 8, generator=gen),
                prior_token_id=torch.randint(0, 16, (batch, tokens), generator=gen),
                prior_token_drop=torch.zeros(batch, tokens, dtype=torch.bool),
                timestep=torch.full((batch,), 500.0), target_size=torch.tensor([[h * 8.0, w * 8.0]] * batch),
                crop_coords=torch.zeros(batch, 2))


# ---- PRX: a latent [B, C, H, W] patchified row by row, rotary rows [B, 1, image, D/2, 2, 2] built inside; its
# attention takes the image's queries and [text, image] keys, with the text's mask (test_models_transformer_prx.py,
# narrowed) ----
PRX = dict(in_channels=4, patch_size=2, context_in_dim=32, hidden_size=32, mlp_ratio=2.0, num_heads=2, depth=2,
           axes_dim=[8, 8], theta=10_000)


def prx(seed=0):
    from diffusers import PRXTransformer2DModel

    return randomize_(PRXTransformer2DModel(**PRX), seed)


def prx_inputs(model=None, batch=2, h=16, w=16, text=6, valid=None, seed=1):
    """`valid`: how many prompt tokens the mask keeps (None: no mask, as the pipeline passes an unpadded prompt)."""
    gen = torch.Generator().manual_seed(seed)
    inputs = dict(hidden_states=torch.randn(batch, 4, h, w, generator=gen), timestep=torch.full((batch,), 500.0),
                  encoder_hidden_states=torch.randn(batch, text, 32, generator=gen))
    if valid is not None:
        inputs["attention_mask"] = torch.arange(text).expand(batch, text) < valid
    return inputs


def run(model, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).sample


def glm_image_run(model, inputs: dict) -> torch.Tensor:
    """GLM-Image's own forward zeroes dropped prior tokens by a boolean index (`prior_embedding[drop] *= 0`), whose
    size depends on values: on the meta device torch computes it only when told to assume every element is set,
    which changes nothing here but the host's own shapes (ToMe's path sees the token grid alone)."""
    if inputs["hidden_states"].device.type != "meta":
        return run(model, inputs)
    from torch.fx.experimental import _config

    with _config.patch(meta_nonzero_assume_all_nonzero=True):
        return run(model, inputs)
