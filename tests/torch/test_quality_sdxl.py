"""The SDXL-shaped yardstick: no attention at the top level, transformers of 2 blocks at the middle one and of 4 at the
coarse one (SDXL's 2 and 10), so merging the coarse level (max_downsample=4) reaches most blocks."""
import math

import pytest

from quality_checks import SMALL, broken_unmerge, sampled_like, scores
from tomesd.quality import model as M
from tomesd.quality import yardstick as Y

BASE = Y.SDXL_SETTINGS[0]
COARSE = Y.Setting("ToMe r=0.5 max_downsample=4", dict(ratio=0.5, max_downsample=4))
# Measured on the shipped weights with SMALL: the baseline reads as its labels 39/40; ToMe r=0.5 at both attention levels
# lies at 34.9 dB from it (SSIM 0.966), two unrelated baselines at 14.3 dB; with its unmerge broken, 18.9 dB.
MIN_ACCURACY = 0.8  # an untrained UNet scores near chance
COARSE_PSNR = 33.5


@pytest.fixture(scope="module")
def trained_sdxl():
    return M.load(arch="sdxl")


@pytest.fixture(scope="module")
def sdxl_coarse(trained_sdxl):
    return Y.evaluate([BASE, COARSE], models=trained_sdxl, arch="sdxl", **SMALL)


def test_the_unet_has_sdxls_structure(trained_sdxl):
    unet = trained_sdxl[0]
    depths = [len(t.transformer_blocks) for t in unet.modules() if type(t).__name__ == "Transformer2DModel"]
    # 16² level: 2 down and 3 up transformers of 2 blocks; 8² level and mid block: 2 + 3 + 1 of 4 (24 of 34 blocks)
    assert sorted(depths) == [2] * 5 + [4] * 6
    assert unet.down_blocks[0].__class__.__name__ == "DownBlock2D"  # no attention at the top level


def test_sdxl_yardstick_draws_digits_and_prices_tome(sdxl_coarse):
    report = sdxl_coarse
    base, coarse = scores(report, "baseline"), scores(report, COARSE.name)
    assert base.accuracy >= MIN_ACCURACY, base
    assert math.isfinite(coarse.psnr) and coarse.psnr < 60, coarse  # ToMe moved the samples ...
    # ... less than unrelated samples differ, and by a measured amount (COARSE_PSNR)
    assert coarse.psnr > report["noise_band"]["unrelated"]["psnr"] + 4, (coarse, report["noise_band"])
    assert coarse.psnr > COARSE_PSNR, coarse


def test_sdxl_yardstick_scores_a_broken_merge_clearly_worse(trained_sdxl, sdxl_coarse, monkeypatch):
    coarse = scores(sdxl_coarse, COARSE.name)
    broken_unmerge(monkeypatch)
    broken = sampled_like(sdxl_coarse, COARSE, trained_sdxl)  # against sdxl_coarse's baseline, not sampled again
    assert broken.psnr < coarse.psnr - 3 and broken.ssim < coarse.ssim - 0.02, (broken, coarse)
