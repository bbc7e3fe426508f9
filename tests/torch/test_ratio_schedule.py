"""ratio_schedule (tomesd #28): the ratio follows the denoising run's progress, which the patched pipeline's
own loop counts on the host. A constant schedule equals exact ToMe; a changing one merges as scheduled,
deterministically, and a compiled denoiser runs one graph per distinct ratio."""
import pytest
import torch
import torch._dynamo

import tiny_torch as T
import tomesd
from probes import CountingBackend

STEPS = 6
TOL = 1e-5


def run(pipe):
    return pipe("a tiny test", num_inference_steps=STEPS, height=32, width=32, output_type="np",
                generator=torch.Generator().manual_seed(0)).images


def queries_per_call(pipe):
    """Runs `pipe`; for each UNet call, the query tokens of its first self-attention (16x16 = 256 unmerged)."""
    seen, calls = [], []
    first = next(m for m in pipe.unet.modules() if type(m).__name__ == "BasicTransformerBlock")
    handles = [first.attn1.to_q.register_forward_pre_hook(lambda m, a: seen.append(a[0].shape[1])),
               pipe.unet.register_forward_pre_hook(lambda m, a: calls.append(len(seen)))]
    try:
        images = run(pipe)
    finally:
        for handle in handles:
            handle.remove()
    return images, [seen[i] for i in calls]



def test_a_constant_schedule_equals_exact_tome(tmp_path, no_added_host_reads):
    pipe = T.sd_pipeline(tmp_path)
    pipe.set_progress_bar_config(disable=True)
    base = no_added_host_reads.baseline(lambda: run(pipe))
    tomesd.apply_patch(pipe, ratio=0.5)
    exact = run(pipe)
    tomesd.apply_patch(pipe, ratio_schedule=[(0.0, 0.5)])
    try:
        assert (no_added_host_reads(lambda: run(pipe)) == exact).all()
    finally:
        tomesd.remove_patch(pipe)
    assert abs(exact - base).max() > 1e-2


def test_a_schedule_merges_by_the_runs_progress_and_is_deterministic(tmp_path, no_added_host_reads):
    """[(0, 0.25), (0.5, 0.75)] over 6 steps: steps 0-2 (progress 0, 1/6, 2/6) merge a quarter, steps 3-5 three
    quarters; a second run starts over; the images differ from both constant ratios."""
    pipe = T.sd_pipeline(tmp_path)
    pipe.set_progress_bar_config(disable=True)
    no_added_host_reads.baseline(lambda: run(pipe))
    outs = {}
    for ratio in (0.25, 0.75):
        tomesd.apply_patch(pipe, ratio=ratio)
        outs[ratio] = run(pipe)
    tomesd.apply_patch(pipe, ratio_schedule=[(0.0, 0.25), (0.5, 0.75)])
    try:
        images, queries = no_added_host_reads(lambda: queries_per_call(pipe))
        again, queries_again = queries_per_call(pipe)
    finally:
        tomesd.remove_patch(pipe)
    assert queries == queries_again == [192] * 3 + [64] * 3
    assert (images == again).all()
    # The last steps weigh most in this tiny pipeline's image (0.75's run is within 1e-3 of it), yet both
    # constant runs differ: each step merged at its scheduled ratio.
    assert all(abs(images - outs[ratio]).max() > 10 * TOL for ratio in outs), [abs(images - outs[r]).max() for r in outs]


def test_a_compiled_transformer_runs_one_graph_per_scheduled_ratio(tmp_path):
    """SD3 pipeline, schedule 0.25 then 0.5, transformer compiled with fullgraph=True: two graphs over two
    runs, no recompile in the second, equal to the eager pipeline."""
    torch._dynamo.reset()
    pipe = T.sd3_pipeline(tmp_path)

    def run_sd3():
        return pipe("a tiny test", guidance_scale=2.0, num_inference_steps=STEPS, height=32, width=32,
                    output_type="np", generator=torch.Generator().manual_seed(0)).images

    tomesd.apply_patch(pipe, ratio_schedule=[(0.0, 0.25), (0.5, 0.5)])
    eager = run_sd3()
    backend = CountingBackend()
    plain = pipe.transformer
    pipe.transformer = torch.compile(plain, fullgraph=True, backend=backend)
    try:
        compiled = run_sd3()
        assert backend.graphs == 2
        with torch._dynamo.config.patch(error_on_recompile=True):
            again = run_sd3()
    finally:
        pipe.transformer = plain
        torch._dynamo.reset()
        tomesd.remove_patch(pipe)
    assert backend.graphs == 2
    assert abs(compiled - eager).max() < TOL and abs(again - eager).max() < TOL


@pytest.mark.parametrize("kwargs,message", [
    (dict(ratio=0.5, ratio_schedule=[(0.0, 0.5)]), "give ratio or ratio_schedule, not both"),
    (dict(ratio_schedule=[(0.1, 0.5)]), "must start at 0.0"),
    (dict(ratio_schedule=[(0.0, 0.5), (0.0, 0.25)]), "must start at 0.0 and rise"),
    (dict(ratio_schedule=[(0.0, 1.5)]), r"ratios must be numbers in \[0, 1\]"),
    (dict(ratio_schedule=[(0.0, 0.5)], reuse_steps=2), "reuse_steps cannot go with ratio_schedule"),
    (dict(ratio_schedule=[(0.0, 0.5)], mode="downsample"), "no meaning with mode='downsample'"),
    (dict(ratio_schedule="fast"), "list of \\(progress, ratio\\) pairs"),
])
def test_bad_schedules_are_refused_before_any_change(tmp_path, kwargs, message):
    pipe = T.sd_pipeline(tmp_path)
    with pytest.raises(ValueError, match=message):
        tomesd.apply_patch(pipe, **kwargs)
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in pipe.unet.modules())


def test_a_bare_model_refuses_a_schedule_at_apply_time():
    model = T.unet()
    with pytest.raises(ValueError, match="apply the patch to the pipeline"):
        tomesd.apply_patch(model, ratio_schedule=[(0.0, 0.25), (0.5, 0.5)])
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())
