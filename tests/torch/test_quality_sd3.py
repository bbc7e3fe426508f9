"""The SD3-shaped yardstick: joint attention over a 32x32 patch grid and the label's tokens."""
import json
import math

import pytest

from quality_checks import EXACT, SMALL, broken_unmerge, sampled_like, scores
from tomesd.quality import model as M
from tomesd.quality import yardstick as Y

SD3_BASE = Y.SD3_SETTINGS[0]
# Measured on the shipped weights with SMALL: the baseline reads as its labels 40/40; exact ToMe r=0.5 lies at
# 22.0 dB from it (SSIM 0.737), two unrelated baselines at 15.7 dB; with its unmerge broken, 11.3 dB.
SD3_MIN_ACCURACY = 0.8  # an untrained transformer scores near chance
SD3_EXACT_PSNR = 21.0


@pytest.fixture(scope="module")
def trained_sd3():
    return M.load(arch="sd3")


@pytest.fixture(scope="module")
def sd3_exact(trained_sd3):
    return Y.evaluate([SD3_BASE, EXACT], models=trained_sd3, arch="sd3", **SMALL)


def test_sd3_yardstick_draws_digits_and_prices_tome(sd3_exact):
    report = sd3_exact
    base, exact = scores(report, "baseline"), scores(report, EXACT.name)
    assert base.accuracy >= SD3_MIN_ACCURACY, base
    assert math.isfinite(exact.psnr) and exact.psnr < 60, exact  # ToMe moved the samples ...
    # ... less than unrelated samples differ, and by a measured amount (see SD3_EXACT_PSNR).
    assert exact.psnr > report["noise_band"]["unrelated"]["psnr"] + 4, (exact, report["noise_band"])
    assert exact.psnr > SD3_EXACT_PSNR, exact
    # the verdict's resolution: the standard error of the mean per-image PSNR, by hand
    samples = report["samples"]
    per_image = [10 * math.log10(4.0 / float(((a - b) ** 2).mean()))  # data range 2: images in [-1, 1]
                 for a, b in zip(samples[EXACT.name], samples["baseline"])]
    mean = sum(per_image) / len(per_image)
    se = (sum((p - mean) ** 2 for p in per_image) / (len(per_image) - 1)) ** 0.5 / len(per_image) ** 0.5
    assert abs(exact.psnr_se - se) < 1e-6 * max(1.0, se) + 1e-9 and exact.above_floor is True
    assert "resolution: at" in Y.table(report)


def test_sd3_yardstick_scores_a_broken_merge_clearly_worse(trained_sd3, sd3_exact, monkeypatch):
    exact = scores(sd3_exact, EXACT.name)
    broken_unmerge(monkeypatch)
    broken = sampled_like(sd3_exact, EXACT, trained_sd3)  # against sd3_exact's baseline, not sampled again
    assert broken.psnr < exact.psnr - 3 and broken.ssim < exact.ssim - 0.02, (broken, exact)


def test_quality_command_prices_a_step_cache_beside_tome_on_sd3(tmp_path, capsys):
    from tomesd.cli import main

    out_json = tmp_path / "q.json"
    with pytest.raises(SystemExit) as done:
        main(["quality", "--arch", "sd3", "--cache", "taylorseer", "--images", "10", "--chunk", "10", "--steps", "8",
              "--noise-seeds", "2", "--only", "ToMe r=0.5,downsample f=2 avg", "--json", str(out_json), "--plot", ""])
    assert done.value.code == 0
    doc = json.loads(out_json.read_text())
    assert doc["arch"] == "sd3"
    rows = {r["name"]: r for r in doc["results"]}
    # The cache alone, then stacked under each setting: merge mode too (the cache keeps full tokens).
    assert list(rows) == ["baseline", "ToMe r=0.5", "downsample f=2 avg", "taylorseer alone",
                          "ToMe r=0.5 + taylorseer", "downsample f=2 avg + taylorseer"]
    # The cache acts alone (it moves the samples), and stacked both act.
    assert math.isfinite(rows["taylorseer alone"]["psnr"])
    for name in ("ToMe r=0.5", "downsample f=2 avg"):
        stacked = rows[f"{name} + taylorseer"]["psnr"]
        assert stacked not in (rows[name]["psnr"], rows["taylorseer alone"]["psnr"])


def test_quality_command_refuses_a_cache_diffusers_fails_on(capsys):
    from tomesd.cli import main

    with pytest.raises(SystemExit) as done:
        main(["quality", "--arch", "sd3", "--cache", "fbc"])
    assert done.value.code == 2 and "fails on SD3Transformer2DModel in diffusers itself" in capsys.readouterr().err

