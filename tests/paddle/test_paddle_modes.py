"""mode="downsample" and reuse_steps on paddle: the same results as on torch, through apply_tome."""
import numpy as np
import paddle
import pytest
import torch

import tiny_paddle as TP
import tiny_torch as T
import tomesd
from tomesd.runtime.tome_patch import PATCH_ATTR

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
     dict(ratio=0.5, reuse_steps=3), dict(ratio=0.5, reuse_steps=2, share_across_blocks=True, max_downsample=2),
     dict(ratio={"attn": 0.5, "crossattn": 0.3, "mlp": 0.25})],
    ids=["downsample-nearest", "downsample-avg3", "reuse3", "reuse2-shared", "per-site-ratios"],
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
    if kwargs.get("reuse_steps", 1) > 1:
        # The paddle side reuses for itself: calls 1 and 2 (the second call at 900, and 700) reuse the
        # matching of call 0 in both settings, so they differ from plain ToMe far beyond the tolerance.
        plain = {k: v for k, v in kwargs.items() if k not in ("reuse_steps", "share_across_blocks")}
        paddle_unet.apply_tome(**plain)
        try:
            _, plain_p = run_loop(torch_unet, paddle_unet, timesteps, h=h, w=w)
        finally:
            paddle_unet.remove_tome()
        for i in (1, 2):
            assert np.abs(out_p[i] - plain_p[i]).max() > 100 * TOL, i
    after_t, after_p = run_loop(torch_unet, paddle_unet, timesteps[:1], h=h, w=w)
    assert np.array_equal(after_p[0], base_p[0])  # remove_tome: bit-identical again


def self_attention_pairs(model):
    """A list that fills with (query tokens, key tokens) of each attn1 call, paired per call, and the
    hook handles to remove."""
    pairs, handles = [], []
    for _, block in model.named_sublayers():
        if type(block).__name__ != "BasicTransformerBlock":
            continue
        pending = []
        handles.append(block.attn1.to_q.register_forward_pre_hook(lambda layer, a, p=pending: p.append(a[0].shape[1])))
        handles.append(block.attn1.to_k.register_forward_pre_hook(
            lambda layer, a, p=pending: pairs.append((p.pop(), a[0].shape[1]))))
    return pairs, handles


def test_downsample_shrinks_paddle_keys_in_a_controlnet_pipeline(tmp_path):
    """In the UNet and the ControlNet, a self-attention over the finest grid gets a quarter of the
    keys; every other self-attention keeps its keys, and no query changes."""
    pipe = TP.controlnet_pipeline(tmp_path)
    probes = {name: self_attention_pairs(getattr(pipe, name)) for name in ("unet", "controlnet")}
    TP.run_pipeline(pipe)
    base = {name: list(pairs) for name, (pairs, _) in probes.items()}
    for pairs, _ in probes.values():
        pairs.clear()
    pipe.apply_tome(mode="downsample")
    try:
        assert hasattr(pipe.unet, PATCH_ATTR) and hasattr(pipe.controlnet, PATCH_ATTR)
        TP.run_pipeline(pipe)
    finally:
        pipe.remove_tome()
        for _, handles in probes.values():
            for h in handles:
                h.remove()
    for name, (pairs, _) in probes.items():
        full = max(q for q, _ in base[name])  # the finest level with attention
        assert len(pairs) == len(base[name]) > 0 and [q for q, _ in pairs] == [q for q, _ in base[name]]
        assert sum(q == full for q, _ in pairs) > 0, name
        for (q, k_base), (_, k) in zip(base[name], pairs):
            assert k_base == q and k == (q // 4 if q == full else q), (name, q, k)
    assert not hasattr(pipe.unet, PATCH_ATTR) and not hasattr(pipe.controlnet, PATCH_ATTR)


REFUSED = [
    (dict(mode="downsample", ratio=0.5), "ratio"), (dict(mode="downsample", sx=2), "sx"),
    (dict(mode="downsample", sy=2), "sy"), (dict(mode="downsample", use_rand=True), "use_rand"),
    (dict(mode="downsample", merge_attn=True), "merge_attn"),
    (dict(mode="downsample", merge_crossattn=False), "merge_crossattn"),
    (dict(mode="downsample", merge_mlp=True), "merge_mlp"), (dict(mode="downsample", seed=3), "seed"),
    (dict(mode="downsample", reuse_steps=2), "reuse_steps"),
    (dict(mode="downsample", share_across_blocks=True), "share_across_blocks"),
    (dict(downsample_factor=2), "downsample_factor"), (dict(reuse_steps=0), "reuse_steps"), (dict(mode="x"), "mode"),
]


@pytest.mark.parametrize("kwargs,name", REFUSED, ids=[name + "-" + str(i) for i, (_, name) in enumerate(REFUSED)])
def test_apply_tome_refuses_arguments_the_mode_cannot_use(twin_unets, kwargs, name):
    _, paddle_unet = twin_unets
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        paddle_unet.apply_tome(**kwargs)
    assert not hasattr(paddle_unet, PATCH_ATTR)
