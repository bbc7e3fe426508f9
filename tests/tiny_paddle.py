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
