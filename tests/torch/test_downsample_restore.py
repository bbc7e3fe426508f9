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
from torch.utils._python_dispatch import TorchDispatchMode

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


class _KeyLengths(TorchDispatchMode):
    """The key count of every fused attention op dispatched inside it (the keys' second-to-last axis)."""

    def __init__(self):
        super().__init__()
        self.keys = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "scaled_dot_product" in str(func):
            self.keys.append(args[1].shape[-2])
        return func(*args, **(kwargs or {}))


def _run_seen(model, inputs):
    """The output, and the key count of each attention the call ran."""
    with _KeyLengths() as seen:
        out = _run(model, inputs)
    return out, seen.keys


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
    base, unpatched_keys = _run_seen(model, inputs(steps[0]))
    assert (base - _run(model, inputs(steps[1]))).abs().max() == 0  # no timestep embedding: steps alike
    scale = base.abs().max()
    tomesd.apply_patch(model, mode="downsample", downsample_method="avg", proportional_attention=prop)
    unpatch(model)
    plain = _run(model, inputs(steps[1]))
    assert (plain - base).abs().max() > 100 * TOL * scale  # downsampling changes the output
    tomesd.apply_patch(model, **SETTINGS, proportional_attention=prop)
    restored, keys = zip(*[_run_seen(model, inputs(t)) for t in steps])
    assert (restored[0] == base).all() and (restored[3] == base).all()  # the windows' first steps: bit for bit
    for out in restored[1:3]:
        assert (out - base).abs().max() < TOL * scale
    # What ran: the later steps attend over fewer keys than the unpatched call (downsampled, not run whole); the
    # windows' first steps run every key and then each downsampled attention once more.
    assert unpatched_keys and keys[1] == keys[2] and sum(keys[1]) < sum(unpatched_keys)
    assert len(keys[1]) == len(unpatched_keys) and keys[0] == keys[3]
    reduced = [k for k, full in zip(keys[1], unpatched_keys) if k < full]
    assert reduced and sorted(keys[0]) == sorted(unpatched_keys + reduced)
    # A quarter of the image's keys, the text's all kept (UNet: 256 -> 64; SD3, Flux: 64 image + 5 text -> 16 + 5).
    assert set(reduced) == {"unet": {64}, "sd3": {21}, "wan": {8}, "flux": {21}}[name]


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


def test_a_pipeline_counts_the_windows_with_the_weights_on(tmp_path):
    """Steps counted by a pipeline's loop, pooled keys weighed: the first UNet call of each window of 3 runs every key
    and each downsampled attention once more (the unpatched run's first call, bit for bit), the others downsample and
    add the residual (they differ from plain downsampling on the same input); removed, the pipeline runs as before.
    (Random weights: how close a residual from an earlier noise level stays is the yardsticks' to price.)"""
    pipe = T.sd_pipeline(tmp_path)

    def run():
        return pipe("a tiny test", num_inference_steps=6, height=32, width=32, output_type="np",
                    generator=torch.Generator().manual_seed(0)).images

    calls, seen, starts = [], _KeyLengths(), []  # (inputs, output, attentions it ran) of each UNet call
    handles = [pipe.unet.register_forward_pre_hook(lambda module, args: starts.append(len(seen.keys))),
               pipe.unet.register_forward_hook(
                   lambda module, args, kwargs, out: calls.append(((args, kwargs), out[0].clone(),
                                                                   len(seen.keys) - starts[-1])), with_kwargs=True)]
    try:
        base = run()
        base_calls = list(calls)
        calls.clear()
        tomesd.apply_patch(pipe, **SETTINGS, proportional_attention=True)
        with seen:
            run()
        restored_calls = list(calls)
        tomesd.apply_patch(pipe, mode="downsample", downsample_method="avg", proportional_attention=True)
        (args, kwargs), _, _ = base_calls[1]
        with torch.no_grad():
            plain = pipe.unet(*args, **kwargs)[0]  # plain downsampling on the unpatched run's second input
        tomesd.remove_patch(pipe)
        after = run()
    finally:
        tomesd.remove_patch(pipe)  # also where a step failed: the SDPA seam is the process's
        for handle in handles:
            handle.remove()
    attentions = [count for _, _, count in restored_calls]
    assert attentions[0] > attentions[1] == attentions[2] and attentions == attentions[:3] * 2  # windows of 3
    assert torch.equal(restored_calls[0][1], base_calls[0][1])
    assert (restored_calls[1][1] - plain).abs().max() > 1e-3  # the residual acts (same input: calls[0] equal)
    assert after.tolist() == base.tolist()  # removed: as before


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
