"""A real ppdiffusers StableDiffusionControlNetPipeline, built locally, with ToMe on and off."""
import numpy as np
import paddle
import pytest

import tiny_paddle as P
import tiny_torch as T
import tomesd
from tomesd.runtime.tome_patch import PATCH_ATTR


@pytest.mark.parametrize("num_controlnets", [1, 2], ids=["controlnet", "multi-controlnet"])
@pytest.mark.parametrize("entry", ["pipe.apply_tome", "tomesd.apply_patch"])
def test_controlnet_pipeline_patched_end_to_end(tmp_path, num_controlnets, entry):
    pipe = P.controlnet_pipeline(tmp_path, num_controlnets)
    nets = list(pipe.controlnet.nets) if num_controlnets > 1 else [pipe.controlnet]
    base = P.run_pipeline(pipe, num_controlnets)

    if entry == "pipe.apply_tome":
        pipe.apply_tome(ratio=0.5)
    else:
        tomesd.apply_patch(pipe, ratio=0.5)
    for model in nets + [pipe.unet]:
        assert len(getattr(model, PATCH_ATTR).blocks) > 0
    for model in (pipe.vae, pipe.text_encoder):
        assert all(PATCH_ATTR not in vars(m) for _, m in model.named_sublayers(include_self=True))

    # The ControlNet merges by itself: its residuals change under ToMe.
    x, t, c = [paddle.to_tensor(v.numpy()) for v in T.unet_inputs(2, 16, 16)]
    cond = paddle.rand([2, 3, 32, 32])
    with paddle.no_grad():
        patched = nets[0](x, t, c, cond, return_dict=False)[1].numpy()
        nets[0].remove_tome()
        plain = nets[0](x, t, c, cond, return_dict=False)[1].numpy()
    assert np.abs(patched - plain).max() > 1e-3
    pipe.apply_tome(ratio=0.5)

    merged = P.run_pipeline(pipe, num_controlnets)
    assert np.abs(merged - base).max() > 1e-3
    assert np.array_equal(P.run_pipeline(pipe, num_controlnets), merged)  # same seed, same images
    _, models = pipe.remove_tome(only_return_self=False)
    assert pipe.unet in models
    np.testing.assert_array_equal(P.run_pipeline(pipe, num_controlnets), base)


def test_denoisers_held_in_a_plain_list_are_patched(tmp_path):
    """ppdiffusers' built-in tests the list instead of its items, so it leaves list-held ControlNets
    unmerged; ours opens the list."""
    from ppdiffusers import DiffusionPipeline

    from tomesd.apply_tome import builtin_methods

    pipe = P.controlnet_pipeline(tmp_path, 2)
    nets = list(pipe.controlnet.nets)

    class ListHoldingPipeline(DiffusionPipeline):
        def __init__(self, unet, controlnets, vae):
            super().__init__()
            self.unet, self.controlnets, self.vae = unet, controlnets, vae

        @property
        def components(self):
            return {"unet": self.unet, "controlnet": self.controlnets, "vae": self.vae}

    holder = ListHoldingPipeline(pipe.unet, nets, pipe.vae)
    is_tome_block = lambda m: type(m).__name__.startswith("ToMe")  # noqa: E731  (the built-in's classes)
    with builtin_methods():
        holder.apply_tome(ratio=0.5)
        assert any(is_tome_block(m) for _, m in pipe.unet.named_sublayers())
        assert not any(is_tome_block(m) for net in nets for _, m in net.named_sublayers())  # the gap
        holder.remove_tome()

    holder.apply_tome(ratio=0.5)
    for model in nets + [pipe.unet]:
        assert len(getattr(model, PATCH_ATTR).blocks) > 0
    assert all(PATCH_ATTR not in vars(m) for _, m in pipe.vae.named_sublayers(include_self=True))
    _, models = holder.remove_tome(only_return_self=False)
    assert all(PATCH_ATTR not in vars(m) for model in nets + [pipe.unet] for _, m in model.named_sublayers(include_self=True))
    assert set(map(id, models)) == set(map(id, nets + [pipe.unet]))


def test_reuse_steps_on_a_pipeline_takes_steps_from_its_loop_and_reads_no_tensor(tmp_path, monkeypatch):
    """pipe.apply_tome(reuse_steps=2): the scheduler's loop counts the steps (no tensor value read on
    the host), giving the images the timestep rule gives when the UNet and ControlNet are patched bare."""
    from paddle_probes import count_host_reads

    pipe = P.controlnet_pipeline(tmp_path, 1)

    def run():
        paddle.seed(3)
        image = paddle.rand([1, 3, 32, 32])
        return pipe("a tiny test", image=image, num_inference_steps=4, height=32, width=32, output_type="np",
                    generator=paddle.Generator().manual_seed(0)).images

    pipe.apply_tome(ratio=0.5)
    exact = run()
    pipe.remove_tome()
    for model in (pipe.unet, pipe.controlnet):
        model.apply_tome(ratio=0.5, reuse_steps=2)  # bare models: a step is a new timestep value
    by_timestep = run()
    for model in (pipe.unet, pipe.controlnet):
        model.remove_tome()
    pipe.apply_tome(ratio=0.5, reuse_steps=2)

    clocked = []
    reads, ours = count_host_reads(monkeypatch, lambda: clocked.append(run()))
    clocked = clocked[0]
    assert ours == [], ours  # the clock reads no tensor value; the pipeline's own reads are not ToMe's
    assert np.abs(clocked - exact).max() > 1e-3  # steps 1 and 3 reuse
    np.testing.assert_array_equal(clocked, by_timestep)
    pipe.remove_tome()
    assert not {"step", "set_timesteps"} & set(vars(pipe.scheduler))
