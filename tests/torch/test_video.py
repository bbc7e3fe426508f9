"""Video UNets (AnimateDiff's UNetMotionModel, UNet3DConditionModel, SVD's UNet): spatial blocks reduce
within each frame, by tomesd's level rule; temporal blocks, which attend over frames, are never touched."""
import copy

import pytest
import torch

import tiny_torch as T
import tomesd
from tome_core import block_grid
from probes import assert_loop_compiles_once_and_equals_eager

MODES = {"merge": dict(ratio=0.5), "downsample": dict(mode="downsample")}
TOL = 1e-5
FRAMES, SIDE = 4, 16


def attention_pairs(model):
    """{block path: [(batch, query tokens, key tokens)]} of every self-attention (attn1) call, hooked after
    the patch's own pre-hooks (so it sees what the projections get)."""
    seen, handles = {}, []
    for name, block in model.named_modules():
        if type(block).__name__ not in ("BasicTransformerBlock", "TemporalBasicTransformerBlock"):
            continue
        pending = []
        handles.append(block.attn1.to_q.register_forward_pre_hook(
            lambda m, a, p=pending: p.append(tuple(a[0].shape[:2]))))
        handles.append(block.attn1.to_k.register_forward_pre_hook(
            lambda m, a, n=name, p=pending: seen.setdefault(n, []).append(p.pop() + (a[0].shape[1],))))
    return seen, handles


def temporal(name):
    return any(part in name for part in ("motion_modules", "temp_attentions", "transformer_in", "temporal_transformer"))


def run_probed(model, inputs):
    seen, handles = attention_pairs(model)
    try:
        return T.run_video(model, inputs), seen
    finally:
        for handle in handles:
            handle.remove()


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("kind", T.VIDEO_KINDS)
def test_spatial_blocks_reduce_per_frame_and_temporal_blocks_never(kind, mode):
    model, inputs = T.video_unet(kind), T.video_inputs(kind, frames=FRAMES, h=SIDE, w=SIDE)
    base, plain = run_probed(model, inputs)
    tomesd.apply_patch(model, **MODES[mode])
    out, seen = run_probed(model, inputs)
    tomesd.remove_patch(model)
    assert set(seen) == set(plain) and any(temporal(n) for n in seen)
    full = SIDE * SIDE
    for name, calls in seen.items():
        if temporal(name):  # frames as tokens: untouched
            assert calls == plain[name] and all(q == k == FRAMES for _, q, k in calls), name
        elif plain[name][0][1] == full:  # the finest level: one frame per batch row, reduced
            reduced = (full // 2, full // 2) if mode == "merge" else (full, full // 4)
            assert all((b, q, k) == (FRAMES,) + reduced for b, q, k in calls), (name, calls)
        else:  # coarser levels: left alone, as on image UNets by default
            assert calls == plain[name], name
    assert (out - base).abs().max().item() > 1000 * TOL
    assert torch.equal(T.run_video(model, inputs), base)  # reversible, bit for bit


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("kind", T.VIDEO_KINDS)
def test_temporal_blocks_stay_whole_where_the_level_rule_reaches_their_token_count(kind, mode):
    """max_downsample=8 reaches every level, down to a 16x16 latent's 2x2 grid, whose FRAMES tokens are the
    temporal blocks' token count: the level rule alone would merge them, so only where they sit (inside a
    temporal container) keeps them whole. Spatial blocks at every level reduce."""
    assert block_grid((SIDE, SIDE), FRAMES) == (8, 2, 2)
    model, inputs = T.video_unet(kind), T.video_inputs(kind, frames=FRAMES, h=SIDE, w=SIDE)
    _, plain = run_probed(model, inputs)
    tomesd.apply_patch(model, max_downsample=8, **MODES[mode])
    with tomesd.observe(model) as observed:
        _, seen = run_probed(model, inputs)
    tomesd.remove_patch(model)
    spatial = [name for name in plain if not temporal(name)]
    assert set(seen) == set(plain) and spatial and len(spatial) < len(plain)
    for name, calls in seen.items():
        if temporal(name):  # frames as tokens: untouched
            assert calls == plain[name] and all(q == k == FRAMES for _, q, k in calls), (name, calls)
        elif mode == "merge":  # queries and keys merged
            assert all(q < q0 and k < k0 for (_, q, k), (_, q0, k0) in zip(calls, plain[name])), (name, calls)
        else:  # keys downsampled, queries whole
            assert all(q == q0 and k < k0 for (_, q, k), (_, q0, k0) in zip(calls, plain[name])), (name, calls)
    levels = {plain[name][0][1] for name in spatial}
    assert len(levels) > 1 or kind != "animatediff"  # AnimateDiff's SD1 UNet has attention at two levels
    (call,) = observed.calls
    site = "attn" if mode == "merge" else "downsample"
    # ToMe's own record: it hooked the spatial blocks only, and every one of them reduced.
    assert len(call.blocks) == len(call.merged_blocks(site)) == len(spatial)
    assert all(block.kind == "BasicTransformerBlock" for block in call.blocks.values())


def test_a_frame_merges_from_its_own_tokens_only():
    """AnimateDiff's first spatial block comes before any motion module, so its input for frame f is frame
    f's alone: its merged tokens of frames 1..F-1 do not change when frame 0 does. Each frame is matched
    and merged on its own grid (the random dst pattern is shared, not the tokens). (UNet3D's
    `transformer_in` and SVD's temporal res-blocks mix frames before any spatial block.)"""
    kind = "animatediff"
    model = T.video_unet(kind)
    first = next(m for n, m in model.named_modules()
                 if type(m).__name__ == "BasicTransformerBlock" and not temporal(n))
    tomesd.apply_patch(model, ratio=0.5)
    merged = []
    handle = first.attn1.to_q.register_forward_pre_hook(lambda m, a: merged.append(a[0]))
    inputs = T.video_inputs(kind, frames=FRAMES)
    T.run_video(model, inputs)
    other = {k: v.clone() for k, v in inputs.items()}
    other["sample"][:, :, 0] = torch.randn_like(other["sample"][:, :, 0])
    T.run_video(model, other)
    handle.remove()
    tomesd.remove_patch(model)
    a, b = merged[0], merged[-1]  # [frames, merged tokens, C] (batch 1)
    assert a.shape[:2] == (FRAMES, SIDE * SIDE // 2)
    assert not torch.allclose(a[0], b[0])  # frame 0 changed ...
    assert torch.equal(a[1:], b[1:])  # ... and no other frame's merge saw it


@pytest.mark.parametrize("kind", ["animatediff", "svd"])
def test_a_video_loop_compiles_as_one_graph_and_equals_eager(kind):
    model = T.video_unet(kind)
    steps = [T.video_inputs(kind, frames=FRAMES, t=t) for t in (900.0, 500.0, 100.0)]
    assert_loop_compiles_once_and_equals_eager(model, T.run_video, steps, ratio=0.5)
    tomesd.remove_patch(model)


REUSE_TIMESTEPS = (900.0, 900.0, 700.0, 500.0)  # with reuse_steps=2: match, reuse, reuse, match


def reuse_loop(kind):
    return [T.video_inputs(kind, frames=FRAMES, t=t, seed=s) for s, t in enumerate(REUSE_TIMESTEPS)]


def assert_reduced(call, blocks, site="attn"):
    """Every one of `blocks` ran `site` on fewer tokens at every time it ran, in this call."""
    for index in blocks:
        pairs = call.blocks[index].tokens(site)
        assert pairs and all(out < n for n, out in pairs), (index, pairs)


@pytest.mark.parametrize("kind", T.VIDEO_KINDS)
def test_reused_steps_merge_as_many_tokens_as_steps_that_match(kind):
    """reuse_steps=2 over timesteps 900, 900, 700, 500: the first call matches, the same step's second call
    and the next step reuse its matching, the third step matches anew, and every call, reusing ones
    included, runs the merging blocks' self-attention on the merged tokens."""
    model, steps = T.video_unet(kind), reuse_loop(kind)
    tomesd.apply_patch(model, ratio=0.5)
    exact = [T.run_video(model, inputs) for inputs in steps]
    tomesd.apply_patch(model, ratio=0.5, reuse_steps=2)
    with tomesd.observe(model) as observed:
        reused = [T.run_video(model, inputs) for inputs in steps]
    tomesd.remove_patch(model)
    assert len(observed.calls) == len(steps)
    merging = observed.calls[0].merged_blocks("attn")
    assert merging
    for i, call in enumerate(observed.calls):
        assert call.merged_blocks("attn") == merging, i
        assert_reduced(call, merging)
        matches = i in (0, 3)
        assert (call.computed, call.reused) == ((len(merging), 0) if matches else (0, len(merging))), i
    assert torch.equal(reused[0], exact[0]) and torch.equal(reused[3], exact[3])  # steps that match anew
    assert (reused[2] - exact[2]).abs().max().item() > 100 * TOL  # step 700 reuses step 900's matching


@pytest.mark.parametrize("kind", T.VIDEO_KINDS)
def test_a_copy_made_mid_loop_matches_anew_while_the_original_reuses(kind):
    """Kept matchings are never copied: a deepcopy taken after step 900 runs step 700 matching anew (as
    an unreused patch does), while the original goes on reusing step 900's matching."""
    model, steps = T.video_unet(kind), reuse_loop(kind)
    tomesd.apply_patch(model, ratio=0.5)
    exact = T.run_video(model, steps[2])
    tomesd.apply_patch(model, ratio=0.5, reuse_steps=2)
    for inputs in steps[:2]:
        T.run_video(model, inputs)
    twin = copy.deepcopy(model)
    with tomesd.observe(twin) as copied:
        from_copy = T.run_video(twin, steps[2])
    with tomesd.observe(model) as original:
        from_original = T.run_video(model, steps[2])
    tomesd.remove_patch(model)
    (call,) = copied.calls
    assert call.merged_blocks("attn") and call.reused == 0 and call.computed == len(call.merged_blocks("attn"))
    assert torch.equal(from_copy, exact)
    (call,) = original.calls
    assert call.merged_blocks("attn") and call.computed == 0 and call.reused == len(call.merged_blocks("attn"))
    assert (from_original - exact).abs().max().item() > 100 * TOL


@pytest.mark.parametrize("kind", T.VIDEO_KINDS)
def test_a_patch_on_the_meta_device_merges_the_spatial_blocks(kind):
    """On `meta` (shapes only) the patch still merges: the finest level's self-attentions see half the
    tokens, and the temporal ones every frame, as on the CPU."""
    model, inputs = T.video_unet(kind), T.video_inputs(kind, frames=FRAMES, h=SIDE, w=SIDE)
    expected = T.run_video(model, inputs)
    meta = copy.deepcopy(model).to("meta")
    _, plain = run_probed(meta, {k: v.to("meta") for k, v in inputs.items()})
    tomesd.apply_patch(meta, ratio=0.5)
    with tomesd.observe(meta) as observed:
        out, seen = run_probed(meta, {k: v.to("meta") for k, v in inputs.items()})
    assert out.device.type == "meta" and out.shape == expected.shape
    (call,) = observed.calls
    assert_reduced(call, call.merged_blocks("attn"))
    full = SIDE * SIDE
    finest = [name for name in plain if not temporal(name) and plain[name][0][1] == full]
    assert finest and len(call.merged_blocks("attn")) == len(finest)
    for name, calls in seen.items():
        if name in finest:
            assert all((b, q, k) == (FRAMES, full // 2, full // 2) for b, q, k in calls), (name, calls)
        else:
            assert calls == plain[name], name


@pytest.mark.parametrize("kind", T.VIDEO_KINDS)
def test_a_latent_without_a_frame_axis_is_refused_by_tome(kind):
    model = T.video_unet(kind)
    tomesd.apply_patch(model, ratio=0.5)
    inputs = T.video_inputs(kind)
    inputs["sample"] = inputs["sample"][:, 0] if kind == "svd" else inputs["sample"][:, :, 0]  # 4-D: no frames
    with pytest.raises(ValueError, match=r"ToMe needs \w+'s 'sample' input to be a video latent"):
        T.run_video(model, inputs)
    tomesd.remove_patch(model)
