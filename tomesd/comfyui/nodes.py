"""The ToMe and ToDo nodes: MODEL in, a patched clone of it out (tomesd.adapters.comfy does the patching).

Imports nothing of ComfyUI at module level, so the pack's definitions load (and are tested) without it; the
node functions import `comfy.patcher_extension` when they run inside ComfyUI.
"""
from __future__ import annotations

import re
from typing import Any, Dict, Optional, Tuple

from tome_core import ToMeArgs
from tome_core.schedule import DOWNSAMPLE_METHODS

from ..adapters.comfy import APPLY_MODEL, WRAPPER_KEY, ComfyToMe, diffusion_model_of

CATEGORY = "model_patches/tomesd"
COVERED = ("ComfyUI's SD1 / SD2 / SDXL UNet (UNetModel), SD3 / SD3.5 (MMDiT), Flux (Flux) and Wan 2.1 / 2.2 "
           "(WanModel)")
_LEVELS = ["auto", "1", "2", "4", "8"]
_SHARE = {"default": 0.0, "min": 0.0, "max": 1.0, "step": 0.01}

# The library's refusals name its own arguments; a node user sees the node's inputs.
_TERMS = (
    ("mode='merge'", "the ToMe node"),
    ("mode='downsample'", "the ToDo node"),
    ("max_downsample", "levels"),
    ("apply_patch", "the node"),
)


def _in_node_terms(message: str) -> str:
    for library, node in _TERMS:
        message = message.replace(library, node)
    return message


def parse_blocks(text: str) -> Optional[Tuple[int, ...]]:
    """'0-9, 12' -> (0, ..., 9, 12); '' -> None (every block)."""
    text = text.strip()
    if not text:
        return None
    blocks = set()
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if match is None:
            raise ValueError(f"blocks must be indices and ranges such as '0-9, 12', got {text!r}")
        first = int(match.group(1))
        last = int(match.group(2)) if match.group(2) else first
        if last < first:
            raise ValueError(f"blocks: the range {part.strip()!r} runs backwards")
        blocks.update(range(first, last + 1))
    return tuple(sorted(blocks))


def parse_schedule(text: str) -> Optional[Tuple[Tuple[float, float], ...]]:
    """'0:0.6, 0.5:0.3' -> ((0.0, 0.6), (0.5, 0.3)): from each share of the steps on, that ratio."""
    text = text.strip()
    if not text:
        return None
    try:
        return tuple((float(a), float(b)) for a, b in (piece.split(":") for piece in text.split(",")))
    except ValueError:
        raise ValueError(f"ratio_schedule must read 'share:ratio, share:ratio', such as '0:0.6, 0.5:0.3', "
                         f"got {text!r}") from None


def _patched(model: Any, args: ToMeArgs, start: float, stop: float) -> Any:
    import comfy.patcher_extension  # noqa: F401  (ComfyUI is the host here)

    if not 0.0 <= start < stop <= 1.0:
        raise ValueError(f"start must be below stop, both shares of the steps in [0, 1]; got {start} and {stop}")
    wrapper = ComfyToMe(args, start, stop)
    net = diffusion_model_of(model)
    try:
        wrapper.prepare(net)  # refusals now, before the clone or any sampling
    except (ValueError, TypeError) as error:
        raise type(error)(f"{_in_node_terms(str(error))}. (This MODEL's diffusion model is {type(net).__name__}; "
                          f"the pack covers {COVERED}.)") from None
    clone = model.clone()
    clone.remove_wrappers_with_key(APPLY_MODEL, WRAPPER_KEY)  # a second node replaces the first
    clone.add_wrapper_with_key(APPLY_MODEL, WRAPPER_KEY, wrapper)
    return clone


def _where() -> Dict[str, Any]:
    return {
        "levels": (_LEVELS, {"default": "auto", "tooltip": "UNets: reduce in blocks at most this much downsampled "
                                                           "from the latent (auto: the finest level with attention; "
                                                           "SDXL's is 2)."}),
        "blocks": ("STRING", {"default": "", "tooltip": "Diffusion transformers (SD3, Flux, Wan): block indices "
                                                       "such as '0-18'; empty: every block."}),
    }


def _args(mode: str, levels: str, blocks: str, **settings: Any) -> ToMeArgs:
    try:
        return ToMeArgs(mode=mode, max_downsample=None if levels == "auto" else int(levels),
                        blocks=parse_blocks(blocks), **settings)
    except ValueError as error:
        raise ValueError(_in_node_terms(str(error))) from None


class ToMe:
    """Token merging: similar image tokens merge before attention (and optionally before cross-attention and
    the MLP) and unmerge after, so queries, keys and values all shrink."""

    @classmethod
    def INPUT_TYPES(cls) -> Dict[str, Any]:
        return {
            "required": {
                "model": ("MODEL",),
                "ratio": ("FLOAT", {"default": 0.5, "min": 0.0, "max": 0.95, "step": 0.05,
                                    "tooltip": "Share of image tokens merged away at self-attention."}),
                "crossattn_ratio": ("FLOAT", {"default": 0.0, "min": 0.0, "max": 0.95, "step": 0.05,
                                              "tooltip": "Also merge before cross-attention (0: off)."}),
                "mlp_ratio": ("FLOAT", {"default": 0.0, "min": 0.0, "max": 0.95, "step": 0.05,
                                        "tooltip": "Also merge before the MLP (0: off)."}),
                **_where(),
                "use_rand": ("BOOLEAN", {"default": True}),
                "reuse_steps": ("INT", {"default": 1, "min": 1, "max": 10,
                                        "tooltip": "Compute each block's matching every this many steps."}),
                "start": ("FLOAT", {**_SHARE, "tooltip": "Merge from this share of the steps on."}),
                "stop": ("FLOAT", {**_SHARE, "default": 1.0, "tooltip": "Merge until this share of the steps."}),
            },
            "optional": {
                "ratio_schedule": ("STRING", {"default": "", "tooltip": "Instead of ratio: 'share:ratio, ...', "
                                                                       "e.g. '0:0.6, 0.5:0.3'."}),
            },
        }

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "patch"
    CATEGORY = CATEGORY
    DESCRIPTION = __doc__

    def patch(self, model: Any, ratio: float, crossattn_ratio: float, mlp_ratio: float, levels: str, blocks: str,
              use_rand: bool, reuse_steps: int, start: float, stop: float, ratio_schedule: str = "") -> Tuple[Any]:
        schedule = parse_schedule(ratio_schedule)
        sites = {"attn": ratio, "crossattn": crossattn_ratio, "mlp": mlp_ratio}
        per_site = crossattn_ratio > 0 or mlp_ratio > 0
        settings: Dict[str, Any] = dict(use_rand=use_rand, reuse_steps=reuse_steps)
        if schedule is not None:
            if per_site:
                raise ValueError("ratio_schedule schedules the self-attention ratio alone: set crossattn_ratio "
                                 "and mlp_ratio to 0 with it")
            settings["ratio_schedule"] = schedule
        else:
            settings["ratio"] = {k: v for k, v in sites.items() if v > 0} if per_site else ratio
        args = _args("merge", levels, blocks, **settings)
        return (_patched(model, args, start, stop),)


class ToDo:
    """Token downsampling: self-attention takes its keys and values from the image tokens' grid downsampled by
    `factor` per side; queries stay whole. Users of the A1111 extension stop it at 0.6-0.8 of the steps."""

    @classmethod
    def INPUT_TYPES(cls) -> Dict[str, Any]:
        return {
            "required": {
                "model": ("MODEL",),
                "factor": ("INT", {"default": 2, "min": 1, "max": 8, "tooltip": "Per side: 2 keeps 1/4 of the keys."}),
                "method": (list(DOWNSAMPLE_METHODS), {"default": "nearest"}),
                **_where(),
                "start": ("FLOAT", {**_SHARE, "tooltip": "Downsample from this share of the steps on."}),
                "stop": ("FLOAT", {**_SHARE, "default": 0.7, "tooltip": "Downsample until this share of the steps."}),
            }
        }

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "patch"
    CATEGORY = CATEGORY
    DESCRIPTION = __doc__

    def patch(self, model: Any, factor: int, method: str, levels: str, blocks: str, start: float,
              stop: float) -> Tuple[Any]:
        args = _args("downsample", levels, blocks, downsample_factor=factor, downsample_method=method)
        return (_patched(model, args, start, stop),)


NODE_CLASS_MAPPINGS = {"TomesdToMe": ToMe, "TomesdToDo": ToDo}
NODE_DISPLAY_NAME_MAPPINGS = {"TomesdToMe": "ToMe (token merging)", "TomesdToDo": "ToDo (token downsampling)"}
