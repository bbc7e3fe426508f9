"""SD3 and PixArt on ppdiffusers: the same weights as in diffusers give the same outputs under ToMe,
in every mode, with text tokens untouched; ppdiffusers' fused inference path is refused."""
import numpy as np
import paddle
import pytest
import torch

import tiny_paddle as TP
import tiny_torch as T
import tomesd
from tomesd.runtime.tome_patch import PATCH_ATTR

# fp32 round-off relative to the output's size: the strong random weights amplify it through the blocks
# (outputs reach ~18; unpatched, the frameworks differ by up to 5e-5 of that, patched by up to 2.1e-4).
RTOL = 5e-4


@pytest.fixture(scope="module", params=["sd3", "pixart"])
def twins(request, tmp_path_factory):
    return (request.param,) + TP.twin_transformer(request.param, tmp_path_factory.mktemp(request.param))


def text_tokens(model):
    """Tokens entering SD3's text projections (add_q_proj) in each block, and the hook handles."""
    seen = []
    handles = [m.add_q_proj.register_forward_pre_hook(lambda layer, a: seen.append(a[0].shape[1]))
               for _, m in model.named_sublayers() if getattr(m, "add_q_proj", None) is not None]
    return seen, handles


def run_loop(kind, torch_model, paddle_model, timesteps):
    outs_t, outs_p = [], []
    for i, t in enumerate(timesteps):
        inputs = T.transformer_inputs("pixart" if kind == "pixart" else kind, t=t, seed=i)
        outs_t.append(T.run_transformer(torch_model, inputs).numpy())
        with paddle.no_grad():
            outs_p.append(paddle_model(**TP.to_paddle(inputs)).sample.numpy())
    return outs_t, outs_p


SETTINGS = {
    "merge": dict(ratio=0.5), "merge-top-left": dict(ratio=0.5, use_rand=False),
    "downsample": dict(mode="downsample"), "downsample-avg": dict(mode="downsample", downsample_method="avg"),
    "reuse3": dict(ratio=0.5, reuse_steps=3),
}


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_torch_and_paddle_agree_over_a_denoising_loop(twins, setting):
    kind, torch_model, paddle_model = twins
    kwargs = SETTINGS[setting]
    timesteps = [900.0, 900.0, 700.0, 500.0]
    base_t, base_p = run_loop(kind, torch_model, paddle_model, timesteps)
    tomesd.apply_patch(torch_model, **kwargs)
    paddle_model.apply_tome(**kwargs)
    seen, handles = text_tokens(paddle_model)
    try:
        out_t, out_p = run_loop(kind, torch_model, paddle_model, timesteps)
    finally:
        for handle in handles:
            handle.remove()
        tomesd.remove_patch(torch_model)
        paddle_model.remove_tome()
    TP.assert_frameworks_agree_where_the_patch_acts(base_t, base_p, out_t, out_p, RTOL)
    if kind == "sd3":
        assert seen == [5] * (3 * len(timesteps))  # paddle's text tokens never merge
    if "reuse_steps" in kwargs:  # paddle's reusing steps (calls 1 and 2) are not plain ToMe
        paddle_model.apply_tome(ratio=0.5)
        try:
            _, plain_p = run_loop(kind, torch_model, paddle_model, timesteps)
        finally:
            paddle_model.remove_tome()
        assert all(np.abs(out_p[i] - plain_p[i]).max() > 100 * RTOL * np.abs(plain_p[i]).max() for i in (1, 2))
    _, after_p = run_loop(kind, torch_model, paddle_model, timesteps[:1])
    assert np.array_equal(after_p[0], base_p[0])  # remove_tome: bit-identical again


def test_paddle_refuses_max_downsample_on_a_transformer_and_the_fused_inference_path(twins):
    kind, _, paddle_model = twins
    with pytest.raises(ValueError, match="^max_downsample"):
        paddle_model.apply_tome(ratio=0.5, max_downsample=1)
    paddle_model.inference_optimize = True  # what INFERENCE_OPTIMIZE=True at build time sets
    try:
        with pytest.raises(ValueError, match="INFERENCE_OPTIMIZE"):
            paddle_model.apply_tome(ratio=0.5)
    finally:
        paddle_model.inference_optimize = False
    assert not hasattr(paddle_model, PATCH_ATTR)


@pytest.mark.parametrize("h,w", [(6, 10), (7, 9)])
def test_flux_matching_on_coordinates_is_the_same_on_paddle(h, w):
    """ppdiffusers has no Flux, but the core's one-matching-per-batch merge on grid coordinates is
    framework-free: on paddle tensors it merges the same tokens, with the same representatives and rows."""
    from tome_core import compute_shared_merge, get_backend, rng

    ids = T.flux_inputs(h=h, w=w)["img_ids"]
    metric = torch.randn(3, h * w, 8, generator=torch.Generator().manual_seed(0))
    x = torch.randn(3, h * w, 5, generator=torch.Generator().manual_seed(1))
    table = torch.arange(7 + h * w, dtype=torch.float32).reshape(-1, 1)
    results = {}
    for name, conv in (("torch", lambda a: a), ("paddle", lambda a: paddle.to_tensor(a.numpy()))):
        rows, cols = conv(ids[:, 1].long()), conv(ids[:, 2].long())
        xp = get_backend(rows)
        offsets = rng.randint(xp, rows, [h * w // 4], 4, rng.call_key(xp, 0, None))
        merge = compute_shared_merge(xp, conv(metric), (rows, cols), (2, 2), h * w // 2, offsets)
        results[name] = [np.asarray(t) for t in (merge.unmerge(merge.merge(conv(x))), merge.representatives,
                                                   merge.gather_rows(conv(table)))]
    assert np.abs(results["torch"][0] - x.numpy()).max() > 1e-1  # the merge acts
    for ours, theirs in zip(results["torch"], results["paddle"]):
        assert np.abs(ours - theirs).max() < 1e-6
