"""Tiny ppdiffusers pipelines: torch-built random weights saved with diffusers and loaded with
`from_diffusers=True`, ppdiffusers' own CLIPTextModel, paddlenlp's CLIPTokenizer."""
from __future__ import annotations

import paddle

import tiny_torch as T
from tiny_configs import CLIP_TEXT, VAE, write_clip_vocab


def load_paddle(cls, torch_model, folder):
    torch_model.save_pretrained(folder)
    model = cls.from_pretrained(str(folder), from_diffusers=True)
    model.eval()
    return model


# Two levels instead of three: what paddle.jit.to_static's translation time grows with.
SMALL_UNET = dict(
    T.SD1_UNET, block_out_channels=(32, 32),
    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
)


def unet(folder, config: dict = T.SD1_UNET, seed: int = 0):
    """A ppdiffusers UNet2DConditionModel with tiny_torch's random weights, in eval mode."""
    from ppdiffusers import UNet2DConditionModel

    return load_paddle(UNet2DConditionModel, T.unet(config, seed), folder)


def unet_inputs(batch: int = 2, h: int = 16, w: int = 16, seed: int = 1):
    """tiny_torch.unet_inputs as paddle tensors."""
    return [paddle.to_tensor(v.numpy()) for v in T.unet_inputs(batch, h, w, seed)]


def controlnet_pipeline(tmp_path, num_controlnets: int = 1):
    from diffusers import AutoencoderKL as TorchVAE
    from diffusers import ControlNetModel as TorchControlNet
    from paddlenlp.transformers import CLIPTokenizer
    from ppdiffusers import AutoencoderKL, ControlNetModel, DDIMScheduler, StableDiffusionControlNetPipeline, UNet2DConditionModel
    from ppdiffusers.transformers import CLIPTextConfig, CLIPTextModel

    vocab_file, merges_file, vocab_size = write_clip_vocab(str(tmp_path))
    tokenizer = CLIPTokenizer(vocab_file, merges_file, max_len=77)
    paddle.seed(0)
    text_encoder = CLIPTextModel(CLIPTextConfig(vocab_size=vocab_size, **CLIP_TEXT))
    text_encoder.eval()
    torch_unet = T.unet()
    unet = load_paddle(UNet2DConditionModel, torch_unet, tmp_path / "unet")
    controlnets = [
        load_paddle(
            ControlNetModel,
            T.randomize_(TorchControlNet.from_unet(torch_unet, conditioning_embedding_out_channels=(8, 16)), seed=10 + i),
            tmp_path / f"controlnet{i}",
        )
        for i in range(num_controlnets)
    ]
    vae = load_paddle(AutoencoderKL, TorchVAE(**VAE), tmp_path / "vae")
    pipe = StableDiffusionControlNetPipeline(
        vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet,
        controlnet=controlnets[0] if num_controlnets == 1 else controlnets,
        scheduler=DDIMScheduler(), safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run_pipeline(pipe, num_controlnets: int = 1):
    paddle.seed(3)
    image = paddle.rand([1, 3, 32, 32])
    return pipe(
        "a tiny test", image=image if num_controlnets == 1 else [image] * num_controlnets,
        num_inference_steps=2, height=32, width=32, output_type="np",
        generator=paddle.Generator().manual_seed(0),
    ).images


def ensure_math_attention() -> None:
    """ppdiffusers' SD3 attention calls paddle.nn.functional.scaled_dot_product_attention_, which
    ppdiffusers defines only when its GPU attention kernels load. On a CPU, supply the math it stands
    for (inputs [B, S, heads, D], softmax(q k^T / sqrt(D)) v); the SD3 tests first prove the unpatched
    paddle model equal to diffusers' with it."""
    import paddle.nn.functional as F

    if hasattr(F, "scaled_dot_product_attention_"):
        return

    def scaled_dot_product_attention_(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                      scale=None, training=True, attention_op=None):
        if attn_mask is not None or is_causal or dropout_p:
            raise NotImplementedError("the CPU stand-in computes plain attention only")
        q, k, v = (t.transpose([0, 2, 1, 3]) for t in (query, key, value))
        weights = F.softmax(paddle.matmul(q, k, transpose_y=True) * (scale or q.shape[-1] ** -0.5), axis=-1)
        return paddle.matmul(weights, v).transpose([0, 2, 1, 3])

    F.scaled_dot_product_attention_ = scaled_dot_product_attention_


def twin_transformer(kind: str, folder):
    """(torch model, the same weights in ppdiffusers): SD3's SD3Transformer2DModel, or PixArt as
    ppdiffusers' Transformer2DModel (ada_norm_single). PixArt without a caption projection:
    ppdiffusers 0.29 cannot build one on paddle 3.3 (paddle.randn(120, C) is read as a dtype)."""
    import ppdiffusers
    from diffusers import PixArtTransformer2DModel

    if kind == "sd3":
        ensure_math_attention()
        torch_model = T.transformer("sd3")
        return torch_model, load_paddle(ppdiffusers.SD3Transformer2DModel, torch_model, folder)
    torch_model = T.randomize_(PixArtTransformer2DModel(**dict(T.PIXART, caption_channels=None)))
    return torch_model, load_paddle(ppdiffusers.Transformer2DModel, torch_model, folder)


def to_paddle(inputs: dict) -> dict:
    return {k: (paddle.to_tensor(v.numpy()) if hasattr(v, "numpy") else v) for k, v in inputs.items()}


def assert_frameworks_agree_where_the_patch_acts(base_t, base_p, out_t, out_p, rtol: float) -> None:
    """Per call (numpy outputs): the unpatched torch and paddle models agree first, to `rtol` of the output's
    size; the patch moves the output by more than 100 times that; patched torch and paddle agree."""
    import numpy as np

    for bt, bp, ot, op in zip(base_t, base_p, out_t, out_p):
        tol = rtol * np.abs(bt).max()
        assert np.abs(bt - bp).max() < tol  # the unpatched models agree first
        assert np.abs(ot - bt).max() > 100 * tol  # the setting acts, far beyond the tolerance
        assert np.abs(ot - op).max() < tol
