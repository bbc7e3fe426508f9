"""ToMe under the attention kernels of diffusers' dispatcher that this machine has (native, _native_math, flex on the
CPU): merge and downsample run under each and give what they give under the default, to fp32 round-off, and so does
proportional attention, whose weights join the keys at the dispatch, before the kernel."""
import pytest
import torch

import tiny_torch as T
import tomesd

TOL = 1e-5
MODELS = {"flux": (T.flux, lambda: T.flux_inputs(batch=1)), "wan": (T.wan, lambda: T.wan_inputs(batch=1))}
BACKENDS = ["native", "_native_math", "flex"]
SETTINGS = {"merge": dict(ratio=0.5), "downsample": dict(mode="downsample")}


def _run(model, inputs, backend=None):
    from diffusers.models.attention_dispatch import attention_backend

    with torch.no_grad():
        if backend is None:
            return model(**inputs).sample
        with attention_backend(backend):  # restores the process-wide backend after
            return model(**inputs).sample


@pytest.mark.parametrize("setting", sorted(SETTINGS))
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_merge_and_downsample_run_under_each_kernel(kind, backend, setting):
    build, inputs = MODELS[kind]
    model, x = build(), inputs()
    plain = _run(model, x, backend)
    tomesd.apply_patch(model, **SETTINGS[setting])
    try:
        default, under = _run(model, x), _run(model, x, backend)
    finally:
        tomesd.remove_patch(model)
    assert (under - plain).abs().max() > 1000 * TOL  # ToMe acts under this kernel
    assert torch.allclose(under, default, rtol=0, atol=TOL)


@pytest.mark.parametrize("setting", ["merge", "downsample"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_proportional_attention_runs_under_each_kernel(kind, backend, setting):
    """The weights join queries, keys and values at diffusers' dispatch, one channel wider, before the kernel runs."""
    build, inputs = MODELS[kind]
    model, x = build(), inputs()
    settings = dict(SETTINGS[setting], downsample_factor=3, downsample_method="avg") if setting == "downsample" \
        else SETTINGS[setting]  # (factor 3 on the tiny grids: cells of unequal size, so the weights act)
    tomesd.apply_patch(model, **settings)
    try:
        unweighed = _run(model, x, backend)
    finally:
        tomesd.remove_patch(model)
    tomesd.apply_patch(model, proportional_attention=True, **settings)
    try:
        default, under = _run(model, x), _run(model, x, backend)
    finally:
        tomesd.remove_patch(model)
    assert (under - unweighed).abs().max() > 100 * TOL  # the weights act under this kernel
    assert torch.allclose(under, default, rtol=0, atol=TOL)


def test_an_attention_that_skips_the_dispatch_is_refused_naming_the_dispatch(monkeypatch):
    """With the weights at diffusers' dispatch, an attention computed without it (a processor's own softmax) would run
    unweighed: the first call refuses, naming the dispatch and what works."""
    import diffusers.models.transformers.transformer_wan as wan

    def own_softmax(query, key, value, **_):  # [B, S, heads, D], as the dispatch takes them
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
        return (scores.softmax(-1) @ v).transpose(1, 2)

    model, x = T.wan(), T.wan_inputs(batch=1)
    tomesd.apply_patch(model, ratio=0.5, proportional_attention=True)
    try:
        monkeypatch.setattr(wan, "dispatch_attention_fn", own_softmax)
        with pytest.raises(RuntimeError, match=r"weighs merged keys in diffusers' attention dispatch "
                                               r"\(dispatch_attention_fn\).*made no call of it.*calls "
                                               r"dispatch_attention_fn"):
            _run(model, x)
    finally:
        tomesd.remove_patch(model)
