"""restore_tokens: the first step of each reuse_steps window runs unmerged and keeps each merging site's residual
(its output minus the output unmerged from its rows' means); the window's merged steps add it to what they unmerge.

The exact property: a site whose sub-layer is token-wise linear commutes with the row mean, so at a merged step
whose site input equals the unmerged step's, the restored output equals the unmerged one (round-off), where plain
unmerging copies each row's mean. A UNet with linear feed-forwards and no timestep embedding gives every step the
same site inputs."""
import pytest
import torch

import tiny_torch as T
import tomesd

TOL = 1e-5
SETTINGS = dict(ratio=0.5, merge_attn=False, merge_mlp=True, reuse_steps=3)


def _linear_unet():
    """A tiny SD UNet whose feed-forwards are one Linear each and whose timestep embedding is zero (every step sees
    the same block inputs)."""
    from diffusers.models.attention import BasicTransformerBlock

    model = T.unet()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for block in [m for m in model.modules() if isinstance(m, BasicTransformerBlock)]:
            width = block.norm3.normalized_shape[0]
            block.ff = torch.nn.Linear(width, width)
            block.ff.weight.copy_(torch.randn(width, width, generator=gen) / width ** 0.5)
            block.ff.bias.copy_(0.1 * torch.randn(width, generator=gen))
        model.time_embedding.linear_2.weight.zero_()
        model.time_embedding.linear_2.bias.zero_()
    return model


def _run(model, sample, text, t):
    with torch.no_grad():
        return model(sample, torch.tensor(float(t)), encoder_hidden_states=text).sample


def test_merged_steps_restore_a_linear_site_exactly_and_unrestored_merging_does_not(unpatch):
    model = _linear_unet()
    sample, _, text = T.unet_inputs(batch=2)
    base = _run(model, sample, text, 900)
    assert (base - _run(model, sample, text, 800)).abs().max() == 0  # no timestep embedding: steps alike
    tomesd.apply_patch(model, **SETTINGS)
    unpatch(model)
    plain = [_run(model, sample, text, t) for t in (900, 800, 700)]
    assert (plain[1] - base).abs().max() > 1000 * TOL  # merging changes the output
    tomesd.apply_patch(model, **SETTINGS, restore_tokens=True)
    with tomesd.observe(model) as seen:
        restored = [_run(model, sample, text, t) for t in (900, 800, 700, 600)]
    assert [call.merged_blocks("mlp") for call in seen.calls] == [[], [0, 4, 5], [0, 4, 5], []]  # windows of 3 steps
    assert (restored[0] == base).all() and (restored[3] == base).all()  # the unmerged steps: bit for bit
    assert (restored[1] - base).abs().max() < TOL and (restored[2] - base).abs().max() < TOL


def test_each_call_of_a_step_keeps_its_own_residuals(unpatch):
    """Guidance as two calls per step: each call restores from its own residuals (one residual per site would give
    the second call the first's)."""
    model = _linear_unet()
    sample, _, text = T.unet_inputs(batch=1)
    other = torch.randn(sample.shape, generator=torch.Generator().manual_seed(9))
    base = [_run(model, x, text, 900) for x in (sample, other)]
    tomesd.apply_patch(model, **SETTINGS, restore_tokens=True)
    unpatch(model)
    for t in (900, 800):
        outs = [_run(model, x, text, t) for x in (sample, other)]
    assert (base[0] - base[1]).abs().max() > 1000 * TOL
    assert all((out - ref).abs().max() < TOL for out, ref in zip(outs, base))


def test_a_pipeline_restores_by_its_loop_with_no_host_reads(tmp_path):
    """Through a pipeline's step clock: the window's first step runs unmerged (every call of it), the others merge,
    and the run reads on the host exactly what the unpatched run reads."""
    from probes import count_host_reads

    pipe = T.sd_pipeline(tmp_path)
    pipe.set_progress_bar_config(disable=True)

    def run():
        return pipe("a tiny test", num_inference_steps=6, height=32, width=32, output_type="np",
                    generator=torch.Generator().manual_seed(0)).images

    base, base_reads = count_host_reads(run)
    tomesd.apply_patch(pipe, ratio=0.5, reuse_steps=3)
    reused = run()
    tomesd.apply_patch(pipe, ratio=0.5, reuse_steps=3, restore_tokens=True)
    with tomesd.observe(pipe.unet) as seen:
        restored, reads = count_host_reads(run)
    tomesd.remove_patch(pipe)
    assert reads == base_reads
    assert [call.merged_blocks("attn") for call in seen.calls] == [[], [0, 4, 5], [0, 4, 5]] * 2
    assert abs(restored - reused).max() > 100 * TOL  # the residuals act
    assert (pipe.unet.__dict__.get("_tome_patch") is None)


@pytest.mark.parametrize("settings, message", [
    (dict(restore_tokens=True), "give reuse_steps=2 or more"),
    (dict(restore_tokens=True, reuse_steps=1), "give reuse_steps=2 or more"),
    (dict(restore_tokens=True, mode="downsample"), "restores what downsampling changed .* give reuse_steps=2"),
    (dict(reuse_steps=3, mode="downsample"), "reuse_steps=3 has no meaning with mode='downsample' alone.*"
                                             "Give restore_tokens=True"),
    (dict(restore_tokens=1, reuse_steps=2), "restore_tokens must be True or False"),
])
def test_bad_restore_settings_are_refused_before_anything_changes(settings, message):
    model = T.unet()
    with pytest.raises(ValueError, match=message):
        tomesd.apply_patch(model, **settings)
    assert not hasattr(model, "_tome_patch")


def test_a_compiled_denoiser_is_refused_at_apply_time(tmp_path):
    """A pipeline counts its steps on the host, so reuse_steps compiles there; restore_tokens does not: refused."""
    pipe = T.sd_pipeline(tmp_path)
    plain = pipe.unet
    pipe.unet = torch.compile(plain, backend="eager")
    try:
        with pytest.raises(ValueError, match="restore_tokens runs eagerly.*reuse_steps without restore_tokens"):
            tomesd.apply_patch(pipe, ratio=0.5, reuse_steps=2, restore_tokens=True)
        assert not hasattr(plain, "_tome_patch") and "step" not in vars(pipe.scheduler)
    finally:
        torch._dynamo.reset()
