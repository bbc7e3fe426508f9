"""`tomesd.recommend(pipe)`: the setting this project recommends for a model's family, size and device, as a config
for `apply_patch(pipe, config=...)`.

On a CUDA GPU the pick is the device-time model's (tomesd/devicetime/picks.json, docs/device-picks.md): the closest
setting on the family's yardstick whose predicted device-time ratio on an H100 reaches the family's goal, predicted,
not measured. On a CPU it is the setting the README's CPU table measured fastest on this project's 2-core machine.
A family or size with no pick is refused by name, with the ones known: nothing is guessed."""
from __future__ import annotations

import json
import os
from typing import Any, Dict, Optional, Tuple, Union

from .config import ToDoConfig, ToMeConfig

_PICKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "devicetime", "picks.json")

# The README's CPU table: the setting measured fastest per family and size on this project's 2-core CPU (docs/
# performance.md, docs/transformers.md, docs/bench.md, docs/video.md). Key: (family, height, width, frames).
CPU_PICKS: Dict[Tuple[str, int, int, Optional[int]], Dict[str, Any]] = {
    ("sd1", 512, 512, None): dict(mode="downsample"),  # 1.13x
    ("sd1", 1024, 1024, None): dict(mode="downsample"),  # 1.49x
    ("sd3", 1024, 1024, None): dict(ratio=0.6, merge_mlp=True, reuse_steps=4, proportional_attention=True,
                                    restore_tokens=True),  # 2.68x, 35.9 dB
    ("pixart", 1024, 1024, None): dict(mode="downsample"),  # 1.42-1.45x
    ("flux", 1024, 1024, None): dict(ratio=0.5),  # 1.73-1.76x
    ("flux2", 1024, 1024, None): dict(ratio=0.5),  # 1.81x (one noisy run)
    ("qwen-image", 1024, 1024, None): dict(ratio=0.5, merge_mlp=True),  # 1.68x
    ("z-image", 1024, 1024, None): dict(ratio=0.75),  # 1.42x
    ("hunyuanvideo-1.5", 480, 848, 9): dict(ratio=0.75),  # 1.41x
    ("wan", 480, 832, 17): dict(ratio=0.5),  # 1.40-1.48x
    ("animatediff", 512, 512, 16): dict(ratio=0.5),  # 1.11x
}
# A GPU finding with no setting to give: nothing pays (docs/gpu.md).
GPU_NOTHING_PAYS = {("sd1", 512, 512, None): "the SD1/SD2 UNet at 512² is launch-bound on a GPU: nothing ToMe offers "
                                             "paid there (r=0.5 0.86-0.92x, downsampling 0.98-1.02x, H100 and H200)"}

_FAMILY_OF_CLASS = {
    "SD3Transformer2DModel": "sd3", "PixArtTransformer2DModel": "pixart", "FluxTransformer2DModel": "flux",
    "Flux2Transformer2DModel": "flux2", "QwenImageTransformer2DModel": "qwen-image",
    "ZImageTransformer2DModel": "z-image", "HunyuanVideo15Transformer3DModel": "hunyuanvideo-1.5",
    "WanTransformer3DModel": "wan", "UNetMotionModel": "animatediff",
}
_DEFAULT_SIZE = {"wan": (480, 832, 81), "hunyuanvideo-1.5": (480, 848, 9), "animatediff": (512, 512, 16)}


class NoRecommendation(LookupError):
    """No pick is recorded for this family, size and device."""


Config = Union[ToMeConfig, ToDoConfig]


def recommend(model_or_pipe: Any = None, device: str = "cuda", *, family: Optional[str] = None,
              size: Optional[Union[int, Tuple[int, int]]] = None, frames: Optional[int] = None) -> Config:
    """The recommended config for a diffusers pipeline or denoiser (or `family=` by name: sd1, sdxl, sd3, flux,
    wan, ...), at `size` (pixels; default: the model's default sample size) on `device` ("cuda" or "cpu")."""
    gpu = str(device).split(":")[0] in ("cuda", "gpu")
    if str(device).split(":")[0] not in ("cuda", "gpu", "cpu"):
        raise ValueError(f"device={device!r}: recommend knows picks for 'cuda' (predicted on an H100) and 'cpu'")
    if family is None:
        if model_or_pipe is None:
            raise ValueError("recommend needs a pipeline or model, or family= (sd1, sdxl, sd3, flux, wan, ...)")
        family, default = _family(model_or_pipe)
    else:
        default = None
    height, width, default_frames = _size(family, size, default)
    frames = frames if frames is not None else default_frames
    key = (family, height, width, frames)
    if gpu:
        if key in GPU_NOTHING_PAYS:
            raise NoRecommendation(f"{GPU_NOTHING_PAYS[key]}: run it without ToMe")
        picks = _gpu_picks()
        kwargs = picks.get(key)
        known = sorted(picks)
    else:
        kwargs = CPU_PICKS.get(key)
        known = sorted(CPU_PICKS)
    if kwargs is None:
        where = "on a GPU (predicted)" if gpu else "on a CPU (measured)"
        raise NoRecommendation(
            f"no pick is recorded for {family} at {height}x{width}" + (f", {frames} frames" if frames else "")
            + f" {where}; picks exist for " + ", ".join(_name(k) for k in known)
            + ". Time the settings yourself: python -m tomesd tune" + (" --device cuda" if gpu else ""))
    kwargs = dict(kwargs)
    if kwargs.pop("mode", "merge") == "downsample":
        return ToDoConfig(**kwargs)
    return ToMeConfig(**kwargs)


def _name(key: Tuple[str, int, int, Optional[int]]) -> str:
    family, h, w, frames = key
    return f"{family} {h}x{w}" + (f" ({frames} frames)" if frames else "")


def _gpu_picks() -> Dict[Tuple[str, int, int, Optional[int]], Dict[str, Any]]:
    with open(_PICKS) as f:
        doc = json.load(f)
    found = {}
    for m in doc["models"]:
        pick = next(p for p in m["points"] if p["name"] == m["pick"])
        found[(m["arch"], m["res"][0], m["res"][1], m["frames"])] = pick["kwargs"]
    return found


def _denoiser(obj: Any) -> Any:
    for name in ("unet", "transformer"):
        inner = getattr(obj, name, None)
        if inner is not None:
            return inner
    return getattr(obj, "model", obj) if type(obj).__name__ == "LatentDiffusion" else obj


def family_of(obj: Any) -> Optional[str]:
    """The family (bench's --arch name: sd1, sdxl, sd3, flux, wan, ...) of a pipeline or denoiser, None if unknown.
    An SDXL UNet is told from SD1/SD2's by its added time embedding."""
    model = _denoiser(obj)
    if type(model).__name__ == "UNet2DConditionModel":
        config = getattr(model, "config", None)
        return "sdxl" if getattr(config, "addition_embed_type", None) == "text_time" else "sd1"
    return _FAMILY_OF_CLASS.get(type(model).__name__)


def _family(obj: Any) -> Tuple[str, Optional[Tuple[int, ...]]]:
    """(family, its default (height, width[, frames]) or None) of a pipeline or denoiser."""
    model = _denoiser(obj)
    config = getattr(model, "config", None)
    vae = getattr(obj, "vae_scale_factor", None) or 8
    family = family_of(obj)
    if family is None:
        raise NoRecommendation(f"recommend has no picks for {type(model).__name__}: it knows the SD1/SD2 and SDXL "
                               "UNets and " + ", ".join(sorted(_FAMILY_OF_CLASS)) + "; give family= or time "
                               "settings with python -m tomesd tune")
    if family in ("sd1", "sdxl"):
        side = getattr(config, "sample_size", None)
        return family, ((side * vae, side * vae) if isinstance(side, int) else None)
    side = getattr(obj, "default_sample_size", None) or getattr(config, "sample_size", None)
    default = _DEFAULT_SIZE.get(family) or ((side * vae, side * vae) if isinstance(side, int) else None)
    return family, default


def _size(family: str, size: Any, default: Optional[Tuple[int, ...]]) -> Tuple[int, int, Optional[int]]:
    if size is None:
        found = default or _DEFAULT_SIZE.get(family) or (1024, 1024)
        return found[0], found[1], found[2] if len(found) > 2 else None
    if isinstance(size, int):
        return size, size, (_DEFAULT_SIZE.get(family) or (0, 0, None))[2] if family in _DEFAULT_SIZE else None
    h, w = size
    return int(h), int(w), (_DEFAULT_SIZE[family][2] if family in _DEFAULT_SIZE else None)
