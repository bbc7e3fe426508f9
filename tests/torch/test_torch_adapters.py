"""tomesd.apply_patch / remove_patch on diffusers and LDM models, against tomesd 0.1.3."""
import threading

import pytest
import torch

import tiny_torch as T
import tomesd
from references import load_tomesd_ref
from tomesd.adapters.hooks import PATCH_ATTR

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


def assert_parity(base, ours, theirs):
    effect = (ours - base).abs().max().item()
    assert effect > 1000 * TOL, f"ToMe changed the output by only {effect}: the check would be vacuous"
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
     dict(use_rand="no"), dict(merge_attn=None), dict(seed=1.5)],
)
def test_bad_arguments_raise_and_leave_the_patch_in_place(sd1_unet, bad):
    inputs = T.unet_inputs()
    tomesd.apply_patch(sd1_unet, ratio=0.5, use_rand=False)
    try:
        patched, snapshot = forward(sd1_unet, inputs), module_snapshot(sd1_unet)
        with pytest.raises((ValueError, TypeError)):
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
    with pytest.raises(ValueError, match="no BasicTransformerBlock"):
        tomesd.apply_patch(vae)
    assert module_snapshot(vae) == snapshot


def test_seed_reproducible_and_global_rng_untouched(sd1_unet):
    inputs = T.unet_inputs()
    run = lambda: forward(sd1_unet, inputs)  # noqa: E731
    first, again = with_ours(sd1_unet, run, seed=1), with_ours(sd1_unet, run, seed=1)
    other = with_ours(sd1_unet, run, seed=2)
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
    tomesd.apply_patch(sd1_unet, ratio=0.5, use_rand=use_rand, seed=4)
    try:
        expected = [forward(sd1_unet, job) for job in jobs]
        results, errors = {}, []

        def worker(i):
            try:
                results[i] = [forward(sd1_unet, jobs[i % 2]) for _ in range(3)]
            except Exception as exc:  # surfaced below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors, errors
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
    tomesd.apply_patch(unet, merge_mlp=True, use_rand=False)
    merged_mlp = forward(unet, inputs)
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


def test_newer_block_variant_runs_unchanged_where_tomesd_copy_is_wrong():
    """PixArt's blocks (norm_type ada_norm_single): tomesd's copied forward is an old diffusers
    forward that drops the adaptive scale/shift (and, on diffusers that build these blocks without
    norm3, fails outright), so even merging nothing breaks the output; our hooks leave the block's
    own forward in charge."""
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

    base = run()
    try:
        tomesd_r0 = with_tomesd(model, run, ratio=0.0, max_downsample=2, use_rand=False)
        assert (tomesd_r0 - base).abs().max().item() > 1e-2  # tomesd's gap: wrong with nothing merged
    except AttributeError as exc:  # tomesd's gap on diffusers 0.42: its copy needs a norm3
        assert "norm3" in str(exc)
    assert torch.equal(with_ours(model, run, ratio=0.0), base)
    merged = with_ours(model, run, ratio=0.5, use_rand=False)  # patchified tokens: level 2 is the finest
    assert torch.isfinite(merged).all() and (merged - base).abs().max().item() > 1e-3


@pytest.mark.parametrize("bad_call", ["not-a-latent", "no-latent"])
def test_a_rejected_call_leaves_an_enclosing_call_intact(sd1_unet, bad_call):
    """A root called with a non-latent or without its latent is refused; an enclosing call's state survives."""
    from tomesd.adapters.hooks import _Call

    tomesd.apply_patch(sd1_unet, use_rand=False)
    try:
        patch = getattr(sd1_unet, PATCH_ATTR)
        outer = _Call()
        patch._threads.stack.append(outer)
        with pytest.raises((ValueError, TypeError), match=r"latent \[B, C, H, W\]|no 'sample' input"):
            with torch.no_grad():
                if bad_call == "not-a-latent":
                    sd1_unet(torch.randn(2, 4, 16), torch.tensor(1), torch.randn(2, 7, 32))
                else:
                    sd1_unet(timestep=torch.tensor(1), encoder_hidden_states=torch.randn(2, 7, 32))
        assert patch._threads.stack == [outer]
        patch._threads.stack.clear()
    finally:
        tomesd.remove_patch(sd1_unet)
