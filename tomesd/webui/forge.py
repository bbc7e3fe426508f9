"""Forge (and reForge): their token merging answered by this project (the extension: scripts/tomesd_webui.py).

Forge keeps A1111's three ratio settings and infotext, but its `apply_token_merging` runs its own copy of ComfyUI's
ToMe: each pass it calls `backend.misc.tomesd.TomePatcher().patch(model=unet, ratio=r)` on a fresh clone of its
`UnetPatcher` (a ComfyUI-style ModelPatcher) and samples with what comes back. The extension points that name at a
class `forge_tome_patcher` makes: its `patch` returns a clone carrying a `model_function_wrapper` (the ModelPatcher
interface Forge shares with ComfyUI, which still calls it), and around each model call of that clone the wrapper puts
the patch's hooks on the diffusion model and takes them off again, as comfyui_patcher.ComfyToMe does around
ComfyUI's calls. The blocks and sites are the ones every host uses (tomesd/families/): Forge's UNet's
BasicTransformerBlocks. Its Flux is refused by name: its blocks call an attention function of Forge's own, which no
family here places."""
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

    def __init__(self, args: Any, previous: Optional[Callable] = None) -> None:
        super().__init__(args)
        self.previous = previous

    def __deepcopy__(self, memo: dict) -> "ForgeToMe":
        return self  # Forge's clone deep-copies model_options: its clones share this wrapper as ComfyUI's do

    def __call__(self, apply_model: Callable, params: dict) -> Any:
        """model_options["model_function_wrapper"](model.apply_model, {"input", "timestep", "c", ...})."""
        net = apply_model.__self__.diffusion_model
        patch = self.prepare(net)
        _refuse_attn1_patches(patch, params["c"].get("transformer_options", {}))
        patch.install(mark=False)
        try:
            if self.previous is not None:
                return self.previous(apply_model, params)
            return apply_model(params["input"], params["timestep"], **params["c"])
        finally:
            patch.detach()


def forge_tome_patcher(choice: Callable[[], WebUIChoice], size: Callable[[], Optional[Tuple[int, int]]] = lambda: None,
                       say: Callable[[str], None] = print) -> type:
    """A class to stand where Forge's `backend.misc.tomesd.TomePatcher` stood: `TomePatcher().patch(model, ratio)`."""
    from ..patch import resolve

    class TomePatcher:
        def patch(self, model: Any, ratio: float) -> Any:
            net = model.model.diffusion_model
            try:
                arguments = choice_arguments(
                    choice(), ratio, dict(use_rand=False), sdxl=lambda: _is_sdxl(net),
                    device=lambda: str(getattr(model, "load_device", "cpu")).split(":")[0], size=size,
                    attention=_forge_attention)
                args = resolve(arguments.pop("config", None), arguments)
                wrapper = ForgeToMe(args, previous=model.model_options.get("model_function_wrapper"))
                patch = wrapper.prepare(net)  # the library's refusals, before the clone is made
                if not set(patch.kind_names) <= FORGE_BLOCKS:
                    raise TypeError(f"{type(net).__name__} in Forge: this extension merges Forge's UNets (SD1, SD2, "
                                    f"SDXL) and Flux. Set the token merging ratio to 0 for this model")
            except REFUSALS as refusal:
                say(refusal_line(refusal))
                return model
            clone = model.clone()
            clone.set_model_unet_function_wrapper(wrapper)
            return clone

    return TomePatcher


def _forge_attention() -> Optional[str]:
    """Forge's attention function where it is not its torch-SDPA one (xformers, sub-quadratic, split), else None."""
    attention = sys.modules.get("backend.attention")
    function = getattr(attention, "attention_function", None)
    name = getattr(function, "__name__", None)
    return None if name in (None, "attention_pytorch") else name


def _is_sdxl(net: Any) -> bool:
    """Forge's (and ComfyUI's) UNet config: SDXL's added embeddings come in by `adm_in_channels` (2816)."""
    config = getattr(net, "config", None)
    channels = getattr(config, "adm_in_channels", None) if config is not None else getattr(net, "adm_in_channels", None)
    return bool(channels) and int(channels) >= 2048


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
