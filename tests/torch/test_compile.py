"""Patched models under torch.compile, on the meta device, and counted op by op.

The per-call path must be one graph (no breaks, no recompiles across denoising steps), read no
tensor value on the host (the meta device has none to read), and launch no more kernels than
tomesd does. Compiles run dynamo's graphs eagerly (graph structure, exact numbers); inductor's code,
through AOTAutograd, is checked once, in a fresh process (test_inductor_output_equals_eager).
"""
import pytest
import torch
import torch._dynamo

import tiny_torch as T
import tomesd
from probes import CountingBackend, OpCounter, assert_compiled_equals_eager, assert_round_off_apart
from references import load_tomesd_ref
from tomesd.runtime.tome_patch import PATCH_ATTR

LAYOUTS = {"sd1": T.SD1_UNET, "sdxl": T.SDXL_UNET}
STEPS = (999.0, 500.0, 21.0)  # a scheduler's timesteps, passed as 0-d tensors as pipelines do


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def run(model, x, t, c):
    with torch.no_grad():
        return model(x, t, c).sample


def self_attn_tokens(unet, layer="to_q"):
    """Tokens entering each self-attention's `layer`, per call (after any merge or downsampling)."""
    seen = []
    blocks = [m for m in unet.modules() if type(m).__name__ == "BasicTransformerBlock"]
    handles = [getattr(b.attn1, layer).register_forward_pre_hook(lambda m, a: seen.append(a[0].shape[1])) for b in blocks]
    return seen, handles


@pytest.mark.parametrize("layout,seed", [("sd1", None), ("sdxl", 3)], ids=["sd1-default-seed", "sdxl-seed"])
def test_patched_unet_traces_as_one_graph(layout, seed):
    unet = T.unet(LAYOUTS[layout])
    x, t, c = T.unet_inputs()
    tomesd.apply_patch(unet, ratio=0.5, seed=seed)  # use_rand on, as by default
    with torch.no_grad():
        explained = torch._dynamo.explain(unet)(x, t, c)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    traced = {str(op) for graph_ops in explained.ops_per_graph for op in graph_ops}
    assert any("argsort" in op or "sort" in op for op in traced)  # the matching is in the graph


MODES = {"merge": dict(ratio=0.5), "downsample": dict(mode="downsample"),
         "downsample-avg": dict(mode="downsample", downsample_method="avg", downsample_factor=3)}


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_denoising_loop_compiles_once_and_equals_eager(layout, mode):
    unet = T.unet(LAYOUTS[layout])
    x, _, c = T.unet_inputs()
    steps = [torch.tensor(t) for t in STEPS]
    plain = [run(unet, x, t, c) for t in steps]
    tomesd.apply_patch(unet, **MODES[mode])
    eager = [run(unet, x, t, c) for t in steps]
    backend = CountingBackend()
    compiled = torch.compile(unet, fullgraph=True, backend=backend)
    outs = [run(compiled, x, steps[0], c)]
    with torch._dynamo.config.patch(error_on_recompile=True):
        outs += [run(compiled, x, t, c) for t in steps[1:]]
    assert backend.graphs == 1
    for out, ref, base in zip(outs, eager, plain):
        assert (ref - base).abs().max() > 1e-2  # ToMe acts at every step
        assert_compiled_equals_eager(out, ref)


def test_a_second_resolution_costs_at_most_one_more_compile():
    unet = T.unet()
    (x, _, c), x2 = T.unet_inputs(), T.unet_inputs(2, 24, 16)[0]
    t0 = torch.tensor(STEPS[0])
    plain, plain2 = run(unet, x, t0, c), run(unet, x2, t0, c)
    tomesd.apply_patch(unet, ratio=0.5)
    backend = CountingBackend()
    compiled = torch.compile(unet, backend=backend)
    seen, handles = self_attn_tokens(unet)
    eager, eager2 = run(unet, x, t0, c), run(unet, x2, t0, c)
    merged_tokens = list(seen)
    for handle in handles:
        handle.remove()
    for t in STEPS:
        run(compiled, x, torch.tensor(t), c)
    for t in STEPS:
        out2 = run(compiled, x2, torch.tensor(t), c)
    first = run(compiled, x, t0, c)
    assert backend.graphs <= 2
    half = len(merged_tokens) // 2  # each call sees the same blocks
    assert merged_tokens[0] == 16 * 16 // 2 and merged_tokens[half] == 24 * 16 // 2  # both resolutions merge
    for ours, ref, base in ((first, eager, plain), (run(compiled, x2, t0, c), eager2, plain2)):
        assert_round_off_apart(ours, ref, base)  # ToMe acts, far beyond the bound
    assert out2.shape == x2.shape
    tomesd.remove_patch(unet)  # the compiled wrapper runs the unpatched model again, bit for bit
    assert torch.equal(run(compiled, x, t0, c), plain) and torch.equal(run(compiled, x2, t0, c), plain2)


INDUCTOR_CHECK = """
import sys, torch
sys.path.insert(0, sys.argv[1])
import tiny_torch as T, tomesd
unet = T.unet()
x, t, c = T.unet_inputs()
with torch.no_grad():
    base = unet(x, t, c).sample
    tomesd.apply_patch(unet, ratio=0.5)
    eager = unet(x, t, c).sample
    compiled = torch.compile(unet, fullgraph=True)(x, t, c).sample
print((eager - base).abs().max().item(), (compiled - eager).abs().max().item())
"""


def test_inductor_output_equals_eager():
    """In a fresh process: inductor's import fails in a process where earlier tests of the paddle
    environment have run (torch.iinfo on a dtype table), which says nothing about ToMe."""
    import os
    import subprocess
    import sys

    tests_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", INDUCTOR_CHECK, tests_dir], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    effect, error = map(float, out.stdout.split())
    assert effect > 1e-2
    assert error < effect / 1000


def test_pipeline_with_compiled_unet_after_apply_patch(tmp_path):
    pipe = T.controlnet_pipeline(tmp_path)
    plain = T.run_pipeline(pipe)
    tomesd.apply_patch(pipe, ratio=0.5)
    eager = T.run_pipeline(pipe)
    pipe.unet = torch.compile(pipe.unet, fullgraph=True, backend="eager")
    try:
        # two steps and a VAE: the bound follows the images and what ToMe does to them
        assert_round_off_apart(T.run_pipeline(pipe), eager, plain)
    finally:
        tomesd.remove_patch(pipe)  # finds the patch inside the compiled wrapper
    assert getattr(pipe.unet._orig_mod, PATCH_ATTR, None) is None
    assert (T.run_pipeline(pipe) == plain).all()  # the unpatched images again, bit for bit


def test_patching_an_already_compiled_model_patches_what_it_runs():
    unet = T.unet()
    x, t, c = T.unet_inputs()
    compiled = torch.compile(unet, fullgraph=True, backend="eager")
    base = run(compiled, x, t, c)
    tomesd.apply_patch(compiled, ratio=0.5)
    assert getattr(unet, PATCH_ATTR, None) is not None
    patched = run(compiled, x, t, c)
    assert (patched - base).abs().max() > 1e-2
    assert_compiled_equals_eager(patched, run(unet, x, t, c))
    tomesd.remove_patch(compiled)
    assert torch.equal(run(compiled, x, t, c), base)


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_forward_on_the_meta_device_reads_no_tensor_value(layout, mode):
    """Any host read (.item(), .tolist(), .numpy(), a data-dependent branch) fails on meta tensors."""
    from diffusers import UNet2DConditionModel

    with torch.device("meta"):
        unet = UNet2DConditionModel(**LAYOUTS[layout]).eval()
        x, c = torch.randn(2, 4, 16, 16), torch.randn(2, 7, 32)
        timesteps = [torch.tensor(500.0), torch.tensor([500, 500])]
    tomesd.apply_patch(unet, **MODES[mode])
    seen, handles = self_attn_tokens(unet, "to_k")
    for t in timesteps:
        assert run(unet, x, t, c).shape == x.shape
    for handle in handles:
        handle.remove()
    finest = 16 * 16 if layout == "sd1" else 8 * 8
    expected = {"merge": finest // 2, "downsample": finest // 4, "downsample-avg": (-(-int(finest ** 0.5) // 3)) ** 2}
    assert seen[0] == expected[mode]  # reduced, not skipped


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_no_more_kernels_than_tomesd(layout):
    """Ops dispatched per forward (each a kernel launch on a GPU), use_rand on."""
    ref = load_tomesd_ref()
    unet = T.unet(LAYOUTS[layout])
    x, t, c = T.unet_inputs()

    def count():
        with torch.no_grad(), OpCounter() as counter:
            unet(x, t, c)
        return sum(counter.ops.values())

    base = count()
    tomesd.apply_patch(unet, ratio=0.5)
    ours = count() - base
    tomesd.remove_patch(unet)
    ref.apply_patch(unet, ratio=0.5, max_downsample=1 if layout == "sd1" else 2)
    theirs = count() - base
    ref.remove_patch(unet)
    print(f"{layout}: ops added per forward: ours {ours}, tomesd {theirs}")
    assert theirs > 0 and 0 < ours <= theirs


def test_what_a_patch_keeps_across_steps_does_not_grow_with_steps():
    """GPU-friendliness beside no host reads and one graph: a denoising loop leaves no per-call state behind
    (no call stack entry, no checkpoint record at inference), and kept matchings (reuse_steps) hold at most one
    entry per block however many steps run."""
    model = T.transformer("sd3")
    inputs = T.transformer_inputs("sd3")
    tomesd.apply_patch(model, ratio=0.5, reuse_steps=2)
    patch = getattr(model, PATCH_ATTR)
    sizes = []
    for t in range(30, 0, -1):  # 30 denoising steps, timesteps falling
        T.run_transformer(model, dict(inputs, timestep=torch.full((2,), float(t))))
        sizes.append(len(patch.matcher.steps.cache))
        assert not patch.calls.current() and not patch.replay
    assert 0 < max(sizes) <= len(patch.blocks) and sizes[-1] == sizes[5]
