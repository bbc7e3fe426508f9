"""restore_tokens on paddle: the same weights under diffusers and ppdiffusers keep and add the same residuals, step
after step, on a bare model (the timestep rule)."""
import numpy as np
import paddle
import pytest
import torch

import tiny_paddle as P
import tiny_torch as T
import tomesd

TOL = 2e-4
STEPS = (900, 800, 700)


def _steps(model, inputs, to):
    x, _, c = inputs
    outs = []
    for t in STEPS:
        args = to(x), to(torch.tensor(float(t))), to(c)
        outs.append(model(*args).sample.numpy())
    return outs


def test_torch_and_paddle_restore_alike(tmp_path, unpatch):
    torch_unet = T.unet()
    from ppdiffusers import UNet2DConditionModel

    paddle_unet = P.load_paddle(UNet2DConditionModel, torch_unet, tmp_path)
    inputs = T.unet_inputs(batch=2)
    on_torch, on_paddle = (lambda v: v), (lambda v: paddle.to_tensor(v.numpy()))
    settings = dict(ratio=0.5, reuse_steps=2)
    with torch.no_grad():
        tomesd.apply_patch(torch_unet, **settings)
        unpatch(torch_unet)
        reused = _steps(torch_unet, inputs, on_torch)
        tomesd.apply_patch(torch_unet, **settings, restore_tokens=True)
        restored_t = _steps(torch_unet, inputs, on_torch)
    tomesd.apply_patch(paddle_unet, **settings, restore_tokens=True)
    unpatch(paddle_unet)
    with paddle.no_grad():
        restored_p = _steps(paddle_unet, inputs, on_paddle)
    assert np.abs(restored_t[1] - reused[1]).max() > 100 * TOL  # the residuals act at the merged step
    for out_t, out_p in zip(restored_t, restored_p):
        assert np.abs(out_t - out_p).max() < TOL


def test_restore_in_downsample_mode_is_refused_on_paddle_before_anything_changes(tmp_path):
    from ppdiffusers import UNet2DConditionModel

    paddle_unet = P.load_paddle(UNet2DConditionModel, T.unet(), tmp_path)
    with pytest.raises(ValueError, match="mode='downsample' reruns .* PyTorch models only.*use mode='merge'"):
        tomesd.apply_patch(paddle_unet, mode="downsample", reuse_steps=3, restore_tokens=True)
    assert not hasattr(paddle_unet, "_tome_patch")
