"""The space-time yardstick: Wan's transformer on the same clips, one grid of frames x rows x columns."""
import math

import pytest
import torch

from quality_checks import EXACT, coherence, scores
from tomesd.quality import model as M
from tomesd.quality import yardstick as Y

WAN_BASE = Y.WAN_SETTINGS[0]
LIGHT = Y.Setting("ToMe r=0.25", dict(ratio=0.25))
CROSS_FRAME = Y.Setting("ToMe r=0.5 st=2", dict(ratio=0.5, st=2))
# First Block Cache at diffusers' default threshold skips no step of this model (its first block's residual
# moves more than 0.05 between steps): a setting that samples the baseline's clips bit for bit.
FBC_DEFAULT = Y.Setting("fbc alone", None, "fbc")
WAN_SMALL = dict(images=4, chunk=4, steps=6, noise_seeds=2)


@pytest.fixture(scope="module")
def wan_report():
    return Y.evaluate([WAN_BASE, LIGHT, EXACT, CROSS_FRAME, FBC_DEFAULT], models=M.load(arch="wan"), arch="wan",
                      **WAN_SMALL)


def test_a_setting_equal_to_the_baseline_reads_identical_not_infinite(wan_report):
    """A cache that skipped nothing gives the baseline's clips: the table says so, and counts it as closer than
    unrelated clips (it once printed 'inf ± nan' and 'no')."""
    same = scores(wan_report, FBC_DEFAULT.name)
    assert torch.equal(wan_report["samples"][FBC_DEFAULT.name], wan_report["samples"][WAN_BASE.name])
    assert same.identical and same.above_floor is True
    assert not any(scores(wan_report, s.name).identical for s in (LIGHT, EXACT, CROSS_FRAME))
    row = next(line for line in Y.table(wan_report).splitlines() if line.startswith("| fbc alone |"))
    assert "identical to the baseline" in row and "inf" not in row and "nan" not in row and row.endswith("| yes |")


def test_wan_yardstick_draws_clips_that_hold_together_over_time(wan_report):
    """Trained on moving digits, Wan keeps a clip's frames alike: each frame is far closer to its own clip's
    next frame than to the next frame of another clip of the label; an untrained Wan draws noise, alike to
    neither."""
    torch.manual_seed(0)  # before building: the initial weights come from the global generator
    untrained = M.build("wan")
    for module in untrained:
        module.eval()
    models = (untrained[0], untrained[1], M.load(arch="wan")[2])
    noise = coherence(Y.evaluate([WAN_BASE], models=models, arch="wan", **WAN_SMALL))
    assert coherence(wan_report) > 3 and abs(noise) < 1, (coherence(wan_report), noise)


def test_wan_yardstick_prices_cross_frame_merging_beside_per_frame(wan_report):
    """st=2 (one dst per two frames: tokens merge into the neighbouring frame's) is a setting of its own, priced
    per frame and over time like st=1; the yardstick resolves ratios (r=0.25 clearly closer than r=0.5) and
    places r=0.5 above unrelated clips."""
    samples, unrelated = wan_report["samples"], wan_report["noise_band"]["unrelated"]
    assert not torch.equal(samples[CROSS_FRAME.name], samples[EXACT.name])
    light = scores(wan_report, LIGHT.name)
    for name in (EXACT.name, CROSS_FRAME.name):
        r = scores(wan_report, name)
        assert math.isfinite(r.psnr) and r.psnr > unrelated["psnr"] + 1 and r.above_floor is True, (r, unrelated)
        assert len(r.psnr_by_frame) == M.FRAMES and math.isfinite(r.temporal_psnr), r
        assert light.psnr > r.psnr + 2 and light.temporal_psnr > r.temporal_psnr + 2, (light, r)
    assert [s.kwargs.get("st") for s in Y.WAN_SETTINGS[1:]].count(2) >= 2  # `quality --arch wan` prices st=2

