"""The ToMe and ToDo nodes: MODEL in, a patched clone of it out (tomesd.hosts.comfyui_patcher does the patching).

Imports nothing of ComfyUI at module level, so the pack's definitions load (and are tested) without it; the
node functions import `comfy.patcher_extension` when they run inside ComfyUI.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Tuple

from tome_core import ToMeArgs
from tome_core.schedule import DOWNSAMPLE_METHODS

from ..hosts.comfyui_patcher import APPLY_MODEL, WRAPPER_KEY, ComfyToMe, diffusion_model_of
from .checks import (
    CELL, MAX_RATIO, ModelFacts, check_ratio, check_sites, check_todo, check_where, parse_blocks, parse_schedule,
    refusals,
)

__all__ = ["ToMe", "ToDo", "NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "parse_blocks", "parse_schedule"]

CATEGORY = "model_patches/tomesd"
COVERED = ("ComfyUI's SD1 / SD2 / SDXL UNet (UNetModel), SD3 / SD3.5 (MMDiT), Flux and Flux.2 (Flux), Chroma (Chroma), "
           "Wan 2.1 / 2.2 (WanModel), Qwen-Image (QwenImageTransformer2DModel), Lumina 2 / Z-Image (NextDiT), "
           "LTX-Video (LTXVModel), Cosmos Predict2 (MiniTrainDIT), HunyuanVideo / HunyuanVideo 1.5 / HunyuanImage 2.1 "
           "(HunyuanVideo) and HiDream-I1 (HiDreamImageTransformer2DModel)")
_LEVELS = ["auto", "1", "2", "4", "8"]
_SHARE = {"default": 0.0, "min": 0.0, "max": 1.0, "step": 0.01}
# Ratio widgets end where merging stops (checks.MAX_RATIO: one token of each 2x2 cell stays).
_RATIO = {"min": 0.0, "max": MAX_RATIO, "step": 0.05}
_CAP = (f"Up to {MAX_RATIO:g}: one token of each {CELL} cell stays for the others to merge into, so merging "
        f"stops there.")

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


def _patched(model: Any, args: ToMeArgs, start: float, stop: float, check: Callable[[ModelFacts], None]) -> Any:
    """A clone of `model` carrying the patch; `check` refuses, in the node's terms, what this model cannot take.
    Every refusal comes before the clone is made or anything is hooked."""
    import comfy.patcher_extension  # noqa: F401  (ComfyUI is the host here)

    if not 0.0 <= start < stop <= 1.0:
        raise ValueError(f"start must be below stop, both shares of the steps in [0, 1]; got {start} and {stop}")
    net = diffusion_model_of(model)
    check(ModelFacts.of(net))
    wrapper = ComfyToMe(args, start, stop)
    try:
        wrapper.prepare(net)  # the library's own refusals, for what the node's checks do not cover
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
                                                           "SDXL's is 2). Diffusion transformers: leave at auto."}),
        "blocks": ("STRING", {"default": "", "tooltip": "Diffusion transformers (SD3, Flux, Wan, Qwen-Image): block "
                                                       "indices such as '0-18, 30'; empty: every block. UNets: "
                                                       "leave empty."}),
    }


def _args(mode: str, levels: str, blocks: str, **settings: Any) -> ToMeArgs:
    try:
        return ToMeArgs(mode=mode, max_downsample=None if levels == "auto" else int(levels),
                        blocks=parse_blocks(blocks), **settings)
    except ValueError as error:
        raise ValueError(_in_node_terms(str(error))) from None


def _merge_settings(ratio: float, crossattn_ratio: float, mlp_ratio: float, reuse_steps: int,
                    ratio_schedule: str) -> Dict[str, Any]:
    """ToMeArgs' ratio settings from the ToMe node's widgets, refusing values they cannot mean."""
    for name, value in (("ratio", ratio), ("crossattn_ratio", crossattn_ratio), ("mlp_ratio", mlp_ratio)):
        check_ratio(name, value)  # before anything is patched: a value past the cap merges nothing more
    schedule = parse_schedule(ratio_schedule)
    per_site = crossattn_ratio > 0 or mlp_ratio > 0
    if schedule is None:
        sites = {"attn": ratio, "crossattn": crossattn_ratio, "mlp": mlp_ratio}
        return {"reuse_steps": reuse_steps, "ratio": {k: v for k, v in sites.items() if v > 0} if per_site else ratio}
    if per_site:
        raise ValueError("ratio_schedule schedules the self-attention ratio alone: set crossattn_ratio and mlp_ratio "
                         "to 0 with it, or clear ratio_schedule")
    if reuse_steps > 1:
        raise ValueError(f"reuse_steps {reuse_steps} cannot go with ratio_schedule: a reused matching keeps the ratio "
                         f"of the step that made it. Set reuse_steps to 1, or clear ratio_schedule")
    for _, value in schedule:
        check_ratio(f"ratio_schedule {ratio_schedule.strip()!r}", value)
    return {"reuse_steps": reuse_steps, "ratio_schedule": schedule}


class ToMe:
    """Token merging: similar image tokens merge before attention (and optionally before cross-attention and
    the MLP) and unmerge after, so queries, keys and values all shrink."""

    @classmethod
    def INPUT_TYPES(cls) -> Dict[str, Any]:
        return {
            "required": {
                "model": ("MODEL",),
                "ratio": ("FLOAT", {**_RATIO, "default": 0.5, "tooltip": (
                    "Share of the image tokens merged away before self-attention and restored after: queries, keys "
                    "and values all shrink. 0: off. " + _CAP)}),
                "crossattn_ratio": ("FLOAT", {**_RATIO, "default": 0.0, "tooltip": (
                    "Share merged away before cross-attention (UNets, Wan; Flux, SD3 and Qwen-Image have none). 0: "
                    "off; above 0, ratio, crossattn_ratio and mlp_ratio each apply to their own site, from one "
                    "matching. " + _CAP)}),
                "mlp_ratio": ("FLOAT", {**_RATIO, "default": 0.0, "tooltip": (
                    "Share merged away before the MLP (feed-forward). 0: off; above 0, as crossattn_ratio. "
                    + _CAP)}),
                **_where(),
                "use_rand": ("BOOLEAN", {"default": True, "tooltip": "Pick the kept token of each cell at random "
                                                                     "(ToMe's default) instead of its corner."}),
                "reuse_steps": ("INT", {"default": 1, "min": 1, "max": 10,
                                        "tooltip": "Compute each block's matching every this many steps."}),
                "start": ("FLOAT", {**_SHARE, "tooltip": "Merge from this share of the steps on."}),
                "stop": ("FLOAT", {**_SHARE, "default": 1.0, "tooltip": "Merge until this share of the steps."}),
            },
            "optional": {
                "ratio_schedule": ("STRING", {"default": "", "tooltip": (
                    f"Instead of ratio: 'share:ratio, ...', e.g. '0:0.6, 0.5:0.3' (from 0 on 0.6, from half the "
                    f"steps on 0.3); each ratio up to {MAX_RATIO:g}.")}),
                "proportional_attention": ("BOOLEAN", {"default": False, "tooltip": (
                    "A merged key weighs in attention as the tokens it holds: much closer to the model without "
                    "merging. Needs ComfyUI's pytorch attention (the default on NVIDIA GPUs).")}),
                "restore_tokens": ("BOOLEAN", {"default": False, "tooltip": (
                    "With reuse_steps 2 or more: the first step of every reuse_steps runs unmerged and keeps each "
                    "token's difference to its merged group; the steps between add it back. Closer, and slower "
                    "than reuse_steps alone (one step in reuse_steps runs at full cost).")}),
            },
        }

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "patch"
    CATEGORY = CATEGORY
    DESCRIPTION = __doc__

    def patch(self, model: Any, ratio: float, crossattn_ratio: float, mlp_ratio: float, levels: str, blocks: str,
              use_rand: bool, reuse_steps: int, start: float, stop: float, ratio_schedule: str = "",
              proportional_attention: bool = False, restore_tokens: bool = False) -> Tuple[Any]:
        with refusals("ToMe"):
            settings = _merge_settings(ratio, crossattn_ratio, mlp_ratio, reuse_steps, ratio_schedule)
            if restore_tokens:
                settings["restore_tokens"] = True  # (refused below 2 reuse_steps, naming reuse_steps)
            args = _args("merge", levels, blocks, use_rand=use_rand, proportional_attention=proportional_attention,
                         **settings)

            def check(facts: ModelFacts) -> None:
                check_where(facts, levels, blocks, args.blocks)
                check_sites(facts, {"crossattn_ratio": crossattn_ratio, "mlp_ratio": mlp_ratio})

            return (_patched(model, args, start, stop, check),)


class ToDo:
    """Token downsampling: self-attention takes its keys and values from the image tokens' grid downsampled by
    `factor` per side; queries stay whole. Users of the A1111 extension stop it at 0.6-0.8 of the steps."""

    @classmethod
    def INPUT_TYPES(cls) -> Dict[str, Any]:
        return {
            "required": {
                "model": ("MODEL",),
                "factor": ("INT", {"default": 2, "min": 1, "max": 8, "tooltip": "Per side: 2 keeps 1/4 of the keys "
                                                                             "and values; queries stay whole."}),
                "method": (list(DOWNSAMPLE_METHODS), {"default": "nearest", "tooltip": "nearest: one token of each "
                                                      "cell; avg: the cell's mean."}),
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
        with refusals("ToDo"):
            args = _args("downsample", levels, blocks, downsample_factor=factor, downsample_method=method)

            def check(facts: ModelFacts) -> None:
                check_todo(facts)  # first: on these models no blocks or levels would make ToDo run
                check_where(facts, levels, blocks, args.blocks)

            return (_patched(model, args, start, stop, check),)


NODE_CLASS_MAPPINGS = {"TomesdToMe": ToMe, "TomesdToDo": ToDo}
NODE_DISPLAY_NAME_MAPPINGS = {"TomesdToMe": "ToMe (token merging)", "TomesdToDo": "ToDo (token downsampling)"}
