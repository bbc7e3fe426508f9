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
