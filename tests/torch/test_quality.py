"""The quality yardstick discriminates: a broken merge and an untrained model score clearly worse.

Runs on the shipped weights (tomesd/quality/weights), small sample counts, few steps."""
import json
import math

import pytest
import torch

from quality_checks import EXACT, NO_FLOOR, SMALL, broken_unmerge, sampled_like, scores
from tomesd.quality import model as M
from tomesd.quality import yardstick as Y


@pytest.fixture(scope="module")
def trained():
    return M.load()


@pytest.fixture(scope="module")
def sd1_exact(trained):
    return Y.evaluate([Y.DEFAULT_SETTINGS[0], EXACT], models=trained, **SMALL)


def test_trained_baseline_draws_the_digits_it_is_asked_for(sd1_exact):
    report = sd1_exact
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


@pytest.mark.parametrize("setting,psnr_drop,ssim_drop,fd_factor", [(EXACT, 1.5, 0.005, None), (ALL_LEVELS, 6, 0.1, 1.5)],
                         ids=["default-level", "every-level"])
def test_a_broken_merge_scores_clearly_worse_than_exact_tome(trained, sd1_exact, monkeypatch, setting, psnr_drop,
                                                            ssim_drop, fd_factor):
    # Both against sd1_exact's baseline, drawn from the same noise and labels: it is not sampled again.
    exact = scores(sd1_exact, setting.name) if setting is EXACT else sampled_like(sd1_exact, setting, trained)
    broken_unmerge(monkeypatch)
    broken = sampled_like(sd1_exact, setting, trained)
    assert broken.psnr < exact.psnr - psnr_drop, (broken, exact)  # farther from the baseline's samples
    assert broken.ssim < exact.ssim - ssim_drop, (broken, exact)
    if fd_factor is not None:
        assert broken.fd > fd_factor * exact.fd, (broken, exact)  # and from the real digits
    # Accuracy is not asserted: both score 1.0 on 40 samples, so it cannot rank these (see the README).


def test_an_untrained_model_scores_near_chance(trained, sd1_exact):
    torch.manual_seed(0)  # before building: the initial weights come from the global generator
    untrained = M.build()
    for module in untrained:
        module.eval()
    models = (untrained[0], untrained[1], trained[2])  # the trained classifier judges it
    base = scores(Y.evaluate([Y.DEFAULT_SETTINGS[0]], models=models, **dict(NO_FLOOR, images=20)), "baseline")
    good = scores(sd1_exact, "baseline")
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


# ---- FD against the sample count: where FD starts to separate settings ----
def test_fd_curve_is_fd_over_prefixes_against_the_baselines_spread_by_hand(trained):
    from tomesd.quality import fd_curve, metrics

    far = Y.Setting("ToMe r=0.75 max_downsample=4", dict(ratio=0.75, max_downsample=4))
    report = Y.evaluate([Y.DEFAULT_SETTINGS[0], far], models=trained, images=20, chunk=20, steps=4, noise_seeds=3)
    baselines = [report["samples"]["baseline"]] + report["baselines_other_noise"]
    assert len(baselines) == 3
    rows = fd_curve.curve({far.name: report["samples"][far.name]}, baselines, trained[2], report["real_features"],
                          [10, 20])
    real = report["real_features"]
    for row in rows:
        n = row["n"]
        fd = [metrics.frechet_distance(metrics.features(trained[2], b[:n]), real) for b in baselines]
        assert row["baseline_fd"] == pytest.approx(fd[0])
        assert row["band"] == pytest.approx(max(abs(fd[1] - fd[0]), abs(fd[2] - fd[0])))
        setting = metrics.frechet_distance(metrics.features(trained[2], report["samples"][far.name][:n]), real)
        assert row["diffs"][far.name] == pytest.approx(setting - fd[0])
        assert row["resolved"][far.name] == (abs(setting - fd[0]) > row["band"])
    # FD is biased upwards at small counts: 10 samples sit farther from the real digits than 20
    assert rows[0]["baseline_fd"] > rows[1]["baseline_fd"]


def test_fd_curve_names_the_count_from_which_fd_resolves_a_setting():
    from tomesd.quality import fd_curve

    def rows(flags):
        return [{"n": n, "baseline_fd": 1.0, "band": 0.5, "diffs": {"s": 1.0 if ok else 0.1}, "resolved": {"s": ok}}
                for n, ok in zip((64, 128, 256, 512), flags)]

    assert fd_curve.resolved_from(rows([False, False, True, True]), "s") == 256
    assert fd_curve.resolved_from(rows([True, False, True, True]), "s") == 256  # resolved at every larger count
    assert fd_curve.resolved_from(rows([True, True, True, False]), "s") is None
    assert "from 256 samples on" in fd_curve.table(rows([False, False, True, True]))
    assert "does not resolve it" in fd_curve.table(rows([False, False, False, False]))


def test_quality_command_prints_and_writes_the_fd_curve(tmp_path, capsys):
    from tomesd.cli import main

    out_json = tmp_path / "q.json"
    with pytest.raises(SystemExit) as done:
        main(["quality", "--fd-curve", "10,20", "--chunk", "10", "--steps", "2", "--noise-seeds", "2",
              "--only", "ToMe r=0.5", "--json", str(out_json), "--plot", ""])
    assert done.value.code == 0
    assert "FD against the sample count" in capsys.readouterr().out
    doc = json.loads(out_json.read_text())
    assert doc["images"] == 20 and [row["n"] for row in doc["fd_curve"]] == [10, 20]
    assert list(doc["fd_curve"][0]["diffs"]) == ["ToMe r=0.5"]


@pytest.mark.parametrize("argv,message", [(["--fd-curve", "1,64"], "at least 2"), (["--fd-curve", "a"], "sample counts"),
                                           (["--arch", "video", "--fd-curve", "64"], "no FD")])
def test_fd_curve_refuses_bad_input(argv, message, capsys):
    from tomesd.cli import main

    with pytest.raises(SystemExit) as done:
        main(["quality"] + argv)
    assert done.value.code == 2 and message in capsys.readouterr().err


# ---- ratio schedules priced: the yardstick patches them through a pipeline whose scheduler counts steps ----
def test_yardstick_prices_a_ratio_schedule(trained):
    constant = Y.Setting("constant 0.5", dict(ratio_schedule=[(0.0, 0.5)]))
    rising = Y.Setting("0.25 then 0.75", dict(ratio_schedule=[(0.0, 0.25), (0.5, 0.75)]))
    low, high = Y.Setting("r=0.25", dict(ratio=0.25)), Y.Setting("r=0.75", dict(ratio=0.75))
    settings = [Y.DEFAULT_SETTINGS[0], EXACT, constant, rising, low, high]
    report = Y.evaluate(settings, models=trained, images=10, chunk=10, steps=4, noise_seeds=2)
    samples = report["samples"]
    assert torch.equal(samples[constant.name], samples[EXACT.name])  # a constant schedule is exact ToMe
    # two ratios over the run: samples of their own, neither ratio's throughout
    assert not torch.equal(samples[rising.name], samples[low.name])
    assert not torch.equal(samples[rising.name], samples[high.name])
    assert math.isfinite(scores(report, rising.name).psnr)
    assert [s.name for s in Y.DEFAULT_SETTINGS if "schedule" in s.name]  # and `quality` prices two by default
