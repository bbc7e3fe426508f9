"""mode="downsample" and reuse_steps on paddle: the same results as on torch, through apply_tome."""
import numpy as np
import paddle
import pytest
import torch

import tiny_paddle as TP
import tiny_torch as T
import tomesd
from tomesd.adapters.hooks import PATCH_ATTR

TOL = 2e-4


@pytest.fixture(scope="module")
def twin_unets(tmp_path_factory):
    torch_unet = T.unet()
    return torch_unet, TP.load_paddle(__import__("ppdiffusers").UNet2DConditionModel, torch_unet,
                                      tmp_path_factory.mktemp("unet"))


def run_loop(torch_unet, paddle_unet, timesteps, batch=2, h=16, w=16):
    outs_t, outs_p = [], []
    for i, t in enumerate(timesteps):
        x, _, c = T.unet_inputs(batch, h, w, seed=i)
        with torch.no_grad():
            outs_t.append(torch_unet(x, torch.tensor(t), c).sample.numpy())
        with paddle.no_grad():
            outs_p.append(paddle_unet(paddle.to_tensor(x.numpy()), paddle.to_tensor(t),
                                      paddle.to_tensor(c.numpy())).sample.numpy())
    return outs_t, outs_p


@pytest.mark.parametrize(
    "kwargs",
    [dict(mode="downsample"), dict(mode="downsample", downsample_method="avg", downsample_factor=3),
     dict(ratio=0.5, reuse_steps=3), dict(ratio=0.5, reuse_steps=2, share_across_blocks=True, max_downsample=2)],
    ids=["downsample-nearest", "downsample-avg3", "reuse3", "reuse2-shared"],
)
@pytest.mark.parametrize("h,w", [(16, 16), (15, 17)])
def test_torch_and_paddle_agree_over_a_denoising_loop(twin_unets, kwargs, h, w):
    torch_unet, paddle_unet = twin_unets
    timesteps = [900, 900, 700, 500, 300]  # the repeated 900: a second call in the same step
    base_t, base_p = run_loop(torch_unet, paddle_unet, timesteps, h=h, w=w)
    tomesd.apply_patch(torch_unet, **kwargs)
    paddle_unet.apply_tome(**kwargs)
    try:
        out_t, out_p = run_loop(torch_unet, paddle_unet, timesteps, h=h, w=w)
    finally:
        tomesd.remove_patch(torch_unet)
        paddle_unet.remove_tome()
    for bt, bp, ot, op in zip(base_t, base_p, out_t, out_p):
        assert np.abs(bt - bp).max() < TOL
        assert np.abs(ot - bt).max() > 1000 * TOL  # the mode acts, far beyond the tolerance
        assert np.abs(ot - op).max() < TOL
    after_t, after_p = run_loop(torch_unet, paddle_unet, timesteps[:1], h=h, w=w)
    assert np.array_equal(after_p[0], base_p[0])  # remove_tome: bit-identical again


def test_downsample_shrinks_paddle_keys_in_a_controlnet_pipeline(tmp_path):
    pipe = TP.controlnet_pipeline(tmp_path)
    keys = []
    handles = [
        m.attn1.to_k.register_forward_pre_hook(lambda layer, args: keys.append(args[0].shape[1]))
        for _, m in pipe.unet.named_sublayers() if type(m).__name__ == "BasicTransformerBlock"
    ] + [
        m.attn1.to_k.register_forward_pre_hook(lambda layer, args: keys.append(-args[0].shape[1]))
        for _, m in pipe.controlnet.named_sublayers() if type(m).__name__ == "BasicTransformerBlock"
    ]
    pipe.apply_tome(mode="downsample")
    try:
        assert hasattr(pipe.unet, PATCH_ATTR) and hasattr(pipe.controlnet, PATCH_ATTR)
        TP.run_pipeline(pipe)
    finally:
        pipe.remove_tome()
        for h in handles:
            h.remove()
    full = max(abs(k) for k in keys)
    assert full // 4 in keys and -(full // 4) in keys  # UNet and ControlNet keys both downsampled
    assert not hasattr(pipe.unet, PATCH_ATTR) and not hasattr(pipe.controlnet, PATCH_ATTR)


@pytest.mark.parametrize("kwargs", [dict(mode="downsample", ratio=0.5), dict(mode="downsample", seed=3),
                                    dict(downsample_factor=2), dict(reuse_steps=0), dict(mode="x")])
def test_apply_tome_refuses_arguments_the_mode_cannot_use(twin_unets, kwargs):
    _, paddle_unet = twin_unets
    with pytest.raises((ValueError, TypeError)):
        paddle_unet.apply_tome(**kwargs)
    assert not hasattr(paddle_unet, PATCH_ATTR)
