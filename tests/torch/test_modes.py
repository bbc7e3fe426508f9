"""mode="downsample" (ToDo) and reuse_steps / share_across_blocks on torch models."""
import copy

import pytest
import torch
import torch.nn.functional as F

import tiny_torch as T
import tomesd
from threads import run_in_threads
from tomesd.adapters import hooks

TOL = 1e-5


def forward(model, inputs):
    x, t, c = inputs
    with torch.no_grad():
        return model(x, t, c).sample


def blocks(model):
    return [m for m in model.modules() if type(m).__name__ == "BasicTransformerBlock"]


def downsample_by_hand(x, h, w, factor, method):
    """The reference: torch's own pooling/interpolation on the [B, C, h, w] image of the tokens."""
    b, n, c = x.shape
    img = x.transpose(1, 2).reshape(b, c, h, w)
    if method == "avg":
        small = F.avg_pool2d(img, factor, ceil_mode=True, count_include_pad=False)
    elif h % factor == 0 and w % factor == 0:
        small = F.interpolate(img, scale_factor=1 / factor, mode="nearest")
    else:
        small = img[:, :, ::factor, ::factor]
    return small.flatten(2).transpose(1, 2)


def hand_patch(model, h, w, factor, method):
    """Downsampled keys/values for the blocks at the finest level, placed by hand (no tomesd code)."""
    handles = []
    for block in blocks(model):
        def pre(module, args, kwargs):
            x = args[0] if args else kwargs["hidden_states"]
            if x.shape[1] != h * w:
                return None
            return args, {**kwargs, "encoder_hidden_states": downsample_by_hand(x, h, w, factor, method)}

        handles.append(block.attn1.register_forward_pre_hook(pre, with_kwargs=True))
    return handles


def kv_lengths(model):
    """(query length, key length) seen by each block's attn1, appended per call."""
    seen = []
    handles = []
    for block in blocks(model):
        attn = block.attn1
        handles.append(attn.to_q.register_forward_pre_hook(lambda m, a: seen.append(("q", a[0].shape[1]))))
        handles.append(attn.to_k.register_forward_pre_hook(lambda m, a: seen.append(("k", a[0].shape[1]))))
    return seen, handles


@pytest.fixture(scope="module")
def sd1_unet():
    return T.unet()


@pytest.mark.parametrize("method", ["nearest", "avg"])
@pytest.mark.parametrize("factor", [2, 3])
@pytest.mark.parametrize("h,w", [(16, 16), (15, 17)])
def test_downsample_equals_attention_over_keys_downsampled_by_hand(sd1_unet, method, factor, h, w):
    inputs = T.unet_inputs(2, h, w)
    base = forward(sd1_unet, inputs)
    handles = hand_patch(sd1_unet, h, w, factor, method)
    try:
        expected = forward(sd1_unet, inputs)
    finally:
        for handle in handles:
            handle.remove()
    tomesd.apply_patch(sd1_unet, mode="downsample", downsample_factor=factor, downsample_method=method)
    try:
        ours = forward(sd1_unet, inputs)
    finally:
        tomesd.remove_patch(sd1_unet)
    effect = (expected - base).abs().max().item()
    assert effect > 1000 * TOL, effect
    assert (ours - expected).abs().max().item() < TOL
    assert torch.equal(forward(sd1_unet, inputs), base)  # removed: bit-identical again


def test_downsample_keeps_queries_full_and_shrinks_keys_at_the_default_levels():
    for config, level in ((T.SD1_UNET, 1), (T.SDXL_UNET, 2)):
        unet = T.unet(config)
        tomesd.apply_patch(unet, mode="downsample")
        seen, handles = kv_lengths(unet)
        forward(unet, T.unet_inputs(2, 16, 16))
        for handle in handles:
            handle.remove()
        tomesd.remove_patch(unet)
        n = (16 // level) ** 2
        queries = [v for k, v in seen if k == "q"]
        keys = [v for k, v in seen if k == "k"]
        assert n in queries and n // 4 in keys  # the level of the default rule, keys 1/4
        for q, k in zip(queries, keys):
            assert k == (q // 4 if q == n else q)  # every other level untouched


def test_downsample_on_ldm_and_controlnet_models(tmp_path):
    # SD2's level-1 blocks here take keys from the text (disable_self_attn): nothing to downsample
    # there, so level 2 is reached with max_downsample=2.
    for sd2, max_downsample in ((False, None), (True, 1), (True, 2)):
        model = T.ldm_model(sd2=sd2)
        x, t, c = T.unet_inputs()
        run = lambda: model.model.diffusion_model(x, t.expand(2), c)
        with torch.no_grad():
            base = run()
            tomesd.apply_patch(model, mode="downsample", downsample_method="avg", max_downsample=max_downsample)
            down = run()
            tomesd.remove_patch(model)
            again = run()
        effect = (down - base).abs().max().item()
        assert effect == 0 if (sd2, max_downsample) == (True, 1) else effect > 1000 * TOL
        assert torch.equal(again, base)
    from diffusers import ControlNetModel

    controlnet = T.randomize_(ControlNetModel.from_unet(T.unet(), conditioning_embedding_out_channels=(8, 16)), 3)
    x, t, c = T.unet_inputs()
    cond = torch.randn(2, 3, 32, 32)
    seen, handles = kv_lengths(controlnet)
    with torch.no_grad():
        base = controlnet(x, t, c, cond, return_dict=False)[1]
        tomesd.apply_patch(controlnet, mode="downsample")
        down = controlnet(x, t, c, cond, return_dict=False)[1]
        tomesd.remove_patch(controlnet)
    for handle in handles:
        handle.remove()
    assert ("k", 16 * 16 // 4) in seen
    assert (down - base).abs().max().item() > 1000 * TOL


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(mode="downsample", ratio=0.5),
        dict(mode="downsample", use_rand=False),
        dict(mode="downsample", seed=1),
        dict(mode="downsample", reuse_steps=2),
        dict(mode="downsample", downsample_factor=0),
        dict(mode="downsample", downsample_factor=1.5),
        dict(mode="downsample", downsample_method="bicubic"),
        dict(mode="merge", downsample_factor=2),
        dict(downsample_method="avg"),
        dict(mode="todo"),
        dict(reuse_steps=0),
        dict(reuse_steps=2.0),
        dict(share_across_blocks="yes"),
        dict(merge_attn=False, reuse_steps=2),
    ],
)
def test_arguments_a_mode_cannot_use_are_refused_and_leave_the_model_alone(sd1_unet, kwargs):
    inputs = T.unet_inputs()
    base = forward(sd1_unet, inputs)
    with pytest.raises((ValueError, TypeError)) as info:
        tomesd.apply_patch(sd1_unet, **kwargs)
    assert any(name in str(info.value) for name in kwargs), info.value  # names what was wrong
    assert not hasattr(sd1_unet, hooks.PATCH_ATTR)
    assert torch.equal(forward(sd1_unet, inputs), base)


def count_matches(monkeypatch):
    calls = []
    real = hooks.compute_merge

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(hooks, "compute_merge", spy)
    return calls


def step_inputs(t, seed, batch=2, h=16, w=16):
    x, _, c = T.unet_inputs(batch, h, w, seed=seed)
    return x, torch.tensor(t), c


def test_reuse_steps_recomputes_on_a_new_timestep_not_on_a_second_call(sd1_unet, monkeypatch):
    calls = count_matches(monkeypatch)
    merging_blocks = 3  # tiny SD1: 1 down + 2 up blocks at the finest level
    tomesd.apply_patch(sd1_unet, ratio=0.5, reuse_steps=3)
    try:
        counts = []
        # Two calls per step (classifier-free guidance as two calls), steps at timesteps 900..300.
        for step, t in enumerate([900, 800, 700, 600, 500, 400]):
            for half in range(2):
                before = len(calls)
                forward(sd1_unet, step_inputs(t, seed=10 * step + half))
                counts.append(len(calls) - before)
        # Matched at steps 0 and 3 (first call only); every other call reuses.
        assert counts == [merging_blocks, 0, 0, 0, 0, 0, merging_blocks, 0, 0, 0, 0, 0]
        # A new denoising run (the timestep rises again) matches anew, at once.
        before = len(calls)
        forward(sd1_unet, step_inputs(900, seed=3))
        assert len(calls) - before == merging_blocks
        # A different batch or grid matches anew, at once, even with the same token count (16x24 vs 24x16).
        before = len(calls)
        forward(sd1_unet, step_inputs(800, seed=1, batch=4))
        forward(sd1_unet, step_inputs(700, seed=1, h=16, w=24))
        forward(sd1_unet, step_inputs(600, seed=1, h=24, w=16))
        assert len(calls) - before == 3 * merging_blocks
        # With gradients on (training), every call matches: each is a new batch of images.
        before = len(calls)
        x, t, c = step_inputs(500, seed=2)
        sd1_unet(x, t, c)
        sd1_unet(x, torch.tensor(400), c)
        assert len(calls) - before == 2 * merging_blocks
    finally:
        tomesd.remove_patch(sd1_unet)


def test_reuse_steps_output_is_the_anchor_steps_matching(sd1_unet):
    steps = [step_inputs(t, seed=s) for s, t in enumerate([900, 700, 500, 300])]
    exact = []
    tomesd.apply_patch(sd1_unet, ratio=0.5)
    exact = [forward(sd1_unet, inputs) for inputs in steps]
    tomesd.apply_patch(sd1_unet, ratio=0.5, reuse_steps=3)
    try:
        reused = [forward(sd1_unet, inputs) for inputs in steps]
    finally:
        tomesd.remove_patch(sd1_unet)
    base = [forward(sd1_unet, inputs) for inputs in steps]
    assert (exact[1] - base[1]).abs().max().item() > 1000 * TOL  # merging matters here
    assert torch.equal(reused[0], exact[0]) and torch.equal(reused[3], exact[3])  # matched afresh
    assert (reused[1] - exact[1]).abs().max().item() > 100 * TOL  # step 1 used step 0's matching


def test_reuse_steps_one_is_exact_tome(sd1_unet):
    inputs = T.unet_inputs()
    tomesd.apply_patch(sd1_unet, ratio=0.5)
    exact = forward(sd1_unet, inputs)
    tomesd.apply_patch(sd1_unet, ratio=0.5, reuse_steps=1)
    try:
        assert torch.equal(forward(sd1_unet, inputs), exact)
    finally:
        tomesd.remove_patch(sd1_unet)


def test_share_across_blocks_matches_once_per_level_and_call(sd1_unet, monkeypatch):
    calls = count_matches(monkeypatch)
    tomesd.apply_patch(sd1_unet, ratio=0.5, max_downsample=2, share_across_blocks=True)
    try:
        forward(sd1_unet, T.unet_inputs())
        assert len(calls) == 2  # levels 1 and 2
        forward(sd1_unet, T.unet_inputs(seed=7))
        assert len(calls) == 4  # and again at the next call: nothing kept across calls
        out = forward(sd1_unet, T.unet_inputs())
    finally:
        tomesd.remove_patch(sd1_unet)
    assert (out - forward(sd1_unet, T.unet_inputs())).abs().max().item() > 1000 * TOL


def loop(model, seed):
    return [forward(model, step_inputs(t, seed=seed + t)) for t in (900, 900, 700, 700, 500, 300, 100)]


@pytest.mark.parametrize("kwargs", [dict(ratio=0.5, reuse_steps=2), dict(mode="downsample", downsample_method="avg")])
def test_concurrent_denoising_loops_equal_serial_ones(sd1_unet, kwargs):
    tomesd.apply_patch(sd1_unet, **kwargs)
    try:
        expected = [loop(sd1_unet, seed) for seed in (1, 2)]
        results = run_in_threads(lambda i: loop(sd1_unet, 1 + i % 2))
        for i, outs in results.items():
            for out, exp in zip(outs, expected[i % 2]):
                assert torch.equal(out, exp)
    finally:
        tomesd.remove_patch(sd1_unet)


@pytest.mark.parametrize("kwargs", [dict(ratio=0.5, reuse_steps=3), dict(mode="downsample")])
def test_deepcopy_of_a_patched_model_runs_alike_and_apart(kwargs):
    unet = T.unet()
    tomesd.apply_patch(unet, **kwargs)
    first = loop(unet, 3)
    twin = copy.deepcopy(unet)
    assert [torch.equal(a, b) for a, b in zip(loop(twin, 3), first)] == [True] * len(first)
    tomesd.remove_patch(twin)
    assert not hasattr(twin, hooks.PATCH_ATTR)
    assert hasattr(unet, hooks.PATCH_ATTR)


def test_reuse_steps_refuses_a_compiled_graph_clearly(sd1_unet):
    compiled = torch.compile(sd1_unet, backend="eager")
    with pytest.raises(ValueError, match="reuse_steps"):  # at apply time when already compiled
        tomesd.apply_patch(compiled, ratio=0.5, reuse_steps=2)
    assert not hasattr(sd1_unet, hooks.PATCH_ATTR)
    tomesd.apply_patch(sd1_unet, ratio=0.5, reuse_steps=2)
    try:
        compiled = torch.compile(sd1_unet, backend="eager", fullgraph=True)
        with pytest.raises(Exception, match="reuse_steps"):
            forward(compiled, T.unet_inputs())
    finally:
        tomesd.remove_patch(sd1_unet)
        torch.compiler.reset()


def test_downsample_refuses_fused_qkv_projections_clearly():
    unet = T.unet()
    unet.fuse_qkv_projections()
    with pytest.raises(ValueError, match="unfuse_qkv_projections"):  # at apply time
        tomesd.apply_patch(unet, mode="downsample")
    assert not hasattr(unet, hooks.PATCH_ATTR)
    unet.unfuse_qkv_projections()
    tomesd.apply_patch(unet, mode="downsample")
    unet.fuse_qkv_projections()  # fused after apply: refused by name, not an AttributeError deep inside
    with pytest.raises(ValueError, match="unfuse_qkv_projections"):
        forward(unet, T.unet_inputs())
    unet.unfuse_qkv_projections()
    assert forward(unet, T.unet_inputs()).shape == (2, 4, 16, 16)
    tomesd.remove_patch(unet)


def test_downsample_refuses_a_self_attention_without_a_context_argument():
    unet = T.unet()
    attn = blocks(unet)[0].attn1
    plain_forward = attn.forward
    attn.forward = lambda *args, **kwargs: plain_forward(*args, **kwargs)  # a wrapper hiding the signature
    with pytest.raises(ValueError, match="context argument"):
        tomesd.apply_patch(unet, mode="downsample")
    assert not hasattr(unet, hooks.PATCH_ATTR)


@pytest.mark.parametrize("name", ["sdxl", "controlnet"])
def test_reuse_steps_on_sdxl_layout_and_controlnet(name, monkeypatch):
    """SDXL's default level (2) and a ControlNet (a root of its own) reuse alike, and remove_patch
    restores the exact outputs."""
    from diffusers import ControlNetModel

    if name == "sdxl":
        model = T.unet(T.SDXL_UNET)
        run = lambda inputs: forward(model, inputs)  # noqa: E731
    else:
        model = T.randomize_(ControlNetModel.from_unet(T.unet(), conditioning_embedding_out_channels=(8, 16)), 3)
        cond = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(4))

        def run(inputs):
            x, t, c = inputs
            with torch.no_grad():
                return model(x, t, c, cond, return_dict=False)[1]

    steps = [step_inputs(t, seed=s) for s, t in enumerate([900, 900, 700, 500])]  # two calls at 900
    base = [run(inputs) for inputs in steps]
    calls = count_matches(monkeypatch)
    tomesd.apply_patch(model, ratio=0.5, reuse_steps=2)
    counts = []
    for inputs in steps:
        before = len(calls)
        out = run(inputs)
        counts.append(len(calls) - before)
    tomesd.remove_patch(model)
    assert counts[0] > 0 and counts == [counts[0], 0, 0, counts[0]]  # matched at steps 1 and 3 only
    assert (out - base[-1]).abs().max().item() > 1000 * TOL
    assert all(torch.equal(run(inputs), b) for inputs, b in zip(steps, base))
