"""proportional_attention on ppdiffusers: the same weights under diffusers and ppdiffusers weigh the same merged keys
alike (to fp32 round-off), through both ways ppdiffusers computes attention (its classic processors' scores, and
paddle.nn.functional.scaled_dot_product_attention_, inputs [B, S, heads, D]); the weights move the output far beyond
that round-off; removal puts ppdiffusers' functions back; a sliced attention is refused by name."""
import numpy as np
import paddle
import paddle.nn.functional as F
import pytest
import torch

import tiny_paddle as TP
import tiny_torch as T
import tomesd

RTOL = 5e-4  # fp32 round-off relative to the output's size (test_paddle_transformers.py)
SETTINGS = {
    "merge": dict(ratio=0.5),
    "downsample-avg": dict(mode="downsample", downsample_method="avg"),  # pooled keys weigh as their cells
}


def _unet_twins(folder):
    from ppdiffusers import UNet2DConditionModel

    torch_unet = T.unet()
    return torch_unet, TP.load_paddle(UNet2DConditionModel, torch_unet, folder)


def _runs(kind, torch_model, paddle_model):
    """(torch output, paddle output) of one call on the same inputs, as numpy."""
    if kind == "unet":
        x, t, c = T.unet_inputs(2, 16, 16)
        with torch.no_grad():
            out_t = torch_model(x, t, c).sample.numpy()
        with paddle.no_grad():
            out_p = paddle_model(*(paddle.to_tensor(v.numpy()) for v in (x, t, c))).sample.numpy()
        return out_t, out_p
    inputs = T.transformer_inputs(kind, t=700.0, seed=1)
    with paddle.no_grad():
        out_p = paddle_model(**TP.to_paddle(inputs)).sample.numpy()
    return T.run_transformer(torch_model, inputs).numpy(), out_p


def _patched(kind, torch_model, paddle_model, settings):
    tomesd.apply_patch(torch_model, **settings)
    paddle_model.apply_tome(**settings)
    try:
        return _runs(kind, torch_model, paddle_model)
    finally:
        tomesd.remove_patch(torch_model)
        paddle_model.remove_tome()


# unet: ppdiffusers' classic processor on this CPU (its scores); sd3: scaled_dot_product_attention_ (the math stand-in
# tiny_paddle.ensure_math_attention defines where paddle's fused kernels do not load, as on a CPU). Downsampling on a
# UNet is left out: its pooled keys stand alone in whole cells, so their weights cancel in the softmax.
@pytest.mark.parametrize("kind, setting", [("unet", "merge"), ("sd3", "merge"), ("sd3", "downsample-avg")])
def test_torch_and_paddle_weigh_merged_keys_alike(kind, setting, tmp_path):
    torch_model, paddle_model = _unet_twins(tmp_path) if kind == "unet" else TP.twin_transformer(kind, tmp_path)
    base_t, base_p = _runs(kind, torch_model, paddle_model)
    plain_t, plain_p = _patched(kind, torch_model, paddle_model, SETTINGS[setting])
    out_t, out_p = _patched(kind, torch_model, paddle_model, dict(SETTINGS[setting], proportional_attention=True))
    tol = RTOL * np.abs(base_t).max()
    assert np.abs(base_t - base_p).max() < tol  # the unpatched models agree first
    assert np.abs(out_t - plain_t).max() > 100 * tol  # the weights act, far beyond the round-off
    assert np.abs(out_p - plain_p).max() > 100 * tol
    assert np.abs(out_t - out_p).max() < tol
    assert np.array_equal(_runs(kind, torch_model, paddle_model)[1], base_p)  # removed: bit for bit again


def test_removal_puts_ppdiffusers_attention_back(tmp_path):
    from ppdiffusers.models.attention_processor import Attention

    torch_model, paddle_model = TP.twin_transformer("sd3", tmp_path)
    sdpa, scores = F.scaled_dot_product_attention_, Attention.__dict__["get_attention_scores"]
    paddle_model.apply_tome(ratio=0.5, proportional_attention=True)
    assert F.scaled_dot_product_attention_ is not sdpa
    assert Attention.__dict__["get_attention_scores"] is not scores
    paddle_model.remove_tome()
    assert F.scaled_dot_product_attention_ is sdpa and Attention.__dict__["get_attention_scores"] is scores


def test_a_sliced_attention_is_refused_by_name(tmp_path):
    _, paddle_unet = _unet_twins(tmp_path)
    paddle_unet.set_attention_slice(1)
    paddle_unet.apply_tome(ratio=0.5, proportional_attention=True)
    x, t, c = T.unet_inputs(2, 16, 16)
    try:
        with pytest.raises(ValueError, match="SlicedAttnProcessor computes the attention in slices; call "
                                             r"set_attention_slice\(None\)"):
            with paddle.no_grad():
                paddle_unet(*(paddle.to_tensor(v.numpy()) for v in (x, t, c)))
    finally:
        paddle_unet.remove_tome()
