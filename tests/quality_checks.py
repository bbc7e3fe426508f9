"""What the quality yardstick's tests share: the exact setting, the small runs, a broken unmerge."""
import math

import torch

from tome_core.matching import TokenMerge
from tomesd.quality import yardstick as Y

EXACT = Y.Setting("ToMe r=0.5", dict(ratio=0.5))
SMALL = dict(images=40, chunk=20, steps=8, noise_seeds=2)
# Runs that only compare settings skip the baseline's second noise seed: it feeds the floor (the noise band),
# which PSNR and SSIM against the baseline and FD against real digits do not use.
NO_FLOOR = dict(SMALL, noise_seeds=1)


def scores(report, name):
    return next(r for r in report["results"] if r.name == name)


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
