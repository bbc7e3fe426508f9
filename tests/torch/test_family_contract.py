"""One contract, every model family (tests/families.py): the patch acts (tokens merged in its blocks, seen
through tomesd.observe), is reversible bit for bit, applying twice equals once, copies and pickles carry
it, threads equal serial calls, the batch order does not matter, the default random dst pattern is really
used, a forward reads no tensor value on the host (on the meta device, and counted on the CPU), and SD.Next's
exact call on a pipeline holding the family's denoiser merges and removes."""
import copy
import pickle

import pytest
import torch

import tomesd
from families import FAMILIES, flipped, missing_host
from probes import OpCounter
from threads import concurrent_calls

TOL = 1e-5
NAMES = [pytest.param(name, marks=pytest.mark.skipif(bool(missing_host(family)), reason=missing_host(family)))
         for name, family in FAMILIES.items()]


@pytest.fixture(scope="module", params=NAMES)
def family(request):
    family = FAMILIES[request.param]
    return family, family.build().eval()


def patch_kwargs(family, **extra):
    return {**(family.patch or dict(ratio=0.5)), **extra}


def patched_run(family, model, inputs, **extra):
    tomesd.apply_patch(model, **patch_kwargs(family, **extra))
    try:
        return family.run(model, inputs)
    finally:
        tomesd.remove_patch(model)


def test_the_patch_merges_tokens_in_its_blocks_and_removal_restores_bit_for_bit(family):
    family, model = family
    inputs = family.inputs(model)
    base = family.run(model, inputs)
    tomesd.apply_patch(model, **patch_kwargs(family))
    try:
        with tomesd.observe(model) as seen:
            out = family.run(model, inputs)
    finally:
        tomesd.remove_patch(model)
    (call,) = seen.calls
    merged = call.merged_blocks("attn")
    assert merged, f"no block of {family.name} merged its self-attention tokens"
    for index in merged:
        (n, kept), = call.blocks[index].tokens("attn")
        assert kept < n and call.blocks[index].computed == 1
    assert (out - base).abs().max().item() > 1000 * TOL
    assert torch.equal(family.run(model, inputs), base)
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())


def test_applying_twice_equals_applying_once(family):
    family, model = family
    inputs = family.inputs(model)
    once = patched_run(family, model, inputs)
    tomesd.apply_patch(model, **patch_kwargs(family))
    try:
        twice = patched_run(family, model, inputs)
    finally:
        tomesd.remove_patch(model)
    assert torch.equal(once, twice)


def test_a_forward_under_inference_mode_equals_one_under_no_grad(family):
    """torch.inference_mode (ComfyUI samples under it; so do many scripts): its tensors track no version counter and
    the patch's kept constants cross between the two modes, both ways."""
    family, model = family
    inputs = family.inputs(model)
    tomesd.apply_patch(model, **patch_kwargs(family))
    try:
        before = family.run(model, inputs)
        with torch.inference_mode():
            inferred = family.run(model, inputs)
        after = family.run(model, inputs)
    finally:
        tomesd.remove_patch(model)
    assert torch.equal(inferred, before) and torch.equal(after, before)


def test_deepcopy_and_pickle_carry_the_patch_and_remove_apart(family):
    family, model = family
    inputs = family.inputs(model)
    base = family.run(model, inputs)
    tomesd.apply_patch(model, **patch_kwargs(family))
    try:
        patched = family.run(model, inputs)
        for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
            assert torch.equal(family.run(twin, inputs), patched)
            tomesd.remove_patch(twin)
            assert torch.equal(family.run(twin, inputs), base)
        assert torch.equal(family.run(model, inputs), patched)  # the original keeps its patch
    finally:
        tomesd.remove_patch(model)
    assert (patched - base).abs().max().item() > 1000 * TOL


def test_concurrent_calls_at_two_token_grids_equal_serial_calls(family):
    family, model = family
    jobs = [family.inputs(model, seed=5 + i, **grid) for i, grid in enumerate(family.grids)]
    tomesd.apply_patch(model, **patch_kwargs(family))
    try:
        expected = [family.run(model, job) for job in jobs]
        results = concurrent_calls(model, lambda job: family.run(model, job), jobs)
    finally:
        tomesd.remove_patch(model)
    assert all(torch.equal(out, expected[i % 2]) for i, outs in results.items() for out in outs)


def test_batch_order_does_not_change_any_samples_output(family):
    """Outputs for [a, b] equal those for [b, a] flipped: a matching shared by the batch is computed from
    every sample (not from the first one alone), and each sample's random pattern does not depend on its
    place in the batch."""
    family, model = family
    inputs = family.inputs(model)
    base = family.run(model, inputs)
    forward = patched_run(family, model, inputs)
    backward = patched_run(family, model, flipped(family, inputs))
    assert (forward - base).abs().max().item() > 1000 * TOL
    assert (forward - backward.flip(0)).abs().max().item() < TOL


def test_the_default_random_dst_pattern_is_used(family):
    """use_rand defaults to True: its outputs differ from the fixed top-left pattern's by far more than
    round-off (a runtime that silently fell back to the fixed pattern fails here)."""
    family, model = family
    inputs = family.inputs(model)
    default = patched_run(family, model, inputs)
    fixed = patched_run(family, model, inputs, use_rand=False)
    assert (default - fixed).abs().max().item() > 1000 * TOL


def test_a_forward_reads_no_tensor_value_on_the_host(family):
    """Counted by the dispatcher: every host read (.item(), float(t), bool(t), .tolist()) runs
    aten._local_scalar_dense; the patched forward runs it as often as the host's own forward does."""
    family, model = family
    inputs = family.inputs(model)

    def host_reads():
        with OpCounter() as counter:
            family.run(model, inputs)
        return counter.ops["aten._local_scalar_dense.default"]

    plain = host_reads()
    tomesd.apply_patch(model, **patch_kwargs(family))
    try:
        patched = host_reads()
        with tomesd.observe(model) as seen:
            family.run(model, inputs)
    finally:
        tomesd.remove_patch(model)
    assert seen.calls[0].merged_blocks("attn")  # the counted forward did merge
    assert patched == plain, f"{family.name}: {patched - plain} host reads added per forward"


HOST_READ = "aten._local_scalar_dense.default"  # what .item(), float(t), bool(t) and .tolist() run


def _calls_reading(family, model, inputs, calls=3):
    """Host reads of `calls` forwards on one input, and what tomesd.observe saw of them (when patched)."""
    with OpCounter() as counter:
        for _ in range(calls):
            family.run(model, inputs)
    return counter.ops[HOST_READ]


def test_reuse_steps_on_a_bare_model_reads_the_timestep_once_a_call_and_nothing_more(family):
    """A bare model tells a new denoising step by its timestep's value: one host read per call, by design, and
    no other. Three calls of one step: the first matches, the other two reuse its matchings."""
    family, model = family
    inputs = family.inputs(model)
    if family.timestep_per_frame:  # no step to tell by value: refused, naming the pipeline's clock (tested below)
        tomesd.apply_patch(model, **patch_kwargs(family, reuse_steps=2))
        try:
            with pytest.raises(ValueError, match="one per frame or token.*Patch the pipeline instead"):
                family.run(model, inputs)
        finally:
            tomesd.remove_patch(model)
        return
    plain = _calls_reading(family, model, inputs)
    tomesd.apply_patch(model, **patch_kwargs(family, reuse_steps=2))
    try:
        with tomesd.observe(model) as seen:
            patched = _calls_reading(family, model, inputs)
    finally:
        tomesd.remove_patch(model)
    assert [call.reused > 0 for call in seen.calls] == [False, True, True] and seen.calls[1].merged_blocks("attn")
    assert patched == plain + 3, f"{family.name}: {patched - plain - 3} host reads beyond the timestep's"


class DiffusionPipeline:
    """Stands for diffusers' base class: the runtime recognises pipelines by class name."""


class LoopPipeline(DiffusionPipeline):
    """A pipeline's loop as the step clock follows it: set_timesteps once a run, step after each step's call."""

    def __init__(self, model):
        self.denoiser = model
        self.scheduler = type("Scheduler", (), {"set_timesteps": lambda self, n: None, "step": lambda self: None})()

    @property
    def components(self):
        return {"denoiser": self.denoiser, "scheduler": self.scheduler}


def test_reuse_steps_through_a_pipelines_clock_reads_nothing_on_the_host(family):
    """Patched through a pipeline, the loop's clock counts the steps on the host: a forward reads no tensor
    value, matching or reusing (four steps, windows of two)."""
    family, model = family
    inputs = family.inputs(model)
    plain = _calls_reading(family, model, inputs, calls=1)
    pipe = LoopPipeline(model)
    tomesd.apply_patch(pipe, **patch_kwargs(family, reuse_steps=2))
    reads = []
    try:
        with tomesd.observe(model) as seen:
            pipe.scheduler.set_timesteps(4)
            for _ in range(4):
                reads.append(_calls_reading(family, model, inputs, calls=1))
                pipe.scheduler.step()
    finally:
        tomesd.remove_patch(pipe)
    assert [call.reused > 0 for call in seen.calls] == [False, True, False, True]
    assert reads == [plain] * 4, f"{family.name}: host reads per step {reads}, the unpatched forward's {plain}"


class HeldPipeline(DiffusionPipeline):
    """A pipeline holding the denoiser under diffusers' own component name."""

    def __init__(self, model):
        self.components = {"unet" if "UNet" in type(model).__name__ else "transformer": model, "vae": None}


def test_sdnexts_call_on_a_pipeline_at_its_sliders_top_merges_and_removes(family):
    """SD.Next's one call (modules/sd_models.py: apply_token_merging) on whatever pipeline is loaded, its ratio
    slider at 1.0: tomesd 0.1.3 read `.unet` only and SD.Next logs "not supported" on every DiT pipeline."""
    family, model = family
    inputs = family.inputs(model)
    base = family.run(model, inputs)
    pipe = HeldPipeline(model)
    tomesd.apply_patch(pipe, ratio=1.0, use_rand=False, merge_attn=True, merge_crossattn=False, merge_mlp=False)
    try:
        with tomesd.observe(model) as seen:
            out = family.run(model, inputs)
    finally:
        tomesd.remove_patch(pipe)
    assert seen.calls[0].merged_blocks("attn"), f"SD.Next's call merged nothing in {family.name}"
    assert (out - base).abs().max().item() > 1000 * TOL
    assert torch.equal(family.run(model, inputs), base)


def test_a_forward_on_the_meta_device_merges_without_reading_values(family):
    family, model = family
    if family.host_reads:
        pytest.skip(f"{family.name}: {family.host_reads}")
    with torch.device("meta"):
        twin = type(model)(**model.config).eval()
    inputs = {k: (v.to("meta") if torch.is_tensor(v) else tuple(t.to("meta") for t in v) if isinstance(v, tuple) else v)
              for k, v in family.inputs(model).items()}
    tomesd.apply_patch(twin, **patch_kwargs(family))
    try:
        with tomesd.observe(twin) as seen:
            out = family.run(twin, inputs)
    finally:
        tomesd.remove_patch(twin)
    assert out.device.type == "meta"
    call = seen.calls[0]
    assert call.merged_blocks("attn") == list(family.merged_blocks)


def test_every_root_kind_is_held_to_the_contract():
    """Each denoiser family the runtime knows (its root-kind table) has an entry in tests/families.py, so a
    family added to the runtime is tested by this file (refused roots excepted; ComfyUI's own model classes are
    held to the contract of tests/comfy/test_comfyui.py, Forge's to tests/comfy/test_forge_contract.py)."""
    from tomesd.families import ROOT_KINDS, UNET

    known = {kind.family for kind in ROOT_KINDS + (UNET,)
             if not kind.refused and not kind.family.endswith(("(ComfyUI)", "(Forge)"))}
    assert known == {family.root for family in FAMILIES.values()}
