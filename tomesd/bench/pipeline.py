"""`--model PATH`: a local pipeline with and without ToMe, same prompt and seed, as an image grid."""
from __future__ import annotations

import json
import os
import time
from typing import Any, Dict, List


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


def run(path: str, backend: str, ratios: List[float], prompt: str, steps: int, res: int, seed: int, grid_path: str) -> Dict[str, Any]:
    library = pipeline_library(path)
    if (library == "ppdiffusers") != (backend == "paddle"):
        raise BadModelPath(f"--model {path!r} is a {library} pipeline: use --backend {'paddle' if library == 'ppdiffusers' else 'torch'}")
    import tomesd

    if backend == "torch":
        import torch
        from diffusers import DiffusionPipeline

        pipe = DiffusionPipeline.from_pretrained(path)
        make_generator = lambda: torch.Generator().manual_seed(seed)  # noqa: E731
    else:
        import paddle
        from ppdiffusers import DiffusionPipeline

        pipe = DiffusionPipeline.from_pretrained(path)
        make_generator = lambda: paddle.Generator().manual_seed(seed)  # noqa: E731
    pipe.set_progress_bar_config(disable=True)

    def generate():
        start = time.perf_counter()
        image = pipe(prompt, num_inference_steps=steps, height=res, width=res, generator=make_generator()).images[0]
        return image, time.perf_counter() - start

    runs = [("baseline", None, *generate())]
    for ratio in ratios:
        tomesd.apply_patch(pipe, ratio=ratio, seed=seed)
        try:
            runs.append((f"ToMe r={ratio:g}", ratio, *generate()))
        finally:
            tomesd.remove_patch(pipe)
    _save_grid([(name, image) for name, _, image, _ in runs], grid_path)
    base = runs[0][3]
    return {
        "model": os.path.abspath(path), "library": library, "prompt": prompt, "steps": steps, "res": res, "seed": seed,
        "grid": os.path.abspath(grid_path),
        "runs": [{"name": name, "ratio": ratio, "time_s": t, "speedup": base / t} for name, ratio, _, t in runs],
    }


def _save_grid(named_images: List[tuple], path: str) -> None:
    from PIL import Image, ImageDraw

    w, h = named_images[0][1].size
    grid = Image.new("RGB", (w * len(named_images), h + 20), "white")
    draw = ImageDraw.Draw(grid)
    for i, (name, image) in enumerate(named_images):
        grid.paste(image.convert("RGB"), (i * w, 20))
        draw.text((i * w + 4, 4), name, fill="black")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    grid.save(path)
