"""reuse_steps on a patched pipeline: the pipeline's own loop (its scheduler's `set_timesteps` and
`step`) says which denoising step a call belongs to, so no tensor value is read on the host and a
compiled denoiser runs one graph per kind of step. A bare model keeps the timestep rule."""
import copy

import pytest
import torch
import torch._dynamo

import tiny_torch as T
import tomesd
from probes import CountingBackend
from tomesd.adapters import hooks
from tomesd.backends.torch import TorchBackend

STEPS = 6
TOL = 1e-5


def count_matchings(monkeypatch):
    """A list that grows by one per matching computed (UNet grids and transformer grids alike)."""
    seen = []
    real = hooks.compute_merge
    monkeypatch.setattr(hooks, "compute_merge", lambda *a, **k: seen.append(1) or real(*a, **k))
    return seen


def per_call(pipe, seen, denoiser="unet"):
    """Runs `pipe` (returns images) and the matchings computed at each denoiser call."""
    counts, handles = [], []
    model = getattr(pipe, denoiser)
    handles.append(model.register_forward_pre_hook(lambda m, a: counts.append(len(seen))))
    try:
        images = run(pipe, denoiser)
    finally:
        for h in handles:
            h.remove()
    counts.append(len(seen))
    return images, [b - a for a, b in zip(counts, counts[1:])]


def run(pipe, denoiser="unet"):
    common = dict(num_inference_steps=STEPS, height=32, width=32, output_type="np",
                  generator=torch.Generator().manual_seed(0))
    if denoiser == "unet":
        return pipe("a tiny test", **common).images
    return pipe("a tiny test", guidance_scale=2.0, **common).images



def test_a_patched_pipeline_takes_steps_from_its_loop_and_reads_no_tensor(tmp_path, monkeypatch):
    pipe = T.sd_pipeline(tmp_path)
    pipe.set_progress_bar_config(disable=True)
    base = run(pipe)
    tomesd.apply_patch(pipe.unet, ratio=0.5)
    exact = run(pipe)
    tomesd.apply_patch(pipe.unet, ratio=0.5, reuse_steps=3)  # a bare model: the timestep rule
    by_timestep = run(pipe)
    tomesd.remove_patch(pipe.unet)
    seen = count_matchings(monkeypatch)
    tomesd.apply_patch(pipe, ratio=0.5, reuse_steps=3)
    with monkeypatch.context() as m:
        m.setattr(TorchBackend, "host_float", lambda self, x: (_ for _ in ()).throw(AssertionError("host read")))
        images, counts = per_call(pipe, seen)
        again, counts_again = per_call(pipe, seen)  # a second run starts afresh
    assert counts == counts_again == [3, 0, 0, 3, 0, 0]  # matched at steps 0 and 3 (3 merging blocks)
    assert abs(exact - base).max() > 1000 * TOL and abs(images - exact).max() > 100 * TOL  # reuse acts
    assert (images == by_timestep).all() and (again == images).all()  # the same steps as the timestep rule
    tomesd.remove_patch(pipe)
    assert not {"step", "set_timesteps"} & set(vars(pipe.scheduler))  # the scheduler is its own again
    assert (run(pipe) == base).all()


def test_a_scheduler_swapped_in_after_apply_patch_is_followed(tmp_path, monkeypatch, no_host_reads):
    from diffusers import EulerDiscreteScheduler

    pipe = T.sd_pipeline(tmp_path)
    pipe.set_progress_bar_config(disable=True)
    tomesd.apply_patch(pipe, ratio=0.5, reuse_steps=2)
    old = pipe.scheduler
    pipe.scheduler = EulerDiscreteScheduler.from_config(pipe.scheduler.config)
    seen = count_matchings(monkeypatch)
    _, counts = per_call(pipe, seen)
    assert counts == [3, 0, 3, 0, 3, 0]  # without following, the new scheduler's steps would never count
    assert not {"step", "set_timesteps"} & set(vars(old))
    tomesd.remove_patch(pipe)
    assert not {"step", "set_timesteps"} & set(vars(pipe.scheduler))


def test_a_copy_of_a_patched_pipeline_counts_its_own_steps(tmp_path, monkeypatch, no_host_reads):
    pipe = T.sd_pipeline(tmp_path)
    pipe.set_progress_bar_config(disable=True)
    tomesd.apply_patch(pipe, ratio=0.5, reuse_steps=3)
    seen = count_matchings(monkeypatch)
    images, counts = per_call(pipe, seen)
    twin = copy.deepcopy(pipe)
    assert twin.scheduler.step.clock is not pipe.scheduler.step.clock
    assert twin.scheduler.step.clock.pipeline is twin and not twin.scheduler.step.clock.kept
    twin_images, twin_counts = per_call(twin, seen)
    assert twin_counts == counts and (twin_images == images).all()
    tomesd.remove_patch(twin)  # removing the copy's patch leaves the original's
    assert pipe.scheduler.step.clock.pipeline is pipe
    assert per_call(pipe, seen)[1] == counts


def test_a_compiled_transformer_in_a_pipeline_reuses_with_two_graphs_and_no_recompile(tmp_path, monkeypatch):
    """SD3 pipeline, reuse_steps=2, transformer compiled with fullgraph=True: one graph for a matching
    step and one for a reusing step, over two runs of 6 steps, equal to the eager pipeline."""
    torch._dynamo.reset()
    pipe = T.sd3_pipeline(tmp_path)
    base = run(pipe, "transformer")
    seen = count_matchings(monkeypatch)
    tomesd.apply_patch(pipe, ratio=0.5, reuse_steps=2)
    eager, counts = per_call(pipe, seen, "transformer")
    assert counts == [3, 0] * 3  # 3 joint blocks; the CFG halves run as one call
    assert abs(eager - base).max() > 1000 * TOL
    monkeypatch.undo()  # the counting spy appends to a list, which a compiled graph would guard on
    backend = CountingBackend()
    plain_transformer = pipe.transformer
    pipe.transformer = torch.compile(plain_transformer, fullgraph=True, backend=backend)
    try:
        compiled = run(pipe, "transformer")
        assert backend.graphs == 2
        with torch._dynamo.config.patch(error_on_recompile=True):
            again = run(pipe, "transformer")
    finally:
        pipe.transformer = plain_transformer
        torch._dynamo.reset()
    assert backend.graphs == 2
    assert abs(compiled - eager).max() < TOL and abs(again - eager).max() < TOL
    tomesd.remove_patch(pipe)


def test_a_compiled_bare_model_with_reuse_is_still_refused_at_apply_time(tmp_path):
    pipe = T.sd_pipeline(tmp_path)
    compiled = torch.compile(pipe.unet, backend="eager")
    with pytest.raises(ValueError, match="reuse_steps > 1 cannot run in a torch.compile'd bare model"):
        tomesd.apply_patch(compiled, ratio=0.5, reuse_steps=2)
    pipe.unet = compiled  # in a pipeline, the loop counts the steps: accepted
    tomesd.apply_patch(pipe, ratio=0.5, reuse_steps=2)
    tomesd.remove_patch(pipe)
    torch._dynamo.reset()
