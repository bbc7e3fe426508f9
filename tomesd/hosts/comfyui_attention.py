"""ComfyUI's attention override as proportional attention's seam, under whichever attention function ComfyUI runs.

ComfyUI picks one attention function at start-up (SageAttention with --use-sage-attention, FlashAttention with
--use-flash-attention, xformers, torch's SDPA, and on a CPU the sub-quadratic or split one), and every model calls it
through `comfy.ldm.modules.attention.wrap_attn`, which hands the call to
`transformer_options["optimized_attention_override"](func, *args, **kwargs)` where one is set. While a ToMe node's
patch weighs merged keys, its wrapper (comfyui_patcher.py) sets one for its own model calls, over any override another
node set, which it then calls in turn. An attention that proportional attention's hook armed (key_weights.arm, on the
patch's key seam) gets the bias channel here, in the [B, heads, S, D] layout every function takes (skip_reshape), so
the function runs on heads one channel wider (torch_sdpa.KeyWeights.widened_for_default_scale) and the output drops
it. Unarmed calls pass as they came. The SDPA seam behind it finds the arming taken.

A kernel whose ceiling on the head size the channel would pass (SageAttention: 128) is refused by name at the call,
rather than left to ComfyUI's own fallback to torch's SDPA, which would run every attention slower than the kernel the
user picked. A kernel that another node's override routes to is not known here: its own limits raise its own error.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

from ..backends.torch_sdpa import KeyWeights, channels

OVERRIDE_KEY = "optimized_attention_override"

# ComfyUI's attention functions (comfy.ldm.modules.attention, by their own name) whose kernel takes heads of at
# most so many channels: (the kernel, its ceiling, the start-up switch that picks it)
_HEAD_CEILINGS = {
    "attention_sage": ("SageAttention", 128, "--use-sage-attention"),  # sageattn raises past 128
    "attention_flash": ("FlashAttention", 256, "--use-flash-attention"),
}
# Where ComfyUI's attention functions take what they take positionally: q, k, v, heads, mask
_HEADS, _MASK = 3, 4


class WeighingOverride:
    """The override one ToMe wrapper sets: weighs an armed call's merged keys, then runs `previous` (another node's
    override) or ComfyUI's function."""

    __slots__ = ("seam", "previous")

    def __init__(self, seam: Any, previous: Optional[Callable] = None) -> None:
        self.seam, self.previous = seam, previous

    def __call__(self, func: Callable, *args: Any, **kwargs: Any) -> Any:
        arming = self.seam.armed()
        if arming is None or type(arming.rewrite) is not KeyWeights or not arming.take():  # _run inline: every call
            previous = self.previous
            return func(*args, **kwargs) if previous is None else previous(func, *args, **kwargs)
        # The arming's other uses (SD3.5's second attention) are for later calls, not for the SDPA call inside this one
        left, arming.left = arming.left, 0
        try:
            return self._weighed(arming.rewrite, func, args, kwargs)
        finally:
            arming.left = left

    def _run(self, func: Callable, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        if self.previous is not None:
            return self.previous(func, *args, **kwargs)
        return func(*args, **kwargs)

    def _weighed(self, weights: KeyWeights, func: Callable, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        query, key, value = args[:3]
        rest = dict(kwargs)
        heads = args[_HEADS] if len(args) > _HEADS else rest.pop("heads", None)
        mask = args[_MASK] if len(args) > _MASK else rest.pop("mask", None)
        if len(args) > _MASK + 1 or heads is None:
            raise ValueError(f"ToMe's proportional attention expects ComfyUI's attention call as (q, k, v, heads, "
                             f"mask=..., ...), got {len(args)} positional arguments; turn proportional_attention off")
        if mask is not None:
            raise ValueError("ToMe's proportional attention weighs merged keys in ComfyUI's attention call, which here "
                             "got an attention mask; turn proportional_attention off")
        split = not rest.pop("skip_reshape", False)
        if weights.uniform and key.shape[1 if split else 2] == weights.log_sizes.shape[-1]:
            return self._run(func, args, kwargs)  # every key holds as many tokens: the weights cancel
        if split:  # [B, S, heads * D] -> [B, heads, S, D], as ComfyUI's functions read them (SD3's values come 4-D)
            batch, size = query.shape[0], query.shape[-1] // heads
            query, key, value = (t.reshape(batch, -1, heads, size).transpose(1, 2) for t in (query, key, value))
        gather = rest.pop("skip_output_reshape", False)
        size = query.shape[-1]
        pad = channels(size, query.device)
        _check_ceiling(func, size, pad)
        query, key, value, width = weights.widened_for_default_scale(query, key, value, pad)
        out = self._run(func, (query, key, value, heads), dict(rest, skip_reshape=True, skip_output_reshape=True))
        if out.dim() == 3:  # a path that gathers the heads anyway (pytorch past its batch limit, xformers' fallback)
            out = out.unflatten(-1, (heads, -1)).transpose(1, 2)
        out = out[..., :width]
        return out if gather else out.transpose(1, 2).flatten(2)


def _check_ceiling(func: Callable, size: int, pad: int) -> None:
    ceiling = _HEAD_CEILINGS.get(getattr(func, "__name__", ""))
    if ceiling is not None and size + pad > ceiling[1]:
        kernel, most, switch = ceiling
        raise ValueError(
            f"ToMe's proportional attention adds a channel to each attention head, and {kernel} (ComfyUI's {switch}) "
            f"takes heads of at most {most} channels: this model's have {size}. Turn proportional_attention off on "
            f"the ToMe node (it still merges), or start ComfyUI with --use-pytorch-cross-attention")


def with_override(options: Dict[str, Any], seam: Any) -> Dict[str, Any]:
    """A copy of one model call's transformer_options carrying a ToMe override over whatever override was there."""
    previous = options.get(OVERRIDE_KEY)
    return dict(options, **{OVERRIDE_KEY: WeighingOverride(seam, previous)})
