"""tomesd.recommend: the setting for a model's family, size and device, read off the device-time model's picks (GPU)
and the CPU table; a family or size with no pick is refused by name, never guessed."""
import json

import pytest
import torch

import tiny_torch as T
import tomesd
from tomesd.recommend import CPU_PICKS, NoRecommendation

PICKS = json.load(open("tomesd/devicetime/picks.json"))


def _gpu_pick(arch):
    model = next(m for m in PICKS["models"] if m["arch"] == arch)
    return next(p for p in model["points"] if p["name"] == model["pick"])["kwargs"]


@pytest.mark.parametrize("family", ["sd1", "sdxl", "sd3", "flux"])
def test_on_a_gpu_each_family_gets_the_device_time_pick(family):
    config = tomesd.recommend(family=family, size=1024, device="cuda")
    expected = dict(_gpu_pick(family))
    mode = expected.pop("mode", "merge")
    assert config.mode == mode
    assert {k: getattr(config, k) for k in expected} == expected


def test_wan_at_its_default_size_gets_the_81_frame_pick():
    config = tomesd.recommend(family="wan", device="cuda")
    expected = dict(_gpu_pick("wan"))
    expected.pop("mode", None)
    assert {k: getattr(config, k) for k in expected} == expected


def test_a_unet_is_told_sdxl_from_sd1_by_its_config_and_sized_by_its_sample_size():
    from types import SimpleNamespace

    # SDXL's UNet as recommend reads it: the class, and its config's added time embedding
    sdxl = type("UNet2DConditionModel", (), {"config": SimpleNamespace(addition_embed_type="text_time",
                                                                      sample_size=128)})()
    sd1 = T.unet()
    with pytest.raises(NoRecommendation, match=r"no pick is recorded for sd1 at \d+x\d+ on a GPU.*sd1 1024x1024"):
        tomesd.recommend(sd1)  # its sample size (a tiny UNet's) has no pick; the message lists the ones that exist
    assert tomesd.recommend(sd1, size=1024, device="cpu") == tomesd.ToDoConfig()
    assert tomesd.recommend(sdxl) == tomesd.recommend(family="sdxl", size=1024)  # 128 latent rows: 1024²


def test_what_has_no_pick_is_refused_by_name():
    with pytest.raises(NoRecommendation, match="launch-bound on a GPU"):
        tomesd.recommend(family="sd1", size=512, device="cuda")
    with pytest.raises(NoRecommendation, match="sdxl at 1024x1024 on a CPU"):
        tomesd.recommend(family="sdxl", size=1024, device="cpu")  # the CPU table has no measured SDXL pick
    with pytest.raises(NoRecommendation, match="no picks for Linear"):
        tomesd.recommend(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="'cuda'.*'cpu'"):
        tomesd.recommend(family="sd1", device="mps")


def test_the_recommendation_applies_and_merges(tmp_path, unpatch):
    pipe = T.sd_pipeline(tmp_path)
    x, t, c = T.unet_inputs()
    plain = pipe.unet(x, t, c).sample
    config = tomesd.recommend(pipe, size=1024, device="cpu")
    assert config == tomesd.ToDoConfig() and CPU_PICKS[("sd1", 1024, 1024, None)] == {"mode": "downsample"}
    tomesd.apply_patch(pipe, config=config)
    unpatch(pipe)
    assert (pipe.unet(x, t, c).sample - plain).abs().max() > 1e-3  # the recommended setting acts
