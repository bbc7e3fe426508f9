"""The yardstick's measurement (evaluate): every setting sampled and scored against the baseline.

Every setting samples the same labels from the same noise as the baseline, in chunks that are
interleaved across settings (alternating order), so timings are side by side. Scores:
- PSNR / SSIM against the baseline's samples from the same noise: how far the setting moves them;
- the classifier's accuracy on the conditioned label, and the Frechet distance (FD) of the
  classifier's features to those of all 1797 real digits: whether the samples are still right;
- the noise band: the baseline again from other noise seeds. A setting whose accuracy and FD differ
  from the baseline's by no more than the baseline differs from itself across seeds is "within noise".
Clips (`video`, `wan`) are scored frame by frame (PSNR, SSIM, and PSNR at each frame index) and for temporal
consistency (their frame-to-frame changes against the baseline's); the classifier reads centred digits,
so accuracy and FD are left out there.
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from . import metrics
from . import model as M
from . import sampling
from .settings import Setting


@dataclass
class Result:
    name: str
    kwargs: Optional[Dict[str, Any]]
    time_s: float = 0.0
    speedup: float = 1.0
    psnr: Optional[float] = None
    ssim: Optional[float] = None
    accuracy: Optional[float] = None  # None for clips (the classifier reads centred digits)
    fd: Optional[float] = None
    within_noise: Optional[bool] = None  # accuracy and FD within the baseline's noise band (they separate little)
    chunk_times_s: List[float] = field(default_factory=list)
    # The verdict the tables rest on: the standard error of the mean per-image PSNR against the baseline, and
    # whether the setting stays closer to the baseline than unrelated samples by more than twice that.
    psnr_se: Optional[float] = None
    above_floor: Optional[bool] = None
    # Clips only: PSNR at each frame index, and the frame-to-frame changes' PSNR against the baseline's.
    psnr_by_frame: Optional[List[float]] = None
    temporal_psnr: Optional[float] = None
    temporal_psnr_se: Optional[float] = None  # over clips, as psnr_se
    identical: bool = False  # every sample equals the baseline's bit for bit (infinite PSNR, no error to quote)


def labels_for(n: int) -> Any:
    import torch

    return torch.arange(n) % M.NUM_CLASSES


def _sample_chunk(unet: Any, labels_embedding: Any, setting: Setting, labels: Any, noise: Any, steps: int,
                  arch: str = "sd1"):
    import tomesd

    from ..bench.kits.caches import enabled

    # A ratio schedule needs a pipeline's loop: the denoiser is patched through a pipeline that holds it.
    scheduled = setting.kwargs is not None and setting.kwargs.get("ratio_schedule") is not None
    target = sampling.pipeline(unet, arch) if scheduled else unet
    with enabled(unet, setting.cache, steps):  # a fresh cache for each chunk's sampling run
        if setting.kwargs is not None:
            tomesd.apply_patch(target, **setting.kwargs)
        try:
            start = time.perf_counter()
            images = sampling.sample(unet, labels_embedding, labels, noise, steps=steps, arch=arch,
                                     sched=target.scheduler if scheduled else None)
            return images, time.perf_counter() - start
        finally:
            if setting.kwargs is not None:
                tomesd.remove_patch(target)


def evaluate(
    settings: List[Setting],
    images: int = 64,
    chunk: int = 16,
    steps: int = sampling.STEPS,
    noise_seeds: int = 3,
    seed: int = 0,
    models: Any = None,
    progress: Any = None,
    arch: str = "sd1",
) -> Dict[str, Any]:
    """Sample `images` per setting (seed `seed`) plus the baseline from `noise_seeds - 1` more seeds."""
    import torch

    unet, labels_embedding, classifier = models if models is not None else M.load(arch=arch)
    clips = M.spec(arch).frames is not None
    real, _ = M.digits()
    real_features = None if clips else metrics.features(classifier, real)
    labels = labels_for(images)
    if settings[0].kwargs is not None or settings[0].cache is not None:
        raise ValueError("the first setting must be the baseline (kwargs None, no cache)")
    out: Dict[Setting, List[Any]] = {s: [] for s in settings}
    times: Dict[Setting, List[float]] = {s: [] for s in settings}
    noise = sampling.noise(images, seed, arch)
    starts = list(range(0, images, chunk))
    for i, start in enumerate(starts):  # interleaved, alternating order
        for setting in settings if i % 2 == 0 else settings[::-1]:
            part, seconds = _sample_chunk(unet, labels_embedding, setting, labels[start:start + chunk],
                                          noise[start:start + chunk], steps, arch)
            out[setting].append(part)
            times[setting].append(seconds)
            if progress is not None:
                progress(1)
    spread = []
    for k in range(1, noise_seeds):
        other = sampling.noise(images, seed + 1000 * k, arch)
        parts = []
        for start in starts:
            parts.append(_sample_chunk(unet, labels_embedding, settings[0], labels[start:start + chunk],
                                       other[start:start + chunk], steps, arch)[0])
            if progress is not None:
                progress(1)
        spread.append(torch.cat(parts))

    def scores(x: Any) -> Dict[str, Optional[float]]:
        if clips:
            return {"accuracy": None, "fd": None}
        return {"accuracy": metrics.accuracy(classifier, x, labels),
                "fd": metrics.frechet_distance(metrics.features(classifier, x), real_features)}

    base_images = torch.cat(out[settings[0]])
    base = scores(base_images)
    others = [scores(x) for x in spread]
    band = {
        "accuracy": None if clips else max([abs(o["accuracy"] - base["accuracy"]) for o in others], default=0.0),
        "fd": None if clips else max([abs(o["fd"] - base["fd"]) for o in others], default=0.0),
        # Two baselines from different noise: what "unrelated samples" look like to PSNR / SSIM.
        "unrelated": metrics.closeness(spread[0], base_images) if spread else None,
        "seeds": noise_seeds,
        "baseline_scores": [base] + others,
    }
    if clips and spread:
        band["unrelated"]["temporal_psnr"] = metrics.temporal_psnr(spread[0], base_images)
    results = []
    base_time = sum(times[settings[0]])
    for setting in settings:
        x = torch.cat(out[setting])
        r = Result(setting.name, copy.deepcopy(setting.kwargs), time_s=sum(times[setting]),
                   chunk_times_s=times[setting], **scores(x))
        r.speedup = base_time / r.time_s
        if setting is not settings[0]:
            r.psnr, r.ssim = metrics.closeness(x, base_images).values()
            r.psnr_se = metrics.standard_error(metrics.psnr_per_image(x, base_images))
            r.identical = bool(torch.equal(x, base_images))  # e.g. a cache that skipped nothing at its threshold
            if band["unrelated"] is not None:
                r.above_floor = r.identical or r.psnr - 2 * r.psnr_se > band["unrelated"]["psnr"]
            if clips:
                r.psnr_by_frame = metrics.psnr_by_frame(x, base_images)
                r.temporal_psnr = metrics.temporal_psnr(x, base_images)
                r.temporal_psnr_se = metrics.standard_error(metrics.temporal_psnr_per_clip(x, base_images))
            else:
                r.within_noise = (abs(r.accuracy - base["accuracy"]) <= band["accuracy"]
                                  and r.fd - base["fd"] <= band["fd"])
        results.append(r)
    return {"results": results, "noise_band": band, "images": images, "steps": steps, "chunk": chunk,
            "seed": seed, "arch": arch, "samples": {s.name: torch.cat(out[s]) for s in settings},
            "baselines_other_noise": spread, "classifier": classifier, "real_features": real_features}
