"""tomesd 0.1.3's `tomesd.patch` functions beyond apply_patch and remove_patch, as hosts call them.

- compute_merge(x, tome_info) and hook_tome_model(model) work as tomesd's did on a `_tome_info` the caller keeps
  (kohya's training scripts patch their own blocks with them): the first returns the six merge and unmerge
  functions of a block from tomesd's settings dict, the second records the latent's size into it.
- make_tome_block and make_diffusers_tome_block built block subclasses whose forward was a copy of the host's. This
  package patches by hooks on sub-layers instead, so it has no such classes: they refuse, naming apply_patch.
- A host that replaces `tomesd.patch.make_tome_block` with its own (SD.Next's DirectML hook) expects apply_patch to
  build blocks with it. apply_patch never would, so it refuses rather than ignore the replacement."""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, Tuple


def compute_merge(x: Any, tome_info: Dict[str, Any]) -> Tuple[Callable, ...]:
    """(m_a, m_c, m_m, u_a, u_c, u_m) for a block's tokens `x` [B, N, C] from tomesd's `tome_info`: "size" (the
    latent's h, w) and "args" (ratio, max_downsample, sx, sy, use_rand, generator, merge_attn, merge_crossattn,
    merge_mlp). The merge is tomesd's: the same generator state draws the same dst pattern, and an odd batch never
    draws one. `args["generator"]` is made, or remade for a new device, from that device's RNG, as tomesd did."""
    from .merge import bipartite_soft_matching_random2d, do_nothing
    from .utils import init_generator

    h0, w0 = tome_info["size"]
    args = tome_info["args"]
    n = x.shape[1]
    level = int(math.ceil(math.sqrt(h0 * w0 // n)))  # how far this block's grid is downsampled from the latent
    m = u = do_nothing
    if level <= args["max_downsample"]:
        generator = args.get("generator")
        if generator is None:
            generator = args["generator"] = init_generator(x.device)
        elif generator.device != x.device:
            generator = args["generator"] = init_generator(x.device, fallback=generator)
        # an odd batch cannot hold a prompt and its negative together: no random pattern (tomesd's rule)
        use_rand = args["use_rand"] and x.shape[0] % 2 == 0
        m, u = bipartite_soft_matching_random2d(x, int(math.ceil(w0 / level)), int(math.ceil(h0 / level)),
                                                args["sx"], args["sy"], int(n * args["ratio"]),
                                                no_rand=not use_rand, generator=generator)
    sites = [(m, u) if args[flag] else (do_nothing, do_nothing) for flag in ("merge_attn", "merge_crossattn", "merge_mlp")]
    return tuple(f for f, _ in sites) + tuple(g for _, g in sites)


def hook_tome_model(model: Any) -> None:
    """A forward pre-hook on `model` writing its input latent's (h, w) into `model._tome_info["size"]`, its handle
    kept in `_tome_info["hooks"]` (tomesd's remove_patch, or the caller, removes it)."""
    info = getattr(model, "_tome_info", None)
    if not isinstance(info, dict) or not isinstance(info.get("hooks"), list):
        raise TypeError(
            f"hook_tome_model needs the {type(model).__name__}'s _tome_info dict with a 'hooks' list, as tomesd 0.1.3's "
            f"apply_patch made it; this tomesd keeps no _tome_info: tomesd.apply_patch(model, ...) patches the model "
            f"and finds the latent's size itself")

    def size_of_input(module: Any, args: Tuple[Any, ...]) -> None:
        module._tome_info["size"] = (args[0].shape[2], args[0].shape[3])

    info["hooks"].append(model.register_forward_pre_hook(size_of_input))


def _no_block_classes(name: str) -> Callable[[Any], Any]:
    def factory(block_class: Any) -> Any:
        raise TypeError(
            f"tomesd.patch.{name}({getattr(block_class, '__name__', block_class)}): this tomesd builds no patched "
            f"block classes (tomesd 0.1.3's copied the block's forward); it patches a model in place by hooks on "
            f"its sub-layers: tomesd.apply_patch(model, ratio=...) on the model, and tomesd.remove_patch(model)")

    factory.__name__ = factory.__qualname__ = name
    factory.__doc__ = f"tomesd 0.1.3's {name}: refused here, naming tomesd.apply_patch (this module's docstring)."
    return factory


make_tome_block = _no_block_classes("make_tome_block")
make_diffusers_tome_block = _no_block_classes("make_diffusers_tome_block")
_FACTORIES = {"make_tome_block": make_tome_block, "make_diffusers_tome_block": make_diffusers_tome_block}


def refuse_replaced(namespace: Dict[str, Any]) -> None:
    """Refuse, before anything is patched, where a host has replaced tomesd.patch's block factories (`namespace`:
    that module's globals): apply_patch would never call the replacement."""
    for name, own in _FACTORIES.items():
        found = namespace.get(name)
        if found is not own:
            where = getattr(found, "__module__", None) or type(found).__name__
            raise RuntimeError(
                f"tomesd.patch.{name} was replaced (by {where}), as tomesd 0.1.3's apply_patch would build its blocks "
                f"with it; this tomesd patches by hooks and never calls it, so the replacement cannot take effect. "
                f"Set it back (tomesd.patch.{name} = tomesd.compat013.{name}) and apply_patch patches the model by its "
                f"own hooks; or keep tomesd==0.1.3 for the host's own block")
