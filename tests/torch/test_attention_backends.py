"""ToMe under the attention kernels of diffusers' dispatcher that this machine has (native, _native_math, flex on the
CPU): merge and downsample run under each and give what they give under the default, to fp32 round-off; proportional
attention runs where the kernel is torch's SDPA and is refused by name elsewhere (flex), at the first call."""
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


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_proportional_attention_runs_on_sdpa_kernels_and_is_refused_by_name_elsewhere(kind, backend):
    build, inputs = MODELS[kind]
    model, x = build(), inputs()
    tomesd.apply_patch(model, ratio=0.5, proportional_attention=True)
    try:
        default = _run(model, x)
        if backend == "flex":  # its own kernel: no SDPA call to carry the key weights
            with pytest.raises(RuntimeError, match="proportional_attention off, or run the attention through torch's SDPA"):
                _run(model, x, backend)
            assert torch.equal(_run(model, x), default)  # the refused call left nothing behind
        else:
            assert torch.allclose(_run(model, x, backend), default, rtol=0, atol=TOL)
    finally:
        tomesd.remove_patch(model)
