"""Video UNets on ppdiffusers: UNet3DConditionModel and UNetSpatioTemporalConditionModel with the same
weights as in diffusers give the same outputs under ToMe. ppdiffusers 0.29's UNetMotionModel differs from
diffusers' unpatched (its motion modules, given the same weights, move the output by ~1e-2 of its size),
so on AnimateDiff paddle is checked on its own: spatial blocks reduce per frame, temporal ones never."""
import numpy as np
import paddle
import pytest

import tiny_paddle as TP
import tiny_torch as T
import tomesd

CLASSES = {"animatediff": "UNetMotionModel", "unet3d": "UNet3DConditionModel", "svd": "UNetSpatioTemporalConditionModel"}
SETTINGS = {"merge": dict(ratio=0.5), "downsample": dict(mode="downsample"), "reuse2": dict(ratio=0.5, reuse_steps=2)}
RTOL = 1e-4  # fp32 round-off relative to the output's size (measured: unpatched 2e-6, patched 2e-6)
FRAMES = 4


@pytest.fixture(scope="module", params=["svd", "unet3d"])
def twins(request, tmp_path_factory):
    import ppdiffusers

    kind = request.param
    torch_model = T.video_unet(kind)
    return kind, torch_model, TP.load_paddle(getattr(ppdiffusers, CLASSES[kind]), torch_model,
                                             tmp_path_factory.mktemp(kind))


def paddle_inputs(kind, inputs):
    out = TP.to_paddle(inputs)
    if kind == "animatediff":  # ppdiffusers' UNetMotionModel repeats the text per frame itself
        out["encoder_hidden_states"] = out["encoder_hidden_states"][::FRAMES]
    return out


def run_loop(kind, torch_model, paddle_model, timesteps):
    outs_t, outs_p = [], []
    for i, t in enumerate(timesteps):
        inputs = T.video_inputs(kind, frames=FRAMES, t=t, seed=i)
        if kind == "animatediff":  # one text per video, repeated per frame as the pipeline does
            inputs["encoder_hidden_states"] = inputs["encoder_hidden_states"][:1].repeat_interleave(FRAMES, 0)
        outs_t.append(T.run_video(torch_model, inputs).numpy())
        with paddle.no_grad():
            outs_p.append(paddle_model(**paddle_inputs(kind, inputs)).sample.numpy())
    return outs_t, outs_p


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_torch_and_paddle_agree_on_video_unets(twins, setting):
    kind, torch_model, paddle_model = twins
    timesteps = [900.0, 900.0, 700.0]
    base_t, base_p = run_loop(kind, torch_model, paddle_model, timesteps)
    tomesd.apply_patch(torch_model, **SETTINGS[setting])
    paddle_model.apply_tome(**SETTINGS[setting])
    try:
        out_t, out_p = run_loop(kind, torch_model, paddle_model, timesteps)
    finally:
        tomesd.remove_patch(torch_model)
        paddle_model.remove_tome()
    TP.assert_frameworks_agree_where_the_patch_acts(base_t, base_p, out_t, out_p, RTOL)
    _, after_p = run_loop(kind, torch_model, paddle_model, timesteps[:1])
    assert np.array_equal(after_p[0], base_p[0])  # remove_tome: bit-identical again


def test_animatediff_on_paddle_reduces_spatial_blocks_per_frame_and_never_temporal_ones(tmp_path):
    import ppdiffusers

    model = TP.load_paddle(ppdiffusers.UNetMotionModel, T.video_unet("animatediff"), tmp_path)
    inputs = paddle_inputs("animatediff", T.video_inputs("animatediff", frames=FRAMES))

    def run():
        seen, handles = {}, []
        for name, layer in model.named_sublayers():
            if type(layer).__name__ == "BasicTransformerBlock":
                handles.append(layer.attn1.to_q.register_forward_pre_hook(
                    lambda m, a, n=name: seen.setdefault(n, []).append(tuple(a[0].shape[:2]))))
        with paddle.no_grad():
            out = model(**inputs).sample.numpy()
        for handle in handles:
            handle.remove()
        return out, seen

    base, plain = run()
    model.apply_tome(ratio=0.5)
    out, seen = run()
    model.remove_tome()
    temporal = [n for n in seen if "motion_modules" in n]
    assert temporal and all(seen[n] == plain[n] and seen[n][0][1] == FRAMES for n in temporal)
    finest = [n for n in seen if n not in temporal and plain[n][0] == (FRAMES, 256)]
    assert finest and all(seen[n] == [(FRAMES, 128)] for n in finest)
    assert np.abs(out - base).max() > 1e-2
    assert np.array_equal(run()[0], base)
