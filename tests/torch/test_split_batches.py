"""A batch run as several calls (CFG parallelism runs the guidance halves on two processes; a user loops over
prompts) gives what one call gives, in the default configuration: the random dst pattern is keyed by (seed,
timestep, block), so every call of a step draws alike, odd batches included (tomesd turned random dst off for
them), and models that match each sample on its own merge each sample as in the batch. Flux and Wan match
once for the whole batch (their rotary rows have no batch axis): there merge mode depends on the batch, and
mode="downsample", which reads no token values, splits exactly."""
import pytest
import torch

import tiny_torch as T
import tomesd

TOL = 1e-4  # a batch of one and a batch of two differ by round-off in the host's own matrix products (~1e-5)


def sd1():
    x, t, c = T.unet_inputs(batch=2)
    return T.unet(), dict(sample=x, timestep=t, encoder_hidden_states=c)


def sdxl():
    x, t, c = T.unet_inputs(batch=2)
    model = T.unet(T.SDXL_UNET)
    return model, dict(sample=x, timestep=t, encoder_hidden_states=c)


def transformer(kind):
    return lambda: (T.transformer(kind), T.transformer_inputs(kind, batch=2))


MODELS = {"sd1": (sd1, {}), "sdxl": (sdxl, {}), "sd3": (transformer("sd3"), {}), "pixart": (transformer("pixart"), {}),
          "flux-downsample": (lambda: (T.flux(), T.flux_inputs(h=7, w=9)), dict(mode="downsample")),
          "wan-downsample": (lambda: (T.wan(), T.wan_inputs(h=10, w=14)), dict(mode="downsample"))}


def halves(inputs, i):
    """Sample i of every batched input (the ids and other per-call tensors stay whole)."""
    out = {}
    for name, value in inputs.items():
        batched = isinstance(value, torch.Tensor) and value.ndim > 0 and value.shape[0] == 2 and not name.endswith("_ids")
        out[name] = value[i:i + 1] if batched else value
    return out


def forward(model, inputs):
    with torch.no_grad():
        return model(**inputs).sample


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_batch_split_over_calls_equals_one_call(name):
    build, settings = MODELS[name]
    model, inputs = build()
    base = forward(model, inputs)
    host_split = torch.cat([forward(model, halves(inputs, i)) for i in range(2)])
    assert (host_split - base).abs().max().item() < TOL
    tomesd.apply_patch(model, **(settings or dict(ratio=0.5)))  # otherwise the defaults (use_rand on)
    try:
        joint = forward(model, inputs)
        split = torch.cat([forward(model, halves(inputs, i)) for i in range(2)])
    finally:
        tomesd.remove_patch(model)
    assert (joint - base).abs().max().item() > 100 * TOL  # ToMe acts
    torch.testing.assert_close(split, joint, rtol=0, atol=TOL)
