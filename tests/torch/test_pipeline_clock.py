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
from probes import count_host_reads

STEPS = 6
TOL = 1e-5


def per_call(pipe, denoiser="unet"):
    """Runs `pipe` (returns images) and, per denoiser call, the matchings computed and the blocks whose
    self-attention merged (reusing calls must merge too), seen through tomesd.observe."""
    with tomesd.observe(getattr(pipe, denoiser)) as seen:
        images = run(pipe, denoiser)
    return images, [call.computed for call in seen.calls], [call.merged_blocks("attn") for call in seen.calls]


def run(pipe, denoiser="unet"):
    common = dict(num_inference_steps=STEPS, height=32, width=32, output_type="np",
                  generator=torch.Generator().manual_seed(0))
    if denoiser == "unet":
        return pipe("a tiny test", **common).images
    return pipe("a tiny test", guidance_scale=2.0, **common).images



def test_a_patched_pipeline_takes_steps_from_its_loop_and_reads_no_tensor(tmp_path):
    """Over the whole run the patched pipeline reads on the host exactly the tensor values the unpatched one
    reads (its scheduler's), counted by the dispatcher; matched at steps 0 and 3, and every call merges."""
    pipe = T.sd_pipeline(tmp_path)
    pipe.set_progress_bar_config(disable=True)
    base, base_reads = count_host_reads(lambda: run(pipe))
    tomesd.apply_patch(pipe.unet, ratio=0.5)
    exact = run(pipe)
    tomesd.apply_patch(pipe.unet, ratio=0.5, reuse_steps=3)  # a bare model: the timestep rule
    by_timestep, bare_reads = count_host_reads(lambda: run(pipe))
    tomesd.remove_patch(pipe.unet)
    assert bare_reads == base_reads + STEPS  # the counter sees the timestep rule's one read per call
    tomesd.apply_patch(pipe, ratio=0.5, reuse_steps=3)
    (images, counts, merged), reads = count_host_reads(lambda: per_call(pipe))
    again, counts_again, merged_again = per_call(pipe)  # a second run starts afresh
    assert reads == base_reads
    assert counts == counts_again == [3, 0, 0, 3, 0, 0]  # matched at steps 0 and 3 (3 merging blocks)
    assert merged == merged_again == [[0, 4, 5]] * STEPS  # every call merges, reusing ones included
    assert abs(exact - base).max() > 1000 * TOL and abs(images - exact).max() > 100 * TOL  # reuse acts
    assert (images == by_timestep).all() and (again == images).all()  # the same steps as the timestep rule
    tomesd.remove_patch(pipe)
    assert not {"step", "set_timesteps"} & set(vars(pipe.scheduler))  # the scheduler is its own again
    assert (run(pipe) == base).all()


def test_a_scheduler_swapped_in_after_apply_patch_is_followed(tmp_path, no_added_host_reads):
    from diffusers import EulerDiscreteScheduler

    pipe = T.sd_pipeline(tmp_path)
    pipe.set_progress_bar_config(disable=True)
    old = pipe.scheduler
    pipe.scheduler = EulerDiscreteScheduler.from_config(pipe.scheduler.config)
    no_added_host_reads.baseline(lambda: run(pipe))
    pipe.scheduler = old
    tomesd.apply_patch(pipe, ratio=0.5, reuse_steps=2)
    pipe.scheduler = EulerDiscreteScheduler.from_config(pipe.scheduler.config)
    _, counts, merged = no_added_host_reads(lambda: per_call(pipe))
    assert counts == [3, 0, 3, 0, 3, 0]  # without following, the new scheduler's steps would never count
    assert merged == [[0, 4, 5]] * STEPS
    assert not {"step", "set_timesteps"} & set(vars(old))
    tomesd.remove_patch(pipe)
    assert not {"step", "set_timesteps"} & set(vars(pipe.scheduler))


def test_a_copy_of_a_patched_pipeline_counts_its_own_steps(tmp_path, no_added_host_reads):
    pipe = T.sd_pipeline(tmp_path)
    pipe.set_progress_bar_config(disable=True)
    no_added_host_reads.baseline(lambda: run(pipe))
    tomesd.apply_patch(pipe, ratio=0.5, reuse_steps=3)
    images, counts, merged = no_added_host_reads(lambda: per_call(pipe))
    twin = copy.deepcopy(pipe)
    assert twin.scheduler.step.clock is not pipe.scheduler.step.clock
    assert twin.scheduler.step.clock.pipeline is twin and not twin.scheduler.step.clock.kept
    twin_images, twin_counts, twin_merged = no_added_host_reads(lambda: per_call(twin))
    assert twin_counts == counts == [3, 0, 0, 3, 0, 0] and (twin_images == images).all()
    assert twin_merged == merged == [[0, 4, 5]] * STEPS
    tomesd.remove_patch(twin)  # removing the copy's patch leaves the original's
    assert pipe.scheduler.step.clock.pipeline is pipe
    assert per_call(pipe)[1] == counts


def test_a_compiled_transformer_in_a_pipeline_reuses_with_two_graphs_and_no_recompile(tmp_path):
    """SD3 pipeline, reuse_steps=2, transformer compiled with fullgraph=True: one graph for a matching
    step and one for a reusing step, over two runs of 6 steps, equal to the eager pipeline."""
    torch._dynamo.reset()
    pipe = T.sd3_pipeline(tmp_path)
    base = run(pipe, "transformer")
    tomesd.apply_patch(pipe, ratio=0.5, reuse_steps=2)
    eager, counts, merged = per_call(pipe, "transformer")
    assert counts == [3, 0] * 3  # 3 joint blocks; the CFG halves run as one call
    assert merged == [[0, 1, 2]] * 6
    assert abs(eager - base).max() > 1000 * TOL
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
