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


WARMUP_STEPS = 2  # the untimed generation before each timed one: every shape and kernel, few steps


def load(path: str, kit: Any) -> Any:
    """The pipeline at `path`, in the kit's dtype and on its device."""
    if kit.name == "torch":
        from diffusers import DiffusionPipeline

        return DiffusionPipeline.from_pretrained(path, torch_dtype=kit.dtype).to(kit.device)
    from ppdiffusers import DiffusionPipeline

    # paddle places tensors on the device the kit set (paddle.set_device)
    return DiffusionPipeline.from_pretrained(path, paddle_dtype=getattr(kit.paddle, kit.dtype))


def run(path: str, kit: Any, ratios: List[float], prompt: str, steps: int, res: int, seed: int, grid_path: str) -> Dict[str, Any]:
    """Baseline, then ToMe at each ratio: per configuration one untimed warm-up generation
    (WARMUP_STEPS steps), then one timed generation of `steps` steps."""
    library = pipeline_library(path)
    if (library == "ppdiffusers") != (kit.name == "paddle"):
        raise BadModelPath(f"--model {path!r} is a {library} pipeline: use --backend {'paddle' if library == 'ppdiffusers' else 'torch'}")
    import tomesd

    if kit.name == "torch":
        make_generator = lambda: kit.torch.Generator().manual_seed(seed)  # noqa: E731
    else:
        make_generator = lambda: kit.paddle.Generator().manual_seed(seed)  # noqa: E731
    pipe = load(path, kit)
    pipe.set_progress_bar_config(disable=True)

    def generate(n_steps: int):
        kit.sync()
        start = time.perf_counter()
        image = pipe(prompt, num_inference_steps=n_steps, height=res, width=res, generator=make_generator()).images[0]
        kit.sync()
        return image, time.perf_counter() - start

    def warm_and_time():
        generate(min(WARMUP_STEPS, steps))
        return generate(steps)

    runs = [("baseline", None, *warm_and_time())]
    for ratio in ratios:
        tomesd.apply_patch(pipe, ratio=ratio, seed=seed)
        try:
            runs.append((f"ToMe r={ratio:g}", ratio, *warm_and_time()))
        finally:
            tomesd.remove_patch(pipe)
    _save_grid([(name, image) for name, _, image, _ in runs], grid_path)
    base = runs[0][3]
    return {
        "model": os.path.abspath(path), "library": library, "prompt": prompt, "steps": steps, "res": res, "seed": seed,
        "device": str(kit.device) if kit.name == "torch" else ("gpu" if kit.on_gpu() else "cpu"), "dtype": kit.dtype_name,
        "warmup_steps": min(WARMUP_STEPS, steps), "grid": os.path.abspath(grid_path),
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
