"""Which models of a user's object get patched: every denoiser, never the VAE or text encoders.

Recognised by class names and attributes, so the same rules serve diffusers, ppdiffusers and the
original LDM / Stable Diffusion code without importing any of them.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, List, Optional, Tuple

from ..backends.frameworks import array_ops, class_names, framework_of, host_ops
from ..families import KNOWN_BLOCKS, SUPPORTED, refusal, root_kind
from ..runtime.clock import StepClock, clockable
from ..runtime.observe import Observation
from ..runtime.tome_patch import PATCH_ATTR, ToMePatch, transformer_blocks
from .references import ReferenceSplit, joins_references

# Pipeline components that are never denoisers (prefixes: text_encoder_2, vae_decoder, ...).
_NOT_DENOISERS = (
    "vae", "vqvae", "text_encoder", "tokenizer", "image_encoder", "safety_checker",
    "feature_extractor", "scheduler", "image_processor",
)

def _expand(component: Any) -> List[Any]:
    """The models a pipeline component stands for: lists and Multi-ControlNets open up."""
    if isinstance(component, (list, tuple)):
        return [model for item in component for model in _expand(item)]
    if framework_of(component) is None:
        return []
    if "OptimizedModule" in class_names(component):  # torch.compile's wrapper: patch what it runs
        return _expand(component._orig_mod)
    nets = getattr(component, "nets", None)  # MultiControlNetModel
    if "MultiControlNetModel" in class_names(component) and nets is not None:
        return [model for net in nets for model in _expand(net)]
    return [component]


def _compiled(obj: Any) -> bool:
    """Whether `obj` holds a torch.compile'd denoiser (a wrapper, or a module compiled in place)."""
    items = list(obj.components.values()) if "DiffusionPipeline" in class_names(obj) and hasattr(obj, "components") else [obj]
    while items:
        item = items.pop()
        if isinstance(item, (list, tuple)):
            items.extend(item)
        elif "OptimizedModule" in class_names(item) or getattr(item, "_compiled_call_impl", None) is not None:
            return True
    return False


def _after_change(obj: Any, models: List[Any]) -> None:
    # Dynamo does not guard on module hooks: code compiled before a patch (or its removal) would
    # go on running the old hooks, so compiled code is dropped and recompiles on its next call.
    if models and _compiled(obj):
        host_ops(framework_of(models[0])).reset_compiled()


def candidate_models(obj: Any) -> List[Any]:
    """The models of `obj` that may hold a denoiser; TypeError for an object we do not know."""
    if "DiffusionPipeline" in class_names(obj) and hasattr(obj, "components"):
        return [
            model
            for name, component in obj.components.items()
            if not name.startswith(_NOT_DENOISERS)
            for model in _expand(component)
        ]
    if framework_of(obj) is None:
        raise TypeError(f"ToMe cannot patch a {type(obj).__name__}: expected {SUPPORTED}")
    ldm_unet = getattr(getattr(obj, "model", None), "diffusion_model", None)
    if ldm_unet is not None:
        control = getattr(obj, "control_model", None)  # ControlLDM
        return [ldm_unet] + ([control] if control is not None else [])
    return _expand(obj)


def build_patches(obj: Any, args: Any) -> List[ToMePatch]:
    """One (not yet installed) patch per denoiser of `obj`; raises before anything is changed."""
    models = candidate_models(obj)
    frameworks = {framework_of(model) for model in models}
    if len(frameworks) > 1:
        raise TypeError(f"{type(obj).__name__} mixes torch and paddle models; patch them one at a time")
    for model in models:
        refused = refusal(model)
        if refused:
            raise TypeError(refused)
    for model in models:
        if getattr(model, "inference_optimize", False) is True:  # ppdiffusers' INFERENCE_OPTIMIZE=True build
            raise ValueError(
                f"ToMe cannot patch a {type(model).__name__} built with INFERENCE_OPTIMIZE=True: its fused "
                f"inference path runs no per-block layers to hook. Build it without that environment variable."
            )
    patches = []
    for model in models:
        framework = framework_of(model)
        host = host_ops(framework)
        if transformer_blocks(host, model):
            patches.append(ToMePatch(model, args, host, array_ops(framework)))
    if not patches:
        raise ValueError(
            f"found no transformer block ToMe knows ({KNOWN_BLOCKS}) in {type(obj).__name__}: nothing for ToMe to merge"
        )
    for patch in patches:
        patch.validate()
    if args.blocks is not None:
        # Indices count each model's own blocks: a ControlNet (fewer blocks than its transformer) reduces
        # those it has; an index no model has is refused.
        deepest = max(patches, key=lambda patch: len(patch.blocks))
        if args.blocks[-1] >= len(deepest.blocks):
            raise ValueError(
                f"blocks {list(args.blocks)} is out of range: {type(deepest.root).__name__} has "
                f"{len(deepest.blocks)} transformer blocks (indices 0 to {len(deepest.blocks) - 1})"
            )
    return patches


# Hosts that keep their patches outside the model's modules register a finder of them here, when their adapter
# is imported (comfyui_patcher.py: a ComfyUI MODEL's ToMe node holds them; no such patch exists before it is imported).
PATCH_FINDERS: List[Callable[[Any], List[ToMePatch]]] = []


def installed_patches(obj: Any) -> List[ToMePatch]:
    """Every patch installed anywhere inside `obj` (or held by a host's own object, PATCH_FINDERS)."""
    for finder in PATCH_FINDERS:
        found = finder(obj)
        if found:
            return found
    found = []
    for model in candidate_models(obj):
        host = host_ops(framework_of(model))
        for _, module in host.named_modules(model):
            patch = module.__dict__.get(PATCH_ATTR)
            if patch is not None and patch not in found:
                found.append(patch)
    return found


def apply(obj: Any, args: Any) -> Tuple[Any, List[Any]]:
    """Patch every denoiser of `obj` (replacing an earlier patch); returns (obj, patched models)."""
    patches = build_patches(obj, args)
    # A pipeline counts its denoising steps on the host; a bare model only by its timestep's value.
    scheduled = args.ratio_schedule is not None
    clocked = (args.steps_reused > 1 or scheduled) and "DiffusionPipeline" in class_names(obj) and clockable(obj)
    if scheduled and not clocked:
        raise ValueError(
            "ratio_schedule follows the denoising run's progress, which only a pipeline's loop knows on the host "
            "(its scheduler's steps): apply the patch to the pipeline, not to a bare model"
        )
    if args.steps_reused > 1 and not clocked and _compiled(obj):
        raise ValueError(
            "reuse_steps > 1 cannot run in a torch.compile'd bare model: telling a new denoising step from "
            "the same one reads the timestep on the host. Patch the pipeline (its scheduler counts the "
            "steps), or use reuse_steps=1 or mode='downsample'."
        )
    if args.restore_tokens and _compiled(obj):
        raise ValueError(
            "restore_tokens runs eagerly (its steps keep and add residuals by a step count on the host), and this "
            "denoiser is torch.compile'd: use reuse_steps without restore_tokens, or the uncompiled denoiser")
    remove(obj)
    if clocked:
        clock = StepClock(obj, args.steps_reused, args if scheduled else None)
        clock.attach()
        for slot, patch in enumerate(patches):
            patch.clock, patch.slot = clock, slot
    if "DiffusionPipeline" in class_names(obj) and joins_references(obj, [root_kind(p.root) for p in patches]):
        split = ReferenceSplit(obj, [patch.layout for patch in patches if hasattr(patch.layout, "target")])
        split.attach()
        for patch in patches:
            patch.references = split
    for patch in patches:
        patch.install()
    _after_change(obj, [patch.root for patch in patches])
    return obj, [patch.root for patch in patches]


def remove(obj: Any) -> Tuple[Any, List[Any]]:
    """Remove every ToMe patch inside `obj`; returns (obj, models that were unpatched)."""
    patches = installed_patches(obj)
    for patch in patches:
        if patch.clock is not None:
            patch.clock.detach()
        if patch.references is not None:
            patch.references.detach()
        patch.remove()
    _after_change(obj, [patch.root for patch in patches])
    return obj, [patch.root for patch in patches]


@contextlib.contextmanager
def observe(model: Any, timing: bool = False, sync: Optional[Callable[[], None]] = None) -> Iterator[Observation]:
    """Record what every ToMe patch inside `model` (a pipeline or a model) does while the block runs.

    timing: also add up the seconds in ToMe's own work per kind (`Observation.seconds`); `sync` is
    called before and after each timed piece (pass `torch.cuda.synchronize` on a GPU).
    Raises ValueError when `model` holds no ToMe patch (there would be nothing to observe)."""
    patches = installed_patches(model)
    if not patches:
        raise ValueError(f"{type(model).__name__} holds no ToMe patch: apply_patch first, then observe it")
    observation = Observation(timing, sync)
    for patch in patches:
        patch.observers.append(observation)
    try:
        yield observation
    finally:
        for patch in patches:
            if observation in patch.observers:
                patch.observers.remove(observation)
