"""What the quality yardstick's tests share: the exact setting, the small runs, a broken unmerge."""
import math
from types import SimpleNamespace

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


def sampled_like(report, setting, models):
    """`setting`'s samples drawn as Y.evaluate drew them for `report` (its noise, labels, chunks and steps) and
    scored against the report's baseline: what a second evaluate([baseline, setting]) would score, without
    sampling the baseline again (its samples do not depend on the setting, nor on a monkeypatched merge)."""
    from tomesd.quality import evaluation, metrics, sampling

    unet, labels_embedding, classifier = models
    arch, images, chunk, steps = report["arch"], report["images"], report["chunk"], report["steps"]
    noise, labels = sampling.noise(images, report["seed"], arch), evaluation.labels_for(images)
    x = torch.cat([evaluation._sample_chunk(unet, labels_embedding, setting, labels[s:s + chunk], noise[s:s + chunk],
                                            steps, arch)[0] for s in range(0, images, chunk)])
    base = report["samples"]["baseline"]
    psnr, ssim = metrics.closeness(x, base).values()
    scored = SimpleNamespace(psnr=psnr, ssim=ssim, fd=None, temporal_psnr=None, samples=x)
    if report["real_features"] is not None:
        scored.fd = metrics.frechet_distance(metrics.features(classifier, x), report["real_features"])
    if x.dim() == 5:  # clips
        scored.temporal_psnr = metrics.temporal_psnr(x, base)
    return scored


def broken_unmerge(monkeypatch):
    """A merge whose unmerge hands every image token some other image token's output, at each of TokenMerge's
    unmerges (the image alone, the image last, the image first: the runtime calls these, the core inlines its own
    helpers)."""
    perms = {}

    def broken(name, image):
        unmerge = getattr(TokenMerge, name)

        def shuffled(self, x):
            out = unmerge(self, x)
            n, s = self.num_tokens, out.shape[1]
            perm = perms.setdefault(n, torch.randperm(n, generator=torch.Generator().manual_seed(n)))
            start = s - n if image == "last" else 0
            order = torch.cat([torch.arange(start), start + perm, torch.arange(start + n, s)])
            return out[:, order]

        monkeypatch.setattr(TokenMerge, name, shuffled)

    broken("unmerge", "first")
    broken("unmerge_tail", "last")
    broken("unmerge_head", "first")


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
