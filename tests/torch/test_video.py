"""Video UNets (AnimateDiff's UNetMotionModel, UNet3DConditionModel, SVD's UNet): spatial blocks reduce
within each frame, by tomesd's level rule; temporal blocks, which attend over frames, are never touched."""
import copy

import pytest
import torch

import tiny_torch as T
import tomesd
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


@pytest.mark.parametrize("kind", T.VIDEO_KINDS)
def test_reuse_copies_and_the_meta_device(kind):
    model = T.video_unet(kind)
    steps = [T.video_inputs(kind, frames=FRAMES, t=t, seed=s) for s, t in enumerate((900.0, 900.0, 700.0, 500.0))]
    tomesd.apply_patch(model, ratio=0.5, reuse_steps=2)
    reused = [T.run_video(model, inputs) for inputs in steps]
    twin = copy.deepcopy(model)
    assert torch.equal(T.run_video(twin, steps[0]), reused[0])  # a copy runs alike, from scratch
    tomesd.apply_patch(model, ratio=0.5)
    exact = [T.run_video(model, inputs) for inputs in steps]
    tomesd.remove_patch(model)
    assert torch.equal(reused[0], exact[0]) and torch.equal(reused[3], exact[3])  # steps that match anew
    assert (reused[2] - exact[2]).abs().max().item() > 100 * TOL  # step 700 reuses step 900's matching
    meta = copy.deepcopy(model).to("meta")
    tomesd.apply_patch(meta, ratio=0.5)
    out = T.run_video(meta, {k: v.to("meta") for k, v in steps[0].items()})
    assert out.device.type == "meta" and out.shape == exact[0].shape


def test_only_a_grid_latent_is_accepted():
    model = T.video_unet("unet3d")
    tomesd.apply_patch(model, ratio=0.5)
    inputs = T.video_inputs("unet3d")
    inputs["sample"] = inputs["sample"][:, :, 0]  # a 4-D latent: no frame axis
    with pytest.raises((ValueError, RuntimeError)):
        T.run_video(model, inputs)
    tomesd.remove_patch(model)
