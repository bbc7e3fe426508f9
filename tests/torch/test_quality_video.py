"""The video yardstick: AnimateDiff's motion UNet on digits sliding over 8 frames."""
import math

import pytest
import torch

from quality_checks import EXACT, broken_unmerge, coherence, frame_psnr, sampled_like, scores
from tomesd.quality import model as M
from tomesd.quality import yardstick as Y

VIDEO_BASE = Y.VIDEO_SETTINGS[0]
# Four clips: measured on the shipped weights, the trained model's coherence is 4.4 dB against 0.4 for the image
# UNet run frame by frame; exact ToMe r=0.5 lies at 41.2 dB (temporal 44.1) from the baseline, with its unmerge
# broken at 38.8 (40.5), two unrelated baselines at 13.2 (13.7).
VIDEO_SMALL = dict(images=4, chunk=4, steps=8, noise_seeds=2)


@pytest.fixture(scope="module")
def trained_video():
    return M.load(arch="video")


@pytest.fixture(scope="module")
def video_exact(trained_video):
    return Y.evaluate([VIDEO_BASE, EXACT], models=trained_video, arch="video", **VIDEO_SMALL)


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
    broken = sampled_like(video_exact, EXACT, trained_video)  # against video_exact's baseline, not sampled again
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

