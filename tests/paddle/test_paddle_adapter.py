"""pipe.apply_tome on ppdiffusers: same output as torch for the same weights (default arguments,
no seed needed), and as ppdiffusers' built-in with use_rand=False."""
import subprocess
import sys

import numpy as np
import paddle
import pytest
import torch

import tiny_torch as T
import tomesd
from tomesd import apply_tome as pp_adapter
from tomesd.runtime.tome_patch import PATCH_ATTR


@pytest.fixture(scope="module")
def twin_unets(tmp_path_factory):
    """One set of SD1-shaped weights, loaded in diffusers (torch) and in ppdiffusers (paddle)."""
    from ppdiffusers import UNet2DConditionModel as PaddleUNet

    folder = tmp_path_factory.mktemp("unet")
    torch_unet = T.unet()
    torch_unet.save_pretrained(folder)
    paddle_unet = PaddleUNet.from_pretrained(str(folder), from_diffusers=True)
    paddle_unet.eval()
    return torch_unet, paddle_unet


def run_both(torch_unet, paddle_unet, batch=2, h=16, w=16):
    x, t, c = T.unet_inputs(batch, h, w)
    with torch.no_grad():
        out_t = torch_unet(x, t, c).sample.numpy()
    with paddle.no_grad():
        out_p = paddle_unet(paddle.to_tensor(x.numpy()), paddle.to_tensor(t.numpy()), paddle.to_tensor(c.numpy())).sample.numpy()
    return out_t, out_p


TOL = 2e-4


# seed=None: the default arguments must give parity by themselves (no seed to pass).
@pytest.mark.parametrize("use_rand,seed", [(False, None), (True, None), (True, 3)])
@pytest.mark.parametrize("batch,h,w", [(2, 16, 16), (1, 15, 17)])
def test_torch_and_paddle_unets_agree_under_tome(twin_unets, use_rand, seed, batch, h, w):
    torch_unet, paddle_unet = twin_unets
    base_t, base_p = run_both(torch_unet, paddle_unet, batch, h, w)
    assert np.abs(base_t - base_p).max() < TOL  # the two frameworks agree without ToMe
    kwargs = {} if seed is None else {"seed": seed}
    tomesd.apply_patch(torch_unet, ratio=0.5, use_rand=use_rand, **kwargs)
    paddle_unet.apply_tome(ratio=0.5, use_rand=use_rand, **kwargs)
    try:
        tome_t, tome_p = run_both(torch_unet, paddle_unet, batch, h, w)
    finally:
        tomesd.remove_patch(torch_unet)
        paddle_unet.remove_tome()
    effect = np.abs(tome_t - base_t).max()
    assert effect > 1000 * TOL, effect
    assert np.abs(tome_t - tome_p).max() < TOL
    if use_rand and batch % 2 == 0:  # the random pattern is really used (and really shared)
        tomesd.apply_patch(torch_unet, ratio=0.5, use_rand=False)
        top_left, _ = run_both(torch_unet, paddle_unet, batch, h, w)
        tomesd.remove_patch(torch_unet)
        assert np.abs(top_left - tome_t).max() > 1000 * TOL


@pytest.mark.parametrize("ratio,max_downsample", [(0.5, 1), (0.6, 2)])
def test_paddle_equals_ppdiffusers_builtin(twin_unets, ratio, max_downsample):
    _, paddle_unet = twin_unets
    x, t, c = [paddle.to_tensor(v.numpy()) for v in T.unet_inputs()]

    def run():
        with paddle.no_grad():
            return paddle_unet(x, t, c).sample.numpy()

    base = run()
    with pp_adapter.builtin_methods():
        paddle_unet.apply_tome(ratio=ratio, max_downsample=max_downsample, use_rand=False)
        assert type(paddle_unet.down_blocks[0].attentions[0].transformer_blocks[0]).__name__.startswith("ToMe")
        theirs = run()
        paddle_unet.remove_tome()
    paddle_unet.apply_tome(ratio=ratio, max_downsample=max_downsample, use_rand=False)
    ours = run()
    paddle_unet.remove_tome()
    assert np.abs(ours - base).max() > 1000 * TOL
    assert np.abs(ours - theirs).max() < TOL
    np.testing.assert_array_equal(run(), base)  # removal restores exactly


def test_tome_leaves_paddle_global_rng_alone(twin_unets):
    _, paddle_unet = twin_unets
    x, t, c = [paddle.to_tensor(v.numpy()) for v in T.unet_inputs()]
    paddle.seed(7)
    expected = paddle.rand([6]).numpy()
    paddle_unet.apply_tome(ratio=0.5)  # use_rand on, no seed
    try:
        paddle.seed(7)
        with paddle.no_grad():
            paddle_unet(x, t, c)
        np.testing.assert_array_equal(paddle.rand([6]).numpy(), expected)
    finally:
        paddle_unet.remove_tome()


def test_ratio_limit_and_bad_arguments_leave_layer_untouched(twin_unets):
    _, paddle_unet = twin_unets
    with pytest.raises(ValueError, match="The tome ratio must be less than"):
        paddle_unet.apply_tome(ratio=0.8)  # ppdiffusers' own limit, 1 - 1/(sx*sy)
    with pytest.raises(ValueError, match="sx must be a positive int"):
        paddle_unet.apply_tome(sx=0)
    assert getattr(paddle_unet, PATCH_ATTR, None) is None


@pytest.mark.parametrize("order", ["ppdiffusers first", "tomesd first"])
def test_apply_tome_is_ours_whichever_package_is_imported_first(order):
    first, second = ("ppdiffusers", "tomesd") if order == "ppdiffusers first" else ("tomesd", "ppdiffusers")
    code = (
        f"import {first}, {second}, paddle\n"
        "from ppdiffusers import DiffusionPipeline\n"
        "from tomesd.apply_tome import apply_tome, remove_tome\n"
        "assert paddle.nn.Layer.apply_tome is apply_tome and DiffusionPipeline.apply_tome is apply_tome\n"
        "assert paddle.nn.Layer.remove_tome is remove_tome and DiffusionPipeline.remove_tome is remove_tome\n"
        "print('ours')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "ours" in out.stdout
