"""Forge: its token merging answered by this project (the extension: scripts/tomesd_webui.py).

Forge keeps A1111's three ratio settings and infotext, but its `apply_token_merging` runs its own copy of ComfyUI's
ToMe: each pass it calls `backend.misc.tomesd.TomePatcher().patch(model=unet, ratio=r)` on the pass's `UnetPatcher` (a
ComfyUI-style ModelPatcher) and samples with what comes back. The extension points that name at a class
`forge_tome_patcher` makes: its `patch` returns a clone carrying a `model_function_wrapper` (the ModelPatcher
interface Forge shares with ComfyUI, which still calls it), and around each model call of that clone the wrapper puts
the patch's hooks on the diffusion model and takes them off again, as comfyui_patcher.ComfyToMe does around
ComfyUI's calls. The blocks and sites are the ones every host uses (tomesd/families/): Forge's UNets'
BasicTransformerBlocks and its Flux's blocks (root kind "Flux (Forge)"). reForge, whose token merging lives under
other module names, is not covered.

Forge's own extensions may act after token merging in the same pass: one that sets a self-attention patch (PAG, SAG,
StyleAlign) makes the wrapper run those calls unpatched, saying so once; one that sets its own model function wrapper
(MultiDiffusion) replaces ours, which `rechain` then puts back around it (the extension's script calls it in its
`process_before_every_sampling`, which runs after the built-in extensions')."""
from __future__ import annotations

import sys
from typing import Any, Callable, Optional, Tuple

from ..hosts.comfyui_patcher import ComfyToMe, _refuse_attn1_patches
from ..hosts.targets import PATCH_FINDERS
from .a1111 import REFUSALS, WebUIChoice, choice_arguments, refusal_line

# Forge's UNets' blocks, and its Flux's (Black Forest Labs' layout, as ComfyUI's)
FORGE_BLOCKS = {"BasicTransformerBlock", "DoubleStreamBlock", "SingleStreamBlock"}


class ForgeToMe(ComfyToMe):
    """The `model_function_wrapper` of one patched clone: `previous`, a wrapper the model carried already, runs
    inside it."""

    def __init__(self, args: Any, previous: Optional[Callable] = None, say: Callable[[str], None] = print) -> None:
        super().__init__(args)
        self.previous = previous
        self._say = say
        self._said = False

    def __deepcopy__(self, memo: dict) -> "ForgeToMe":
        return self  # Forge's clone deep-copies model_options: its clones share this wrapper as ComfyUI's do

    def __call__(self, apply_model: Callable, params: dict) -> Any:
        """model_options["model_function_wrapper"](model.apply_model, {"input", "timestep", "c", ...})."""
        net = apply_model.__self__.diffusion_model
        patch = self.prepare(net)
        try:
            _refuse_attn1_patches(patch, params["c"].get("transformer_options", {}))
        except ValueError as refusal:  # another extension's self-attention patch, set after token merging
            if not self._said:
                self._said = True
                self._say(refusal_line(refusal))
            return self._inner(apply_model, params)
        patch.install(mark=False)
        try:
            return self._inner(apply_model, params)
        finally:
            patch.detach()

    def around(self, previous: Callable) -> "ForgeToMe":
        """This wrapper's settings and patch (built once) around `previous`, another extension's wrapper."""
        again = ForgeToMe(self.args, previous=previous, say=self._say)
        again._patches, again._lock = self._patches, self._lock
        return again

    def _inner(self, apply_model: Callable, params: dict) -> Any:
        if self.previous is not None:
            return self.previous(apply_model, params)
        return apply_model(params["input"], params["timestep"], **params["c"])


def forge_tome_patcher(choice: Callable[[], WebUIChoice], size: Callable[[], Optional[Tuple[int, int]]] = lambda: None,
                       say: Callable[[str], None] = print) -> type:
    """A class to stand where Forge's `backend.misc.tomesd.TomePatcher` stood: `TomePatcher().patch(model, ratio)`.
    `TomePatcher.last` is the wrapper its latest patch put on (None after a refusal), for `rechain` in that pass."""
    from ..patch import resolve

    class TomePatcher:
        last: Optional[ForgeToMe] = None

        def patch(self, model: Any, ratio: float) -> Any:
            net = model.model.diffusion_model
            TomePatcher.last = None
            try:
                arguments = choice_arguments(
                    choice(), ratio, dict(use_rand=False), family=lambda: _family(net),
                    device=lambda: str(getattr(model, "load_device", "cpu")).split(":")[0], size=size,
                    attention=_forge_attention)
                args = resolve(arguments.pop("config", None), arguments)
                wrapper = ForgeToMe(args, previous=model.model_options.get("model_function_wrapper"), say=say)
                patch = wrapper.prepare(net)  # the library's refusals, before the clone is made
                if not set(patch.kind_names) <= FORGE_BLOCKS:
                    raise TypeError(f"{type(net).__name__} in Forge: this extension merges Forge's UNets (SD1, SD2, "
                                    f"SDXL) and Flux. Set the token merging ratio to 0 for this model")
            except REFUSALS as refusal:
                say(refusal_line(refusal))
                return model
            clone = model.clone()
            clone.set_model_unet_function_wrapper(wrapper)
            TomePatcher.last = wrapper
            return clone

    return TomePatcher


def _forge_attention() -> Optional[str]:
    """Forge's attention function where it is not its torch-SDPA one (xformers, sub-quadratic, split), else None."""
    attention = sys.modules.get("backend.attention")
    function = getattr(attention, "attention_function", None)
    name = getattr(function, "__name__", None)
    return None if name in (None, "attention_pytorch") else name


def _family(net: Any) -> str:
    """recommend's family of Forge's diffusion model: Flux by its blocks; SDXL by its UNet config's added embeddings
    (`adm_in_channels`, 2816); else SD1/SD2."""
    if any(type(module).__name__ == "DoubleStreamBlock" for module in net.modules()):
        return "flux"
    config = getattr(net, "config", None)
    channels = getattr(config, "adm_in_channels", None) if config is not None else getattr(net, "adm_in_channels", None)
    return "sdxl" if channels and int(channels) >= 2048 else "sd1"


def rechain(unet: Any, wrapper: Optional[ForgeToMe]) -> Any:
    """`unet` (the pass's UNet patcher) as the sampler will get it: where another extension set its own model
    function wrapper after token merging put `wrapper` there, a clone whose wrapper is a copy of `wrapper` holding
    that one inside it (its calls then run merged); else `unet` itself."""
    current = unet.model_options.get("model_function_wrapper")
    if wrapper is None or current is None or isinstance(current, ForgeToMe):
        return unet
    clone = unet.clone()
    clone.set_model_unet_function_wrapper(wrapper.around(current))
    return clone


def forge_patches(obj: Any) -> list:
    """The patches a Forge UNet patcher's wrapper holds (for tomesd.observe), or [] for anything else."""
    options = getattr(obj, "model_options", None)
    wrapper = options.get("model_function_wrapper") if isinstance(options, dict) else None
    return wrapper.patches if isinstance(wrapper, ForgeToMe) else []


PATCH_FINDERS.append(forge_patches)


def install(misc_tomesd: Any, patcher: type) -> type:
    """Points Forge's `backend.misc.tomesd.TomePatcher` (looked up at each pass) at `patcher`; returns the old one."""
    previous = getattr(misc_tomesd, "TomePatcher", None)
    if previous is None:
        raise RuntimeError("this Forge has no backend.misc.tomesd.TomePatcher: the extension leaves its token "
                           "merging as it is")
    misc_tomesd.TomePatcher = patcher
    return previous
