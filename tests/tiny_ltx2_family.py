"""Tiny LTX-2 (diffusers' LTX2VideoTransformer3DModel): a video stream over a packed latent [B, N, C] whose grid is
its num_frames / height / width arguments (layout "packed"), beside an audio stream [B, audio frames, C]. The config
is diffusers' own test's (tests/models/transformers/test_models_transformer_ltx2.py) with one layer (its test builds
two; the contract runs the family a few dozen times); the inputs are its dummy inputs at a smaller video grid,
called as LTX2Pipeline calls the model (keywords; one timestep for the batch)."""
import torch

from tiny_torch import randomize_

LTX2 = dict(in_channels=4, out_channels=4, patch_size=1, patch_size_t=1, num_attention_heads=2, attention_head_dim=8,
            cross_attention_dim=16, audio_in_channels=4, audio_out_channels=4, audio_num_attention_heads=2,
            audio_attention_head_dim=4, audio_cross_attention_dim=8, num_layers=1, qk_norm="rms_norm_across_heads",
            caption_channels=16, rope_double_precision=False)


def ltx2(seed=0, **config):
    """`config` over the test's: rope_type="split" as LTX-2's released checkpoints are (rows [B, heads, S, D/2])."""
    from diffusers import LTX2VideoTransformer3DModel

    return randomize_(LTX2VideoTransformer3DModel(**{**LTX2, **config}), seed)


def ltx2_inputs(model=None, batch=2, frames=2, h=8, w=8, audio_frames=9, text=6, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return dict(hidden_states=torch.randn(batch, frames * h * w, 4, generator=gen),
                audio_hidden_states=torch.randn(batch, audio_frames, 4, generator=gen),
                encoder_hidden_states=torch.randn(batch, text, 16, generator=gen),
                audio_encoder_hidden_states=torch.randn(batch, text, 16, generator=gen),
                timestep=torch.full((batch,), 500.0),  # one step for the batch, as LTX2Pipeline gives it
                encoder_attention_mask=torch.ones(batch, text, dtype=torch.bool),
                audio_encoder_attention_mask=torch.ones(batch, text, dtype=torch.bool),
                num_frames=frames, height=h, width=w, audio_num_frames=audio_frames, fps=25.0)


def run(model, inputs: dict) -> torch.Tensor:
    """The video output (the family contract's); run_both gives the audio's too."""
    return run_both(model, inputs)[0]


def run_both(model, inputs: dict):
    with torch.no_grad():
        out = model(**inputs)
    return out.sample, out.audio_sample
