"""tomesd.apply_patch / remove_patch on diffusers and LDM models, against tomesd 0.1.3."""

import pytest
import torch

import tiny_torch as T
import tomesd
from references import load_tomesd_ref
from threads import concurrent_calls
from tomesd.runtime.tome_patch import PATCH_ATTR

ref = load_tomesd_ref()
TOL = 1e-4


def forward(model, inputs):
    x, t, c = inputs
    with torch.no_grad():
        out = model(x, t, c)
    return out.sample if hasattr(out, "sample") else out


def ldm_forward(model, inputs):
    x, t, c = inputs
    with torch.no_grad():
        return model.model.diffusion_model(x, t.expand(x.shape[0]), c)


def with_tomesd(model, run, **kwargs):
    ref.apply_patch(model, **kwargs)
    try:
        return run()
    finally:
        ref.remove_patch(model)


def with_ours(model, run, **kwargs):
    tomesd.apply_patch(model, **kwargs)
    try:
        return run()
    finally:
        tomesd.remove_patch(model)


def assert_acts(ours, base):
    """ToMe changed the output far beyond the tolerance, so comparing `ours` is not comparing a no-op."""
    effect = (ours - base).abs().max().item()
    assert effect > 1000 * TOL, f"ToMe changed the output by only {effect}: the check would be vacuous"


def assert_parity(base, ours, theirs):
    assert_acts(ours, base)
    assert (ours - theirs).abs().max().item() < TOL


@pytest.fixture(scope="module")
def sd1_unet():
    return T.unet()


@pytest.mark.parametrize("ratio", [0.3, 0.5, 0.7])
@pytest.mark.parametrize("max_downsample", [1, 2])
@pytest.mark.parametrize("batch,h,w", [(2, 16, 16), (1, 15, 17), (3, 16, 12)])
def test_diffusers_unet_equals_tomesd(sd1_unet, ratio, max_downsample, batch, h, w):
    inputs = T.unet_inputs(batch, h, w)
    run = lambda: forward(sd1_unet, inputs)  # noqa: E731
    args = dict(ratio=ratio, max_downsample=max_downsample, use_rand=False)
    assert_parity(run(), with_ours(sd1_unet, run, **args), with_tomesd(sd1_unet, run, **args))


@pytest.mark.parametrize("sd2", [False, True], ids=["sd1", "sd2-disable_self_attn"])
@pytest.mark.parametrize("ratio,max_downsample", [(0.5, 1), (0.6, 2)])
def test_ldm_unet_equals_tomesd(sd2, ratio, max_downsample):
    model = T.ldm_model(sd2=sd2)
    if sd2:
        assert any(getattr(m, "disable_self_attn", False) for m in model.modules())
    inputs = T.unet_inputs(2, 16, 16)
    run = lambda: ldm_forward(model, inputs)  # noqa: E731
    args = dict(ratio=ratio, max_downsample=max_downsample, use_rand=False)
    assert_parity(run(), with_ours(model, run, **args), with_tomesd(model, run, **args))


def test_default_arguments_equal_tomesd_on_sd1(sd1_unet):
    inputs = T.unet_inputs(2, 16, 16)
    run = lambda: forward(sd1_unet, inputs)  # noqa: E731
    assert_parity(run(), with_ours(sd1_unet, run, use_rand=False), with_tomesd(sd1_unet, run, use_rand=False))


def test_sdxl_layout_merges_by_default_where_tomesd_does_nothing():
    unet = T.unet(T.SDXL_UNET)
    inputs = T.unet_inputs(2, 16, 16)
    run = lambda: forward(unet, inputs)  # noqa: E731
    base = run()
    assert torch.equal(with_tomesd(unet, run), base)  # tomesd's gap: max_downsample=1 matches no block
    ours = with_ours(unet, run, seed=0)
    assert (ours - base).abs().max().item() > 1e-2
    # An explicit max_downsample keeps tomesd's meaning.
    assert torch.equal(with_ours(unet, run, max_downsample=1), base)


def module_snapshot(model):
    return {
        name: (type(m), sorted(vars(m)), len(m._forward_pre_hooks), len(m._forward_hooks))
        for name, m in model.named_modules()
    }


def test_remove_restores_bit_identical_outputs_and_leaves_nothing(sd1_unet):
    inputs = T.unet_inputs()
    before, base = module_snapshot(sd1_unet), forward(sd1_unet, inputs)
    tomesd.apply_patch(sd1_unet, seed=1)
    once_hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in sd1_unet.modules())
    once = forward(sd1_unet, inputs)
    tomesd.apply_patch(sd1_unet, seed=1)
    twice_hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in sd1_unet.modules())
    assert twice_hooks == once_hooks > 0
    assert torch.equal(forward(sd1_unet, inputs), once)
    assert not torch.equal(once, base)
    tomesd.remove_patch(sd1_unet)
    assert module_snapshot(sd1_unet) == before
    assert torch.equal(forward(sd1_unet, inputs), base)
    tomesd.remove_patch(sd1_unet)  # removing twice is a no-op


@pytest.mark.parametrize(
    "bad",
    [dict(ratio=1.5), dict(ratio=-0.1), dict(ratio="0.5"), dict(sx=0), dict(sy=2.5), dict(max_downsample=0),
     dict(use_rand="no"), dict(merge_attn=1), dict(seed=1.5)],
)
def test_bad_arguments_raise_and_leave_the_patch_in_place(sd1_unet, bad):
    inputs = T.unet_inputs()
    base = forward(sd1_unet, inputs)
    tomesd.apply_patch(sd1_unet, ratio=0.5, use_rand=False)
    try:
        patched, snapshot = forward(sd1_unet, inputs), module_snapshot(sd1_unet)
        assert_acts(patched, base)  # ToMe acts, far beyond the tolerance
        (name,) = bad
        with pytest.raises(ValueError, match=name):
            tomesd.apply_patch(sd1_unet, **bad)
        assert module_snapshot(sd1_unet) == snapshot
        assert torch.equal(forward(sd1_unet, inputs), patched)
    finally:
        tomesd.remove_patch(sd1_unet)


def test_unsupported_objects_are_refused_clearly():
    from diffusers import AutoencoderKL

    with pytest.raises(TypeError, match="cannot patch a str"):
        tomesd.apply_patch("stable-diffusion")
    vae = AutoencoderKL(block_out_channels=(8,), norm_num_groups=8)
    snapshot = module_snapshot(vae)
    with pytest.raises(ValueError, match="found no transformer block ToMe knows"):
        tomesd.apply_patch(vae)
    assert module_snapshot(vae) == snapshot


def test_seed_reproducible_and_global_rng_untouched(sd1_unet):
    inputs = T.unet_inputs()
    run = lambda: forward(sd1_unet, inputs)  # noqa: E731
    base = run()
    first, again = with_ours(sd1_unet, run, seed=1), with_ours(sd1_unet, run, seed=1)
    other = with_ours(sd1_unet, run, seed=2)
    assert_acts(first, base)  # ToMe acts, far beyond the tolerance
    assert torch.equal(first, again)
    assert not torch.equal(first, other)
    # Within one patch too: a call's pattern depends on its timestep, not on how many calls came before.
    x, t, c = inputs
    tomesd.apply_patch(sd1_unet, seed=1)
    try:
        runs = [forward(sd1_unet, (x, t, c)) for _ in range(2)]
        other_step = forward(sd1_unet, (x, torch.tensor(11), c))
    finally:
        tomesd.remove_patch(sd1_unet)
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], first)
    top_left = with_ours(sd1_unet, run, use_rand=False)
    assert not torch.equal(first, top_left)
    assert not torch.equal(other_step, forward(sd1_unet, (x, torch.tensor(11), c)))  # ToMe active at t=11

    torch.manual_seed(0)
    expected = torch.rand(8)
    torch.manual_seed(0)
    with_ours(sd1_unet, run)  # no seed: forked from the global state, which is not advanced
    assert torch.equal(torch.rand(8), expected)


@pytest.mark.parametrize("use_rand", [False, True])
def test_concurrent_calls_at_two_resolutions_equal_sequential_ones(sd1_unet, use_rand):
    jobs = [T.unet_inputs(2, 16, 16, seed=5), T.unet_inputs(2, 24, 20, seed=6)]
    bases = [forward(sd1_unet, job) for job in jobs]
    tomesd.apply_patch(sd1_unet, ratio=0.5, use_rand=use_rand, seed=4)
    try:
        seen = []
        block = next(m for m in sd1_unet.modules() if type(m).__name__ == "BasicTransformerBlock")
        handle = block.attn1.to_q.register_forward_pre_hook(lambda m, a: seen.append(a[0].shape[1]))
        expected = [forward(sd1_unet, job) for job in jobs]
        handle.remove()
        assert seen == [16 * 16 // 2, 24 * 20 // 2]  # both resolutions merge
        for out, base in zip(expected, bases):
            assert_acts(out, base)  # ToMe acts at both, far beyond the tolerance
        results = concurrent_calls(sd1_unet, lambda job: forward(sd1_unet, job), jobs)
        for i, outs in results.items():
            for out in outs:
                assert torch.equal(out, expected[i % 2])
    finally:
        tomesd.remove_patch(sd1_unet)


def set_chunking(unet, chunk_size):
    for m in unet.modules():
        if type(m).__name__ == "BasicTransformerBlock":
            m.set_chunk_feed_forward(chunk_size, 1 if chunk_size else 0)


def test_chunked_feed_forward_with_merge_mlp_is_refused():
    unet = T.unet()
    inputs = T.unet_inputs()
    set_chunking(unet, 2)
    snapshot = module_snapshot(unet)
    with pytest.raises(ValueError, match="chunk"):
        tomesd.apply_patch(unet, merge_mlp=True)
    assert module_snapshot(unet) == snapshot
    set_chunking(unet, None)
    base = forward(unet, inputs)
    tomesd.apply_patch(unet, merge_mlp=True, use_rand=False)
    merged_mlp = forward(unet, inputs)
    assert_acts(merged_mlp, base)  # ToMe acts, far beyond the tolerance
    set_chunking(unet, 2)  # enabled after patching: refused at call time
    with pytest.raises(ValueError, match="chunk"):
        forward(unet, inputs)
    set_chunking(unet, None)
    assert torch.equal(forward(unet, inputs), merged_mlp)  # a refused call leaves no stale state
    tomesd.remove_patch(unet)


@pytest.mark.parametrize("flags", [dict(merge_crossattn=True), dict(merge_mlp=True), dict(merge_attn=False, merge_mlp=True)])
def test_merge_flags_equal_tomesd(sd1_unet, flags):
    inputs = T.unet_inputs()
    run = lambda: forward(sd1_unet, inputs)  # noqa: E731
    assert_parity(run(), with_ours(sd1_unet, run, use_rand=False, **flags), with_tomesd(sd1_unet, run, use_rand=False, **flags))


@pytest.mark.parametrize("num_controlnets", [1, 2], ids=["controlnet", "multi-controlnet"])
def test_controlnet_pipeline_patched_end_to_end(tmp_path, num_controlnets):
    pipe = T.controlnet_pipeline(tmp_path, num_controlnets)
    nets = pipe.controlnet.nets if num_controlnets > 1 else [pipe.controlnet]
    base = T.run_pipeline(pipe, num_controlnets)

    ref.apply_patch(pipe)  # tomesd's gap: ControlNet blocks stay unpatched
    assert all(type(m).__name__ != "ToMeBlock" for net in nets for m in net.modules())
    ref.remove_patch(pipe)

    tomesd.apply_patch(pipe, seed=0)
    for net in list(nets) + [pipe.unet]:
        patch = getattr(net, PATCH_ATTR)
        assert len(patch.blocks) > 0
    assert getattr(pipe.vae, PATCH_ATTR, None) is None and getattr(pipe.text_encoder, PATCH_ATTR, None) is None
    # The ControlNet itself merges: its residuals change under ToMe.
    x, t, c = T.unet_inputs(2, 16, 16)
    cond = torch.rand(2, 3, 32, 32)
    with torch.no_grad():
        patched_res = nets[0](x, t, c, cond, return_dict=False)[1]
    tomesd.remove_patch(nets[0])
    with torch.no_grad():
        plain_res = nets[0](x, t, c, cond, return_dict=False)[1]
    assert (patched_res - plain_res).abs().max().item() > 1e-3
    tomesd.apply_patch(pipe, seed=0)

    merged = T.run_pipeline(pipe, num_controlnets)
    assert abs(merged - base).max() > 1e-3
    tomesd.remove_patch(pipe)
    assert (T.run_pipeline(pipe, num_controlnets) == base).all()


def pixart():
    from diffusers import PixArtTransformer2DModel

    model = T.randomize_(PixArtTransformer2DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8, num_layers=2,
        cross_attention_dim=16, sample_size=8, patch_size=2, caption_channels=16, use_additional_conditions=False,
    ))
    gen = torch.Generator().manual_seed(4)
    x, text = torch.randn(2, 4, 8, 8, generator=gen), torch.randn(2, 5, 16, generator=gen)
    t = torch.tensor([10, 10])

    def run():
        with torch.no_grad():
            return model(x, encoder_hidden_states=text, timestep=t, added_cond_kwargs={"resolution": None, "aspect_ratio": None}).sample

    return model, run


def test_newer_block_variant_runs_unchanged_where_tomesd_copy_is_wrong():
    """PixArt's blocks (norm_type ada_norm_single): tomesd's copied forward is an old diffusers
    forward that drops the adaptive scale/shift (and, on diffusers that build these blocks without
    norm3, fails outright), so even merging nothing breaks the output; our hooks leave the block's
    own forward in charge."""
    model, run = pixart()
    base = run()
    try:
        tomesd_r0 = with_tomesd(model, run, ratio=0.0, max_downsample=2, use_rand=False)
        assert (tomesd_r0 - base).abs().max().item() > 1e-2  # tomesd's gap: wrong with nothing merged
    except AttributeError as exc:  # tomesd's gap on diffusers 0.42: its copy needs a norm3
        assert "norm3" in str(exc)
    assert torch.equal(with_ours(model, run, ratio=0.0), base)


def test_newer_block_variant_equals_its_own_math_with_merge_placed_by_hand():
    """The patched PixArt block equals the block's own forward with attn1 wrapped by hand in
    merge -> attention -> unmerge, the merge computed from the block's input as tomesd does. The reference
    shares tome_core's matching (bipartite_soft_matching_random2d) with the code under test, so it checks
    where the merge sits; the matching's arithmetic is checked independently in
    tests/core/test_matching_by_loop.py (and against tomesd 0.1.3 in test_core_vs_tomesd.py)."""
    from tome_core import bipartite_soft_matching_random2d

    model, run = pixart()
    block = next(m for m in model.modules() if type(m).__name__ == "BasicTransformerBlock")
    captured = {}
    pre = block.register_forward_pre_hook(lambda m, a, k: captured.update(args=a, kwargs=k), with_kwargs=True)
    post = block.register_forward_hook(lambda m, a, out: captured.setdefault("outs", []).append(out))
    base = run()
    tomesd.apply_patch(model, ratio=0.5, use_rand=False)  # patchified 4x4 tokens: the finest level is 2
    patched = run()
    tomesd.remove_patch(model)
    pre.remove()
    post.remove()
    plain_out, patched_out = captured["outs"]
    args, kwargs = captured["args"], captured["kwargs"]
    tokens = args[0] if args else kwargs["hidden_states"]
    merge, unmerge = bipartite_soft_matching_random2d(tokens, 4, 4, 2, 2, 8, no_rand=True)
    attn1 = block.attn1

    class ByHand(torch.nn.Module):
        def forward(self, hidden_states, *a, **k):
            return unmerge(attn1(merge(hidden_states), *a, **k))

    block.attn1 = ByHand()
    try:
        with torch.no_grad():
            by_hand = block(*args, **kwargs)
    finally:
        block.attn1 = attn1
    assert (patched_out - plain_out).abs().max() > 1e-2 and (patched - base).abs().max() > 1e-3
    assert (patched_out - by_hand).abs().max() < 1e-5


@pytest.mark.parametrize("bad_call", ["not-a-latent", "no-latent"])
def test_a_rejected_call_leaves_an_enclosing_call_intact(sd1_unet, bad_call):
    """A root called with a non-latent or without its latent is refused; an enclosing call's state survives."""
    from tomesd.runtime.calls import CallState

    tomesd.apply_patch(sd1_unet, use_rand=False)
    try:
        patch = getattr(sd1_unet, PATCH_ATTR)
        outer = CallState()
        patch.calls.push(outer, eager=True)
        with pytest.raises((ValueError, TypeError), match=r"latent \[B, C, H, W\]|no 'sample' input"):
            with torch.no_grad():
                if bad_call == "not-a-latent":
                    sd1_unet(torch.randn(2, 4, 16), torch.tensor(1), torch.randn(2, 7, 32))
                else:
                    sd1_unet(timestep=torch.tensor(1), encoder_hidden_states=torch.randn(2, 7, 32))
        assert patch.calls.current() == [outer] and patch.calls.top() is outer  # the hooks find the outer call
        assert patch.calls.pop() is outer and patch.calls.top() is None
    finally:
        tomesd.remove_patch(sd1_unet)


# A UNet with SD's four levels: attention at levels 1, 2 and 4, and in the mid block at level 8.
FOUR_LEVELS = dict(
    T.SD1_UNET, block_out_channels=(16, 16, 32, 32),
    down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
    up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
)


def attn1_tokens(unet):
    seen = []
    blocks = [m for m in unet.modules() if type(m).__name__ == "BasicTransformerBlock"]
    handles = [b.attn1.to_q.register_forward_pre_hook(lambda m, a, b=b: seen.append(a[0].shape[1])) for b in blocks]
    return seen, handles


@pytest.mark.parametrize("max_downsample", [1, 2, 4, 8])
def test_every_latent_size_runs_at_every_max_downsample(max_downsample):
    unet = T.unet(FOUR_LEVELS)
    sizes = [(17, 24), (13, 9), (16, 16), (15, 17), (9, 31), (8, 8)]
    tomesd.apply_patch(unet, ratio=0.5, max_downsample=max_downsample)
    try:
        for h, w in sizes:
            seen, handles = attn1_tokens(unet)
            out = forward(unet, T.unet_inputs(2, h, w))
            for handle in handles:
                handle.remove()
            assert out.shape == (2, 4, h, w) and torch.isfinite(out).all()
            tomesd.remove_patch(unet)
            plain, handles = attn1_tokens(unet)
            forward(unet, T.unet_inputs(2, h, w))
            for handle in handles:
                handle.remove()
            tomesd.apply_patch(unet, ratio=0.5, max_downsample=max_downsample)
            merged_levels = {p for p, q in zip(plain, seen) if q < p}
            assert -(-h // 1) * -(-w // 1) in merged_levels  # the finest level always merges
            if max_downsample == 8:  # every level whose grid fits the tokens merges, level 8 included
                assert -(-h // 8) * -(-w // 8) in merged_levels or -(-h // 8) * -(-w // 8) < 2
    finally:
        tomesd.remove_patch(unet)


def test_a_root_whose_input_is_not_an_image_latent_is_refused_at_apply_time():
    import diffusers

    model = diffusers.PriorTransformer(num_attention_heads=2, attention_head_dim=8, num_layers=1, embedding_dim=16,
                                       num_embeddings=4)
    before = module_snapshot(model)
    with pytest.raises(TypeError, match="PriorTransformer"):
        tomesd.apply_patch(model)
    assert module_snapshot(model) == before


def test_inputs_by_keyword_equal_inputs_by_position(sd1_unet):
    x, t, c = T.unet_inputs()
    base = forward(sd1_unet, (x, t, c))
    tomesd.apply_patch(sd1_unet, ratio=0.5)
    try:
        with torch.no_grad():
            positional = sd1_unet(x, t, c).sample
            keyword = sd1_unet(sample=x, timestep=t, encoder_hidden_states=c).sample
            other_step = sd1_unet(sample=x, timestep=t + 7, encoder_hidden_states=c).sample
    finally:
        tomesd.remove_patch(sd1_unet)
    assert_acts(keyword, base)  # ToMe acts, far beyond the tolerance
    assert torch.equal(positional, keyword)
    assert not torch.equal(keyword, other_step)  # the keyword timestep keys the pattern


class HintedRoot(torch.nn.Module):
    """An LDM ControlNet's call shape: (x, hint, timesteps, context); the hint is not a timestep."""

    def __init__(self, unet):
        super().__init__()
        self.unet = unet

    def forward(self, x, hint, timesteps, context):
        return self.unet(x + 0 * hint.mean(), timesteps, context)


def test_the_timestep_is_found_by_the_models_own_signature():
    root = HintedRoot(T.ldm_model().model.diffusion_model)
    x, t, c = T.unet_inputs()
    t = t.expand(2)
    tomesd.apply_patch(root, ratio=0.5)
    try:
        with torch.no_grad():
            outs = [root(x, torch.rand(2, 3, 8, 8, generator=torch.Generator().manual_seed(i)), t, c) for i in range(2)]
            later = root(x, outs[0][:, :3, :8, :8] * 0, t + 5, c)
    finally:
        tomesd.remove_patch(root)
    with torch.no_grad():
        plain = root(x, torch.zeros(2, 3, 8, 8), t, c)
    assert (outs[0] - plain).abs().max() > 1e-2
    assert torch.equal(outs[0], outs[1])  # a different hint is not a different timestep
    assert not torch.equal(outs[0], later)


def test_deepcopy_and_pickle_of_patched_models_and_pipelines(tmp_path):
    import copy
    import pickle

    pipe = T.controlnet_pipeline(tmp_path)
    x, t, c = T.unet_inputs()
    base = forward(pipe.unet, (x, t, c))
    tomesd.apply_patch(pipe, ratio=0.5)
    patched = forward(pipe.unet, (x, t, c))
    assert (patched - base).abs().max() > 1e-2
    for clone in (copy.deepcopy(pipe), pickle.loads(pickle.dumps(pipe))):
        assert clone.unet is not pipe.unet
        patch = getattr(clone.unet, PATCH_ATTR)
        assert patch.root is clone.unet and all(b in list(clone.unet.modules()) for b in patch.blocks)
        assert getattr(clone.controlnet, PATCH_ATTR).root is clone.controlnet
        assert torch.equal(forward(clone.unet, (x, t, c)), patched)
        tomesd.remove_patch(clone)
        assert torch.equal(forward(clone.unet, (x, t, c)), base)
        assert all(not m._forward_pre_hooks and not m._forward_hooks for m in clone.unet.modules())
        assert not any(PATCH_ATTR in m.__dict__ for m in clone.unet.modules())
        assert torch.equal(forward(pipe.unet, (x, t, c)), patched)  # the original stays patched
    tomesd.remove_patch(pipe)


def test_nothing_computed_outlives_the_call_or_the_patch():
    """No module-wide cache: after a patched call and remove_patch, no index tensor of ToMe's is alive."""
    import gc

    def live_int64_tensors():
        gc.collect()
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.dtype == torch.int64)

    unet = T.unet()
    inputs = T.unet_inputs(2, 20, 12)  # a grid no other test uses, so nothing of it can be cached yet
    before = live_int64_tensors()
    for use_rand in (False, True):
        tomesd.apply_patch(unet, ratio=0.5, use_rand=use_rand)
        out = forward(unet, inputs)
        tomesd.remove_patch(unet)
    del out
    assert live_int64_tensors() == before
