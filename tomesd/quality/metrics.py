"""The yardstick's scores: closeness to the unpatched model's samples (PSNR, SSIM from torchmetrics),
the classifier's accuracy on the conditioned label, and the Frechet distance to the real digits in
the classifier's 64-d feature space."""
from __future__ import annotations

from typing import Any, Dict, List

import numpy as np


def frames(x: Any) -> Any:
    """Clips [N, C, F, H, W] as their frames [N * F, C, H, W]; images pass through."""
    return x if x.dim() == 4 else x.transpose(1, 2).reshape((-1,) + x.shape[1:2] + x.shape[3:])


def closeness(images: Any, reference: Any) -> Dict[str, float]:
    """PSNR (dB) and SSIM of `images` against `reference` (same noise and labels), both in [-1, 1]; clips
    frame by frame (SSIM's window is spatial)."""
    from torchmetrics.functional.image import peak_signal_noise_ratio, structural_similarity_index_measure

    images, reference = frames(images), frames(reference)
    return {
        "psnr": float(peak_signal_noise_ratio(images, reference, data_range=2.0)),
        "ssim": float(structural_similarity_index_measure(images, reference, data_range=2.0)),
    }


def psnr_per_image(images: Any, reference: Any) -> Any:
    """PSNR (dB) of each image (each whole clip) against its reference, both in [-1, 1]: [N]."""
    from torchmetrics.functional.image import peak_signal_noise_ratio

    return peak_signal_noise_ratio(images, reference, data_range=2.0, reduction="none",
                                   dim=tuple(range(1, images.dim())))


def psnr_by_frame(clips: Any, reference: Any) -> List[float]:
    """PSNR (dB) at each frame index over all clips [N, C, F, H, W]: where in the clip a setting drifts."""
    from torchmetrics.functional.image import peak_signal_noise_ratio

    return [float(peak_signal_noise_ratio(clips[:, :, f], reference[:, :, f], data_range=2.0))
            for f in range(clips.shape[2])]


def temporal_psnr(clips: Any, reference: Any) -> float:
    """Temporal consistency against the baseline: the PSNR (dB, on the pixels' range of 2) of the clips'
    frame-to-frame changes against the reference clips' changes. Errors independent from frame to frame
    score about 3 dB under the per-frame PSNR here (a difference of two adds their variances); errors that
    persist across frames (a digit drawn slightly differently throughout) score above it; flicker, below."""
    from torchmetrics.functional.image import peak_signal_noise_ratio

    change, ref_change = clips.diff(dim=2), reference.diff(dim=2)
    return float(peak_signal_noise_ratio(change, ref_change, data_range=2.0))


def temporal_psnr_per_clip(clips: Any, reference: Any) -> Any:
    """`temporal_psnr` of each clip alone: [N], whose standard error says which temporal differences between
    settings a run resolves."""
    return psnr_per_image(clips.diff(dim=2), reference.diff(dim=2))


def standard_error(values: Any) -> float:
    """The standard error of the mean of per-image values: what a difference of means must exceed (about
    twice over) to be resolved at this sample count."""
    return float(values.double().std(unbiased=True) / len(values) ** 0.5) if len(values) > 1 else float("nan")


def features(classifier: Any, images: Any) -> Any:
    import torch

    with torch.no_grad():
        return classifier.features(images).double().numpy()


def accuracy(classifier: Any, images: Any, labels: Any) -> float:
    import torch

    with torch.no_grad():
        return float((classifier(images).argmax(1) == labels).float().mean())


def frechet_distance(a: np.ndarray, b: np.ndarray) -> float:
    """Frechet distance between Gaussians fitted to two feature sets [N, D] (FID's formula)."""
    from scipy import linalg

    mu_a, mu_b = a.mean(0), b.mean(0)
    cov_a, cov_b = np.cov(a, rowvar=False), np.cov(b, rowvar=False)
    root, _ = linalg.sqrtm(cov_a @ cov_b, disp=False)
    if not np.isfinite(root).all():  # near-singular product: regularise as FID implementations do
        eps = 1e-6 * np.eye(a.shape[1])
        root = linalg.sqrtm((cov_a + eps) @ (cov_b + eps))
    return float(((mu_a - mu_b) ** 2).sum() + np.trace(cov_a + cov_b - 2 * np.real(root)))
