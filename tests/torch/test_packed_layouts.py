"""The "packed" layout (tomesd/layouts/packed.py): a packed latent [B, N, C] whose token grid is in the
forward's arguments. Qwen-Image-Edit's reference images (entries of img_shapes after the target's) pass whole; LTX-Video
with a timestep per token (LTXImageToVideoPipeline) merges, its modulation staying on every token outside the sites;
what gives no grid ToMe can read is refused by name (LTXConditionPipeline's video_coords, a miscounted grid,
Qwen-Image 2.1). The whole contract of each family is in test_family_contract.py (tests/families.py)."""
import pytest
import torch

import tiny_packed_families as P
from probes import CountingBackend, assert_compiled_equals_eager
import tomesd

pytest.importorskip("diffusers.models.transformers.transformer_qwenimage")


def _observed(model, inputs, **settings):
    tomesd.apply_patch(model, **{"ratio": 0.5, **settings})
    try:
        with tomesd.observe(model) as seen:
            out = P.run(model, inputs)
    finally:
        tomesd.remove_patch(model)
    return out, seen


# zero_cond_t: Qwen-Image-Edit-2511 (references modulated apart); use_layer3d_rope: Qwen-Image-Layered (its later
# layers and condition image, entries after the first, pass whole as references do)
@pytest.mark.parametrize("config", [{}, dict(zero_cond_t=True), dict(use_layer3d_rope=True)],
                         ids=["edit", "edit-2511", "layered"])
def test_qwen_image_edit_reference_tokens_pass_whole(config):
    """Each merge's rows: a token coded by its index, merged and unmerged, comes back as itself where it passes whole
    and as a mean of target indices where it merged, so no merged row mixes a reference token with a target's."""
    model = P.qwen(**config).eval()
    target, references = (8, 8), ((6, 6), (4, 5))  # Edit Plus: two reference images
    inputs = P.qwen_inputs(model, batch=2, h=target[0], w=target[1], references=references)
    n, total = target[0] * target[1], inputs["hidden_states"].shape[1]
    base = P.run(model, inputs)
    out, seen = _observed(model, inputs)
    _, alone = _observed(model, P.qwen_inputs(model, batch=2, h=target[0], w=target[1]))
    (call,), (plain,) = seen.calls, alone.calls
    assert call.merged_blocks("attn") == [0, 1]
    for index, block in call.blocks.items():
        (size, kept), = block.sites["attn"]
        (plain_size, plain_kept), = plain.blocks[index].sites["attn"]
        assert size == total and plain_size == n and size - kept == plain_size - plain_kept  # r of the target's alone
        merge = block.merge.get("merge_attn") if isinstance(block.merge, dict) else block.merge
        coded = torch.arange(total, dtype=torch.float32).reshape(1, total, 1).expand(2, total, 1).contiguous()
        back = merge.unmerge(merge.merge(coded))
        assert torch.equal(back[:, n:], coded[:, n:])  # every reference token passes whole
        assert (back[:, :n] < n).all() and not torch.equal(back[:, :n], coded[:, :n])  # targets merge among themselves
    assert (out - base).abs().max() > 1e-2


def test_img_shapes_as_one_tuple_per_sample_reads_as_a_list_of_one():
    """QwenImageControlNetPipeline passes [(1, h, w)] * B, the others [[(1, h, w)]] * B: one grid, one output."""
    model = P.qwen().eval()
    inputs = P.qwen_inputs(model, batch=2, h=6, w=10)
    nested = _observed(model, inputs)[0]
    flat, seen = _observed(model, dict(inputs, img_shapes=[(1, 6, 10)] * 2))
    assert torch.equal(flat, nested) and seen.calls[0].merged_blocks("attn") == [0, 1]


def test_qwen_image_edit_refuses_downsampling_naming_merge():
    """mode='downsample' shrinks the last N keys at the dispatch: with reference tokens after the target's it would
    shrink the wrong rows, so the first call that joins them is refused, naming mode='merge'."""
    model = P.qwen().eval()
    tomesd.apply_patch(model, mode="downsample")
    try:
        P.run(model, P.qwen_inputs(model, batch=1, h=4, w=4))  # the target alone downsamples
        with pytest.raises(ValueError, match="reference image's 36 tokens .*use mode='merge'"):
            P.run(model, P.qwen_inputs(model, batch=1, h=4, w=4, references=((6, 6),)))
    finally:
        tomesd.remove_patch(model)


def test_qwen_image_controlnet_merges_on_the_transformers_grid():
    """QwenImageControlNetModel: the transformer's blocks over the same packed latent (its condition added to each
    token), its grid from img_shapes; each block's output (a residual for the transformer) is unmerged."""
    from diffusers import QwenImageControlNetModel

    config = {k: v for k, v in P.QWEN.items() if k != "guidance_embeds"}
    net = P.randomize_(QwenImageControlNetModel(**config)).eval()
    inputs = P.qwen_inputs(net, batch=2)
    inputs["controlnet_cond"] = torch.randn(inputs["hidden_states"].shape, generator=torch.Generator().manual_seed(7))

    def run(model):
        with torch.no_grad():
            return torch.stack(model(**inputs).controlnet_block_samples)

    base = run(net)
    tomesd.apply_patch(net, ratio=0.5)
    try:
        with tomesd.observe(net) as seen:
            out = run(net)
    finally:
        tomesd.remove_patch(net)
    assert seen.calls[0].merged_blocks("attn") == [0, 1] and out.shape == base.shape
    assert (out - base).abs().max() > 1e-2
    assert torch.equal(run(net), base)


def test_ltx_video_with_a_timestep_per_token_merges_after_its_per_token_modulation():
    """LTXImageToVideoPipeline gives each token its own timestep (the conditioning first frame's at 0): the block
    modulates every token before its sub-layers and gates their unmerged outputs, so ToMe's sites see modulated tokens
    and give back one output per token. Equal timesteps per token give what one per sample gives."""
    model = P.ltx().eval()
    inputs = P.ltx_inputs(model, batch=2, per_token_timestep=True)
    base = P.run(model, inputs)
    out, seen = _observed(model, inputs)
    assert seen.calls[0].merged_blocks("attn") == [0, 1] and out.shape == base.shape and torch.isfinite(out).all()
    assert (out - base).abs().max() > 1e-2
    flat = P.ltx_inputs(model, batch=2)
    per_token = dict(flat, timestep=flat["timestep"][:, None].expand(2, flat["hidden_states"].shape[1]))
    kw = dict(ratio=0.5)
    torch.testing.assert_close(_observed(model, per_token, **kw)[0], _observed(model, flat, **kw)[0])
    with pytest.raises(ValueError, match="reuse_steps"):  # a bare model cannot count steps from per-token timesteps
        _observed(model, inputs, reuse_steps=2)


def test_ltx_video_called_with_video_coords_is_refused_naming_the_pipeline():
    model = P.ltx().eval()
    inputs = P.ltx_inputs(model, batch=1, frames=2, h=4, w=4)
    coords = torch.stack(torch.meshgrid(torch.arange(2.), torch.arange(4.), torch.arange(4.), indexing="ij"))
    inputs = dict(inputs, num_frames=None, height=None, width=None, video_coords=coords.flatten(1)[None])
    tomesd.apply_patch(model, ratio=0.5)
    try:
        with pytest.raises(ValueError, match="video_coords instead .*LTXConditionPipeline"):
            P.run(model, inputs)
    finally:
        tomesd.remove_patch(model)


@pytest.mark.parametrize("family", ["ltx", "qwen"])
def test_a_grid_that_does_not_count_the_latents_tokens_is_refused(family):
    model = getattr(P, family)().eval()
    inputs = getattr(P, f"{family}_inputs")(model, batch=1, h=4, w=4)
    wrong = dict(inputs, width=5) if family == "ltx" else dict(inputs, img_shapes=[[(1, 4, 5)]])
    tomesd.apply_patch(model, ratio=0.5)
    try:
        with pytest.raises(ValueError, match="must count the latent's tokens"):
            P.run(model, wrong)
        if family == "qwen":  # per-sample sizes the host's rotary table would read as the first's
            with pytest.raises(ValueError, match="differ by sample"):
                P.run(model, dict(P.qwen_inputs(model, batch=2, h=4, w=4), img_shapes=[[(1, 4, 4)], [(1, 2, 8)]]))
    finally:
        tomesd.remove_patch(model)


@pytest.mark.parametrize("name", ["QwenImage21Transformer2DModel"])
def test_qwen_image_21_is_refused_by_name(name):
    """Its layout (Qwen-Image 2.1's conditions before the target under a KV cache) is not merged yet: refused at
    apply time naming the class and the cause, before anything changes. (LTX-2 merges: tests/torch/test_ltx2.py.)"""
    import diffusers

    cls = getattr(diffusers, name, None)
    if cls is None:
        pytest.skip(f"diffusers {diffusers.__version__} has no {name}")
    from tomesd.families import refusal

    # The class itself, with nothing built: ToMe refuses it by its name before looking at its blocks.
    model = type("Unbuilt", (cls,), {"__init__": lambda self: torch.nn.Module.__init__(self)})()
    message = refusal(model)
    assert message and f"cannot patch {name}" in message and "not merge yet" in message
    with pytest.raises(TypeError, match=f"cannot patch {name}"):
        tomesd.apply_patch(model, ratio=0.5)
    assert not model._forward_pre_hooks


@pytest.mark.parametrize("family", ["ltx", "qwen"])
def test_the_patched_forward_traces_as_one_graph_and_equals_eager(family):
    """The grid arguments are plain ints and lists: dynamo guards on them, no graph break, no host read."""
    import torch._dynamo

    model = getattr(P, family)().eval()
    inputs = getattr(P, f"{family}_inputs")(model)
    tomesd.apply_patch(model, ratio=0.5)
    try:
        eager = P.run(model, inputs)
        torch._dynamo.reset()
        backend = CountingBackend()
        compiled = P.run(torch.compile(model, backend=backend, fullgraph=True), inputs)  # a break would raise
    finally:
        tomesd.remove_patch(model)
        torch._dynamo.reset()
    assert backend.graphs == 1
    assert (eager - P.run(model, inputs)).abs().max() > 1e-2
    assert_compiled_equals_eager(compiled, eager)
