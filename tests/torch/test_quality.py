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


# Runs that only compare settings skip the baseline's second noise seed: it feeds the floor (the noise band),
# which PSNR and SSIM against the baseline and FD against real digits do not use.
NO_FLOOR = dict(SMALL, noise_seeds=1)


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
def test_a_broken_merge_scores_clearly_worse_than_exact_tome(trained, sd1_exact, monkeypatch, setting, psnr_drop,
                                                            ssim_drop, fd_factor):
    exact = (scores(sd1_exact, setting.name) if setting is EXACT
             else scores(Y.evaluate([Y.DEFAULT_SETTINGS[0], setting], models=trained, **NO_FLOOR), setting.name))
    broken_unmerge(monkeypatch)
    broken = scores(Y.evaluate([Y.DEFAULT_SETTINGS[0], setting], models=trained, **NO_FLOOR), setting.name)
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
    base = scores(Y.evaluate([Y.DEFAULT_SETTINGS[0]], models=models, **NO_FLOOR), "baseline")
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
    broken = scores(Y.evaluate([SD3_BASE, EXACT], models=trained_sd3, arch="sd3", **NO_FLOOR), EXACT.name)
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


# ---- the video yardstick: AnimateDiff's motion UNet on digits sliding over 8 frames ----
VIDEO_BASE = Y.VIDEO_SETTINGS[0]
VIDEO_SMALL = dict(images=8, chunk=8, steps=8, noise_seeds=2)
VIDEO_NO_FLOOR = dict(VIDEO_SMALL, noise_seeds=1)


@pytest.fixture(scope="module")
def trained_video():
    return M.load(arch="video")


@pytest.fixture(scope="module")
def video_exact(trained_video):
    return Y.evaluate([VIDEO_BASE, EXACT], models=trained_video, arch="video", **VIDEO_SMALL)


def frame_psnr(a, b):
    return 10 * math.log10(4.0 / float(((a - b) ** 2).mean()))  # data range 2: pixels in [-1, 1]


def coherence(report):
    """How much closer each frame of a clip is to the clip's next frame than to the next frame of a clip of the
    same label drawn from other noise (dB): what the clip keeps over time beyond what its label gives."""
    clips, others = report["samples"]["baseline"], report["baselines_other_noise"][0]
    steps = range(clips.shape[2] - 1)
    same = [frame_psnr(c[:, f], c[:, f + 1]) for c in clips for f in steps]
    other = [frame_psnr(c[:, f], d[:, f + 1]) for c, d in zip(clips, others) for f in steps]
    return sum(same) / len(same) - sum(other) / len(other)


def test_video_yardstick_draws_clips_that_hold_together_over_time(trained_video, video_exact):
    """The trained motion model keeps a clip's frames alike (its digit moves, it does not jump); the image
    UNet run frame by frame (the motion modules' outputs zeroed: each frame drawn from its own noise) does not."""
    trained = coherence(video_exact)
    per_frame = M.build("video")[0]
    per_frame.load_state_dict(M.load(arch="sd1")[0].state_dict(), strict=False)
    with torch.no_grad():
        for name, p in per_frame.named_parameters():
            if "motion_modules" in name and "proj_out" in name:
                p.zero_()
    per_frame.eval()
    alone = Y.evaluate([VIDEO_BASE], models=(per_frame, trained_video[1], trained_video[2]), arch="video",
                       **VIDEO_SMALL)
    alone = coherence(alone)
    assert trained > 3 and alone < trained - 2, (trained, alone)


def test_video_yardstick_prices_tome_per_frame_and_over_time(video_exact):
    report = video_exact
    exact = scores(report, EXACT.name)
    unrelated = report["noise_band"]["unrelated"]
    assert math.isfinite(exact.psnr) and exact.psnr < 60, exact  # ToMe moved the clips ...
    assert exact.psnr > unrelated["psnr"] + 10 and exact.above_floor is True, (exact, unrelated)  # ... less than unrelated
    assert exact.accuracy is None and exact.fd is None  # the classifier reads centred digits, not clips
    # by hand: PSNR at each frame index, and the PSNR of frame-to-frame changes against the baseline's
    x, base = report["samples"][EXACT.name], report["samples"]["baseline"]
    assert exact.psnr_by_frame == pytest.approx([frame_psnr(x[:, :, f], base[:, :, f]) for f in range(M.FRAMES)],
                                                abs=1e-4)
    assert exact.temporal_psnr == pytest.approx(frame_psnr(x.diff(dim=2), base.diff(dim=2)), abs=1e-4)
    per_clip = torch.tensor([frame_psnr(c.diff(dim=1), b.diff(dim=1)) for c, b in zip(x, base)])
    assert exact.temporal_psnr_se == pytest.approx(float(per_clip.std() / len(per_clip) ** 0.5), rel=1e-3)
    assert exact.temporal_psnr > unrelated["temporal_psnr"] + 10
    table = Y.table(report)
    assert "temporal PSNR vs baseline" in table and "clips" in table


def test_video_yardstick_scores_a_broken_merge_clearly_worse(trained_video, video_exact, monkeypatch):
    exact = scores(video_exact, EXACT.name)
    broken_unmerge(monkeypatch)
    broken = scores(Y.evaluate([VIDEO_BASE, EXACT], models=trained_video, arch="video",
                               **VIDEO_NO_FLOOR), EXACT.name)
    assert broken.psnr < exact.psnr - 1.5 and broken.temporal_psnr < exact.temporal_psnr - 1.5, (broken, exact)


def test_moving_digits_slide_in_straight_lines_and_bounce():
    x, y = M.digits()
    clips, labels = M.moving_digits(x, y, 16, torch.Generator().manual_seed(3))
    assert clips.shape == (16, 1, M.FRAMES, M.IMAGE, M.IMAGE) and labels.shape == (16,)
    assert clips.min() >= -1 and clips.max() <= 1
    moved = 0
    for clip in clips[:, 0]:
        lit = [(f > -1).nonzero() for f in clip]  # the digit's pixels in each frame
        corner = torch.stack([p.min(0).values for p in lit])
        # the same digit in every frame, shifted whole
        assert all(torch.equal(p - c, lit[0] - corner[0]) for p, c in zip(lit, corner))
        step = corner.diff(dim=0)
        assert (step.abs() <= 1).all()  # at most a pixel a frame along each axis ...
        # ... at one speed per axis but for one frame at a bounce, where the direction turns (at most once:
        # 7 frames at a pixel cross less than the canvas' 8 pixels of room around a 24-pixel digit)
        for axis in range(2):
            speeds, signs = step[:, axis].abs(), step[:, axis].sign()
            assert (speeds != speeds.max()).sum() <= 1, step[:, axis]
            turns = (signs[signs != 0].diff() != 0).sum()
            assert turns <= 1, step[:, axis]
        moved += bool(step.abs().sum())
    assert moved >= 12  # most clips move


# ---- the space-time yardstick: Wan's transformer on the same clips, one grid of frames x rows x columns ----
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


# ---- FD against the sample count: where FD starts to separate settings ----
def test_fd_curve_is_fd_over_prefixes_against_the_baselines_spread_by_hand(trained):
    from tomesd.quality import fd_curve, metrics

    far = Y.Setting("ToMe r=0.75 max_downsample=4", dict(ratio=0.75, max_downsample=4))
    report = Y.evaluate([Y.DEFAULT_SETTINGS[0], far], models=trained, images=30, chunk=30, steps=4, noise_seeds=3)
    baselines = [report["samples"]["baseline"]] + report["baselines_other_noise"]
    assert len(baselines) == 3
    rows = fd_curve.curve({far.name: report["samples"][far.name]}, baselines, trained[2], report["real_features"],
                          [10, 30])
    real = report["real_features"]
    for row in rows:
        n = row["n"]
        fd = [metrics.frechet_distance(metrics.features(trained[2], b[:n]), real) for b in baselines]
        assert row["baseline_fd"] == pytest.approx(fd[0])
        assert row["band"] == pytest.approx(max(abs(fd[1] - fd[0]), abs(fd[2] - fd[0])))
        setting = metrics.frechet_distance(metrics.features(trained[2], report["samples"][far.name][:n]), real)
        assert row["diffs"][far.name] == pytest.approx(setting - fd[0])
        assert row["resolved"][far.name] == (abs(setting - fd[0]) > row["band"])
    # FD is biased upwards at small counts: 10 samples sit farther from the real digits than 30
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
    report = Y.evaluate(settings, models=trained, images=20, chunk=20, steps=4, noise_seeds=2)
    samples = report["samples"]
    assert torch.equal(samples[constant.name], samples[EXACT.name])  # a constant schedule is exact ToMe
    # two ratios over the run: samples of their own, neither ratio's throughout
    assert not torch.equal(samples[rising.name], samples[low.name])
    assert not torch.equal(samples[rising.name], samples[high.name])
    assert math.isfinite(scores(report, rising.name).psnr)
    assert [s.name for s in Y.DEFAULT_SETTINGS if "schedule" in s.name]  # and `quality` prices two by default
