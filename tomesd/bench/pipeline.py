"""`--model PATH`: a local pipeline under every setting of the bench, over a few prompts and seeds, each
from the baseline's noise: time per image, closeness to the baseline's images, an image grid."""
from __future__ import annotations

import json
import os
import time
from typing import Any, Dict, List, Optional

import numpy as np


class BadModelPath(ValueError):
    pass


def pipeline_library(path: str) -> str:
    """'diffusers' or 'ppdiffusers', read from the pipeline's model_index.json."""
    index = os.path.join(path, "model_index.json")
    if not os.path.isfile(index):
        raise BadModelPath(f"--model {path!r}: no model_index.json there; expected a saved (pp)diffusers pipeline folder")
    with open(index) as f:
        meta = json.load(f)
    return "ppdiffusers" if "_ppdiffusers_version" in meta else "diffusers"


WARMUP_STEPS = 2  # the untimed generation before each timed one: every shape and kernel, few steps
FLOOR_SEED_OFFSET = 10_000  # the unrelated baseline: the same prompt from other noise

# --model's prompts when no --prompts file is given: a person, an animal, a scene.
DEFAULT_PROMPTS = (
    "a photograph of an astronaut riding a horse",
    "a close-up portrait of a red fox in the snow, golden hour",
    "a watercolor painting of a harbor town with sailing boats",
)


def read_prompts(path: Optional[str]) -> List[str]:
    """One prompt per non-empty line of `path`; the built-in list when None."""
    if path is None:
        return list(DEFAULT_PROMPTS)
    try:
        with open(path) as f:
            prompts = [line.strip() for line in f if line.strip()]
    except OSError as exc:
        raise ValueError(f"--prompts {path!r}: {exc.strerror}") from None
    if not prompts:
        raise ValueError(f"--prompts {path!r}: no prompt in it (one per line)")
    return prompts


def load(path: str, kit: Any) -> Any:
    """The pipeline at `path`, in the kit's dtype and on its device."""
    if kit.name == "torch":
        from diffusers import DiffusionPipeline

        return DiffusionPipeline.from_pretrained(path, torch_dtype=kit.dtype).to(kit.device)
    from ppdiffusers import DiffusionPipeline

    # paddle places tensors on the device the kit set (paddle.set_device)
    return DiffusionPipeline.from_pretrained(path, paddle_dtype=getattr(kit.paddle, kit.dtype))


def as_array(images: List[Any]) -> np.ndarray:
    """PIL images as one [N, H, W, 3] float array in [0, 1]."""
    return np.stack([np.asarray(image.convert("RGB"), dtype=np.float64) / 255.0 for image in images])


def closeness(images: np.ndarray, reference: np.ndarray) -> Dict[str, float]:
    """PSNR (dB) and SSIM of images [N, H, W, 3] in [0, 1] against the reference images, each the mean
    over the N pairs (torchmetrics: 11-pixel Gaussian window SSIM, PSNR over the whole image)."""
    import torch
    from torchmetrics.functional.image import peak_signal_noise_ratio, structural_similarity_index_measure

    a = torch.from_numpy(np.ascontiguousarray(images.transpose(0, 3, 1, 2))).double()
    b = torch.from_numpy(np.ascontiguousarray(reference.transpose(0, 3, 1, 2))).double()
    psnr = [float(peak_signal_noise_ratio(a[i:i + 1], b[i:i + 1], data_range=1.0)) for i in range(len(a))]
    ssim = [float(structural_similarity_index_measure(a[i:i + 1], b[i:i + 1], data_range=1.0)) for i in range(len(a))]
    return {"psnr": float(np.mean(psnr)), "ssim": float(np.mean(ssim))}


def run(path: str, kit: Any, configs: List[Any], settings: Any, prompts: List[str], seeds: int, steps: int, res: int,
        grid_path: str) -> Dict[str, Any]:
    """Each configuration (the baseline first, then every setting of the bench's) generates every prompt
    from each of `seeds` seeds, after one untimed warm-up generation (WARMUP_STEPS steps); the same seed
    gives every configuration the same starting noise. Reports the time per image and the closeness of
    each setting's images to the baseline's, and, as the floor, of the baseline to itself from other noise."""
    library = pipeline_library(path)
    if (library == "ppdiffusers") != (kit.name == "paddle"):
        raise BadModelPath(f"--model {path!r} is a {library} pipeline: use --backend {'paddle' if library == 'ppdiffusers' else 'torch'}")
    import tomesd

    from .measures.report import label

    if kit.name == "torch":
        make_generator = lambda seed: kit.torch.Generator().manual_seed(seed)  # noqa: E731
    else:
        make_generator = lambda seed: kit.paddle.Generator().manual_seed(seed)  # noqa: E731
    pipe = load(path, kit)
    pipe.set_progress_bar_config(disable=True)
    jobs = [(prompt, settings.seed + i) for prompt in prompts for i in range(seeds)]

    def generate(prompt: str, seed: int, n_steps: int) -> Any:
        return pipe(prompt, num_inference_steps=n_steps, height=res, width=res, generator=make_generator(seed)).images[0]

    def timed_images() -> tuple:
        generate(*jobs[0], min(WARMUP_STEPS, steps))
        kit.sync()
        start = time.perf_counter()
        images = [generate(prompt, seed, steps) for prompt, seed in jobs]
        kit.sync()
        return images, (time.perf_counter() - start) / len(jobs)

    runs = []
    for cfg in configs:
        kwargs = {} if cfg.method == "baseline" else cfg.patch_kwargs(settings)
        if kwargs:
            tomesd.apply_patch(pipe, **kwargs)
        try:
            images, per_image = timed_images()
        finally:
            if kwargs:
                tomesd.remove_patch(pipe)
        runs.append({"name": label(cfg, ""), "kwargs": kwargs, "time_s": per_image, "images": images})
    floor_images = [generate(prompt, seed + FLOOR_SEED_OFFSET, steps) for prompt, seed in jobs]
    base = as_array(runs[0]["images"])
    floor = closeness(as_array(floor_images), base)
    for entry in runs:
        entry.update(closeness(as_array(entry["images"]), base) if entry is not runs[0] else {"psnr": None, "ssim": None})
        entry["speedup"] = runs[0]["time_s"] / entry["time_s"]
    _save_grid([(entry["name"], entry.pop("images")) for entry in runs] + [("other noise", floor_images)], grid_path)
    return {
        "model": os.path.abspath(path), "library": library, "prompts": prompts, "seeds": [s for _, s in jobs[:seeds]],
        "steps": steps, "res": res, "device": str(kit.device) if kit.name == "torch" else ("gpu" if kit.on_gpu() else "cpu"),
        "dtype": kit.dtype_name, "warmup_steps": min(WARMUP_STEPS, steps), "grid": os.path.abspath(grid_path),
        "metrics": "PSNR and SSIM (torchmetrics) of each image against the baseline's from the same noise, averaged; "
                   "no perceptual distance (the libraries that compute one, such as LPIPS, download weights)",
        "floor": floor, "runs": runs,
    }


def closeness_table(result: Dict[str, Any]) -> str:
    lines = ["| setting | time per image (s) | speed-up | PSNR vs baseline (dB) | SSIM vs baseline |", "|---|---|---|---|---|"]
    for entry in result["runs"]:
        psnr = "-" if entry["psnr"] is None else f"{entry['psnr']:.1f}"
        ssim = "-" if entry["ssim"] is None else f"{entry['ssim']:.3f}"
        lines.append(f"| {entry['name']} | {entry['time_s']:.2f} | {entry['speedup']:.2f}x | {psnr} | {ssim} |")
    floor = result["floor"]
    lines.append(f"| baseline from other noise (the floor) | - | - | {floor['psnr']:.1f} | {floor['ssim']:.3f} |")
    return "\n".join(lines)


def write_closeness_plot(result: Dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for entry in result["runs"][1:]:
        ax.scatter(entry["speedup"], entry["psnr"])
        ax.annotate(entry["name"], (entry["speedup"], entry["psnr"]), fontsize=7)
    ax.axhline(result["floor"]["psnr"], color="gray", linestyle="--", label="baseline from other noise")
    ax.set_xlabel("speed-up (time per image)")
    ax.set_ylabel("PSNR vs baseline (dB)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _save_grid(columns: List[tuple], path: str) -> None:
    """One column per configuration (its name on top), one row per generated image."""
    from PIL import Image, ImageDraw

    w, h = columns[0][1][0].size
    rows = len(columns[0][1])
    grid = Image.new("RGB", (w * len(columns), h * rows + 20), "white")
    draw = ImageDraw.Draw(grid)
    for i, (name, images) in enumerate(columns):
        for j, image in enumerate(images):
            grid.paste(image.convert("RGB"), (i * w, 20 + j * h))
        draw.text((i * w + 4, 4), name, fill="black")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    grid.save(path)
