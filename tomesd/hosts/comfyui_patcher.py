"""ComfyUI: ToMe on one ModelPatcher clone, never on the model its other clones share.

ComfyUI's clones share one diffusion model (its modules and weights). So the patch is not installed on it for
good: the clone carries an APPLY_MODEL wrapper (ModelPatcher.add_wrapper_with_key; every ComfyUI model calls
those, while some, SD3's MMDiT among them, call no DIFFUSION_MODEL wrappers), and around each of its own model
calls the wrapper puts the patch's hooks on the diffusion model, whose root hook enters the call as on any
host, and takes them off again. Another clone's calls find no hooks; a
call in another thread finds them inert (a hook acts only inside a call its own thread entered). The blocks,
sites and layouts are the ones every other host uses (tomesd/families/): no ComfyUI forward is copied.

Start and stop as a share of the steps, and a ratio schedule, read the sampler's sigmas from ComfyUI's
transformer_options on the host (one read per call, eager); without them the wrapper reads nothing.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Tuple

from ..runtime.tome_patch import ToMePatch
from .comfyui_attention import with_override
from .targets import PATCH_FINDERS, build_patches

WRAPPER_KEY = "tomesd"
APPLY_MODEL = "apply_model"  # comfy.patcher_extension.WrappersMP.APPLY_MODEL


def diffusion_model_of(model_patcher: Any) -> Any:
    """The diffusion model (UNetModel, MMDiT, Flux, WanModel, ...) a ComfyUI MODEL wraps."""
    base = getattr(model_patcher, "model", None)
    net = getattr(base, "diffusion_model", None)
    if net is None:
        raise TypeError(f"expected a ComfyUI MODEL (a ModelPatcher), got {type(model_patcher).__name__}")
    return net


class ComfyToMe:
    """The wrapper one ToMe or ToDo node puts on one clone: `args` (ToMeArgs), active for the share of the
    steps in [start, stop)."""

    def __init__(self, args: Any, start: float = 0.0, stop: float = 1.0) -> None:
        self.args, self.start, self.stop = args, start, stop
        # id(diffusion model) -> (model, patch), the args.kept_sizes most recently used ones (a workflow's clone sees
        # one model; a server swapping models holds no more than these)
        self._patches: "OrderedDict[int, Tuple[Any, ToMePatch]]" = OrderedDict()
        self._lock = threading.Lock()

    def prepare(self, net: Any) -> ToMePatch:
        """The patch for `net`, built (and checked) once: refusals come here, at the node, before sampling."""
        with self._lock:
            held = self._patches.get(id(net))
            if held is None or held[0] is not net:
                (patch,) = build_patches(net, self.args)
                held = self._patches[id(net)] = (net, patch)
                if len(self._patches) > self.args.kept_sizes:
                    self._patches.popitem(last=False)
            self._patches.move_to_end(id(net))
            return held[1]

    @property
    def patches(self) -> List[ToMePatch]:
        return [patch for _, patch in self._patches.values()]

    def __call__(self, executor: Any, *args: Any, **kwargs: Any) -> Any:
        """BaseModel._apply_model(x, t, c_concat, c_crossattn, control, transformer_options, **kwargs), wrapped."""
        net = executor.class_obj.diffusion_model
        patch = self.prepare(net)
        options = kwargs.get("transformer_options", args[5] if len(args) > 5 else None) or {}
        progress = self._progress(options) if self._needs_progress() else None
        if progress is not None and not self.start <= progress < self.stop:
            return executor(*args, **kwargs)
        if kwargs.get("ref_latents"):
            raise ValueError(
                f"ToMe cannot reduce {type(net).__name__} with reference latents (Flux Kontext, edit models): their "
                f"tokens join the image's in every block. Bypass the ToMe node for this model.")
        # (The ToDo node refuses these Flux-layout models at the node already.)
        flux_layout = {"DoubleStreamBlock", "SingleStreamBlock"} & set(patch.kind_names)
        if kwargs.get("attention_mask") is not None and flux_layout:
            raise ValueError(
                f"ToMe cannot reduce {type(net).__name__} given an attention mask (Chroma's or HunyuanVideo's text "
                f"padding, a regional prompt): the mask addresses every text and image token of its self-attention. "
                f"Bypass the ToMe node for this model, or leave the mask out.")
        _refuse_attn1_patches(patch, options)
        patch.install(mark=False)
        try:
            if patch.key_seam is not None:  # proportional attention: weighed under whichever attention ComfyUI runs
                options = with_override(options, patch.key_seam)
                if "transformer_options" in kwargs or len(args) <= 5:
                    kwargs = dict(kwargs, transformer_options=options)
                else:
                    args = args[:5] + (options,) + args[6:]
            if self.args.ratio_schedule is not None:
                patch.host_ratio = self.args.ratio_at(progress or 0.0)
            return executor(*args, **kwargs)
        finally:
            patch.detach()

    def _needs_progress(self) -> bool:
        return self.start > 0.0 or self.stop < 1.0 or self.args.ratio_schedule is not None

    @staticmethod
    def _progress(options: dict) -> Optional[float]:
        """Steps done over steps in the run, from the sampler's sigmas (None outside a sampler)."""
        sigmas, sigma = options.get("sample_sigmas"), options.get("sigmas")
        if sigmas is None or sigma is None or len(sigmas) < 2:
            return None
        schedule = [float(s) for s in sigmas]
        now = float(sigma.reshape(-1)[0])
        step = min(range(len(schedule) - 1), key=lambda i: abs(schedule[i] - now))
        return step / (len(schedule) - 1)


def _refuse_attn1_patches(patch: ToMePatch, options: dict) -> None:
    """A UNet block given an attn1 patch (ComfyUI's own TomePatchModel is one) passes self-attention its keys and
    values as a separate full-length input, which ToMe would not reduce and ToDo could not replace."""
    if "BasicTransformerBlock" not in patch.kind_names:
        return
    names = [name for name, found in (("attn1_patch", options.get("patches", {}).get("attn1_patch")),
                                      ("attn1 replace patch", options.get("patches_replace", {}).get("attn1")))
             if found]
    if names:
        raise ValueError(
            f"another node patches this model's self-attention ({' and '.join(names)}; ComfyUI's built-in "
            f"TomePatchModel does): ComfyUI then gives self-attention its keys and values apart from its queries, "
            f"at full length, so ToMe could not reduce them. Use either that node or this one, not both.")


def comfy_patches(obj: Any) -> List[ToMePatch]:
    """The patches a ComfyUI MODEL's ToMe wrappers hold (for tomesd.observe), or [] for anything else."""
    wrappers = getattr(obj, "wrappers", None)
    if not isinstance(wrappers, dict):
        return []
    found: List[ToMePatch] = []
    for wrapper in wrappers.get(APPLY_MODEL, {}).get(WRAPPER_KEY, []):
        if isinstance(wrapper, ComfyToMe):
            found.extend(wrapper.patches)
    return found


PATCH_FINDERS.append(comfy_patches)
