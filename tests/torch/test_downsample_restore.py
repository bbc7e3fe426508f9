"""restore_tokens in downsample mode: each window's first step runs every key, and each downsampled attention keeps
its output minus its output with the downsampled keys (it runs twice there); the window's later steps add that to
what they compute with the downsampled keys.

The exact property: where a later step's attention inputs equal the first step's, the restored output is the
unpatched one (round-off) where plain downsampling is far off. A model whose timestep embedding is zero sees the
same inputs at every step. One model per way the families downsample: a UNet (the attention's own context
argument), SD3 (the key and value projections; its joint attention restores the text's output too), Wan and Flux
(diffusers' attention dispatch)."""
import pytest
import torch

import tiny_torch as T
import tomesd
from tomesd.backends import torch_dispatch

TOL = 1e-4
SETTINGS = dict(mode="downsample", downsample_method="avg", reuse_steps=3, restore_tokens=True)


def _family(name):
    """(model whose steps see the same inputs, inputs at a timestep, the timesteps of four steps)."""
    if name == "unet":
        model, (sample, _, text) = T.unet(), T.unet_inputs(batch=2)
        inputs = lambda t: dict(sample=sample, timestep=torch.tensor(float(t)), encoder_hidden_states=text)
        steps = (900, 800, 700, 600)
    elif name == "sd3":
        model, base = T.transformer("sd3"), T.transformer_inputs("sd3")
        inputs = lambda t: dict(base, timestep=torch.full((2,), float(t)))
        steps = (900, 800, 700, 600)
    elif name == "wan":
        model, base = T.wan(), T.wan_inputs(frames=2)
        inputs = lambda t: dict(base, timestep=torch.full((2,), float(t)))
        steps = (900, 800, 700, 600)
    else:
        model, base = T.flux(), T.flux_inputs()
        inputs = lambda t: dict(base, timestep=torch.full((2,), t))
        steps = (0.9, 0.8, 0.7, 0.6)
    with torch.no_grad():
        for path, module in model.named_modules():
            if path.endswith(("time_embedding.linear_2", "timestep_embedder.linear_2", "time_embedder.linear_2")):
                module.weight.zero_()
                module.bias.zero_()
    return model, inputs, steps


def _run(model, inputs):
    with torch.no_grad():
        return model(**inputs).sample


# Wan and Flux downsample at diffusers' attention dispatch, which the paddle stack's diffusers (env (b)) predates.
AT_DISPATCH = pytest.mark.skipif(not torch_dispatch.available(), reason="this diffusers has no attention dispatch "
                                 "(env (a), current diffusers, runs it)")


@pytest.mark.parametrize("name, prop", [("unet", False), ("sd3", False), ("sd3", True),
                                        pytest.param("wan", False, marks=AT_DISPATCH),
                                        pytest.param("flux", False, marks=AT_DISPATCH),
                                        pytest.param("flux", True, marks=AT_DISPATCH)])
def test_later_steps_restore_what_downsampling_changed_and_plain_downsampling_does_not(name, prop, unpatch):
    """With proportional attention the downsampled run alone weighs its keys (Flux: at the dispatch, where the
    first step runs the attention call itself twice)."""
    model, inputs, steps = _family(name)
    base = _run(model, inputs(steps[0]))
    assert (base - _run(model, inputs(steps[1]))).abs().max() == 0  # no timestep embedding: steps alike
    scale = base.abs().max()
    tomesd.apply_patch(model, mode="downsample", downsample_method="avg", proportional_attention=prop)
    unpatch(model)
    plain = _run(model, inputs(steps[1]))
    assert (plain - base).abs().max() > 100 * TOL * scale  # downsampling changes the output
    tomesd.apply_patch(model, **SETTINGS, proportional_attention=prop)
    restored = [_run(model, inputs(t)) for t in steps]
    assert (restored[0] == base).all() and (restored[3] == base).all()  # the windows' first steps: bit for bit
    for out in restored[1:3]:
        assert (out - base).abs().max() < TOL * scale


def test_each_call_of_a_step_keeps_its_own_residuals(unpatch):
    """Guidance as two calls per step (different text): each call restores from its own residuals."""
    model, inputs, steps = _family("sd3")
    other = dict(inputs(0), encoder_hidden_states=inputs(0)["encoder_hidden_states"].flip(0))
    other_at = lambda t: dict(other, timestep=torch.full((2,), float(t)))
    bases = _run(model, inputs(steps[0])), _run(model, other_at(steps[0]))
    assert (bases[0] - bases[1]).abs().max() > 0.1 * bases[0].abs().max()
    tomesd.apply_patch(model, **SETTINGS)
    unpatch(model)
    for t in steps[:2]:
        outs = _run(model, inputs(t)), _run(model, other_at(t))
    for out, base in zip(outs, bases):
        assert (out - base).abs().max() < TOL * base.abs().max()


def test_proportional_attention_and_a_pipeline_restore_alike(tmp_path):
    """With the pooled keys weighed and steps counted by a pipeline's loop, the window's first step still runs every
    key (so equals the unpatched run's first step bit for bit) and the other steps differ from plain downsampling."""
    pipe = T.sd_pipeline(tmp_path)
    base = T.run_pipeline(pipe)
    tomesd.apply_patch(pipe, mode="downsample", downsample_method="avg", proportional_attention=True)
    plain = T.run_pipeline(pipe)
    tomesd.apply_patch(pipe, **SETTINGS, proportional_attention=True)
    restored = T.run_pipeline(pipe)
    tomesd.remove_patch(pipe)
    assert (torch.as_tensor(plain) - torch.as_tensor(base)).abs().max() > 1e-3
    assert (torch.as_tensor(restored) - torch.as_tensor(plain)).abs().max() > 1e-3
    assert T.run_pipeline(pipe).tolist() == base.tolist()  # removed: as before


def test_a_residual_serves_only_the_window_it_was_taken_in(unpatch):
    """A call that ran at an earlier window's first step but not at this one's (guidance left out of a step, as a
    guidance interval does) gets nothing added: plain downsampling, not an older window's residual."""
    model, inputs, steps = _family("sd3")
    other = dict(inputs(0), encoder_hidden_states=inputs(0)["encoder_hidden_states"].flip(0))
    other_at = lambda t: dict(other, timestep=torch.full((2,), float(t)))
    tomesd.apply_patch(model, mode="downsample", downsample_method="avg")
    unpatch(model)
    plain = _run(model, other_at(300))
    tomesd.apply_patch(model, mode="downsample", downsample_method="avg", reuse_steps=2, restore_tokens=True)
    for t in (900, 800):  # the first window: both calls at both steps
        _run(model, inputs(t)), _run(model, other_at(t))
    _run(model, inputs(400))  # the second window's first step: one call
    _run(model, inputs(300))
    second = _run(model, other_at(300))
    assert (second - plain).abs().max() < TOL * plain.abs().max()
    assert (second - _run(model, other_at(900))).abs().max() > 0.1  # steps alike: the old residual would restore it
