"""The quality yardstick discriminates: a broken merge and an untrained model score clearly worse.

Runs on the shipped weights (tomesd/quality/weights), small sample counts, few steps."""
import json
import math

import pytest
import torch

from tome_core.matching import TokenMerge
from tomesd.quality import model as M
from tomesd.quality import yardstick as Y

EXACT = Y.Setting("ToMe r=0.5", dict(ratio=0.5))
SMALL = dict(images=40, chunk=20, steps=8, noise_seeds=2)


@pytest.fixture(scope="module")
def trained():
    return M.load()


def scores(report, name):
    return next(r for r in report["results"] if r.name == name)


def test_trained_baseline_draws_the_digits_it_is_asked_for(trained):
    report = Y.evaluate([Y.DEFAULT_SETTINGS[0], EXACT], models=trained, **SMALL)
    base = scores(report, "baseline")
    assert base.accuracy >= 0.8, base  # an untrained model scores near chance (below)
    exact = scores(report, EXACT.name)
    # ToMe moved the samples (a patch that did nothing scores an infinite PSNR) ...
    assert math.isfinite(exact.psnr) and exact.psnr < 60, exact
    # ... and they stay far closer to the baseline's than unrelated samples are (measured: 40.6 vs 13.8 dB).
    assert exact.psnr > report["noise_band"]["unrelated"]["psnr"] + 20, (exact, report["noise_band"])
    # The sampling is deterministic: ToMe at this level measured 40.6 dB; with its unmerge broken at this
    # level alone, 38.1 dB. A bound between them catches such a break in the library itself.
    assert exact.psnr > 39.3, exact


# The digits UNet leans little on its 32x32 attention (see the README): a merge broken there alone
# moves samples by a few dB (measured: 40.6 -> 38.1); across every attention level by far more (31.2 -> 19.2).
ALL_LEVELS = Y.Setting("ToMe r=0.5 max_downsample=4", dict(ratio=0.5, max_downsample=4))


def broken_unmerge(monkeypatch):
    """A merge whose unmerge hands every token some other token's output."""
    unmerge = TokenMerge.unmerge
    perms = {}

    def shuffled(self, x):
        out = unmerge(self, x)
        n = out.shape[1]
        perm = perms.setdefault(n, torch.randperm(n, generator=torch.Generator().manual_seed(n)))
        return out[:, perm]

    monkeypatch.setattr(TokenMerge, "unmerge", shuffled)


@pytest.mark.parametrize("setting,psnr_drop,ssim_drop,fd_factor", [(EXACT, 1.5, 0.005, None), (ALL_LEVELS, 6, 0.1, 1.5)],
                         ids=["default-level", "every-level"])
def test_a_broken_merge_scores_clearly_worse_than_exact_tome(trained, monkeypatch, setting, psnr_drop, ssim_drop,
                                                            fd_factor):
    exact = scores(Y.evaluate([Y.DEFAULT_SETTINGS[0], setting], models=trained, **SMALL), setting.name)
    broken_unmerge(monkeypatch)
    broken = scores(Y.evaluate([Y.DEFAULT_SETTINGS[0], setting], models=trained, **SMALL), setting.name)
    assert broken.psnr < exact.psnr - psnr_drop, (broken, exact)  # farther from the baseline's samples
    assert broken.ssim < exact.ssim - ssim_drop, (broken, exact)
    if fd_factor is not None:
        assert broken.fd > fd_factor * exact.fd, (broken, exact)  # and from the real digits
    # Accuracy is not asserted: both score 1.0 on 40 samples, so it cannot rank these (see the README).


def test_an_untrained_model_scores_near_chance(trained):
    torch.manual_seed(0)  # before building: the initial weights come from the global generator
    untrained = M.build()
    for module in untrained:
        module.eval()
    models = (untrained[0], untrained[1], trained[2])  # the trained classifier judges it
    base = scores(Y.evaluate([Y.DEFAULT_SETTINGS[0]], models=models, **SMALL), "baseline")
    good = scores(Y.evaluate([Y.DEFAULT_SETTINGS[0]], models=trained, **SMALL), "baseline")
    assert good.accuracy >= 0.8 and base.accuracy <= 0.3, (base, good)
    assert base.fd > 3 * good.fd, (base, good)


def test_quality_command_writes_table_json_and_plot(tmp_path, capsys):
    from tomesd.cli import main

    out_json, out_png = tmp_path / "q.json", tmp_path / "q.png"
    with pytest.raises(SystemExit) as done:
        main(["quality", "--images", "10", "--chunk", "10", "--steps", "2", "--noise-seeds", "2",
              "--only", "ToMe r=0.5,downsample f=2 nearest", "--json", str(out_json), "--plot", str(out_png)])
    assert done.value.code == 0
    printed = capsys.readouterr().out
    assert "| downsample f=2 nearest |" in printed and "noise band" in printed
    doc = json.loads(out_json.read_text())
    assert doc["schema"] == Y.SCHEMA and [r["name"] for r in doc["results"]] == [
        "baseline", "ToMe r=0.5", "downsample f=2 nearest"]
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv,message", [(["--only", "nope"], "unknown settings"),
                                           (["--noise-seeds", "1"], "at least 2"),
                                           (["--weights", "/no/such.safetensors"], "python -m tomesd.quality.train")])
def test_quality_command_refuses_bad_input(argv, message, capsys):
    from tomesd.cli import main

    with pytest.raises(SystemExit) as done:
        main(["quality"] + argv)
    assert done.value.code == 2 and message in capsys.readouterr().err


# ---- the SD3-shaped yardstick: joint attention over a 32x32 patch grid and the label's tokens ----
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
    broken = scores(Y.evaluate([SD3_BASE, EXACT], models=trained_sd3, arch="sd3", **SMALL), EXACT.name)
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
    # Merge mode refuses TaylorSeer (it keeps attention outputs across steps): no stacked merge row.
    assert list(rows) == ["baseline", "ToMe r=0.5", "downsample f=2 avg", "taylorseer alone",
                          "downsample f=2 avg + taylorseer"]
    # The cache acts alone (it moves the samples), and stacked with downsampling both act.
    assert math.isfinite(rows["taylorseer alone"]["psnr"])
    stacked = rows["downsample f=2 avg + taylorseer"]["psnr"]
    assert stacked not in (rows["downsample f=2 avg"]["psnr"], rows["taylorseer alone"]["psnr"])


def test_quality_command_refuses_a_cache_diffusers_fails_on(capsys):
    from tomesd.cli import main

    with pytest.raises(SystemExit) as done:
        main(["quality", "--arch", "sd3", "--cache", "fbc"])
    assert done.value.code == 2 and "fails on SD3Transformer2DModel in diffusers itself" in capsys.readouterr().err
