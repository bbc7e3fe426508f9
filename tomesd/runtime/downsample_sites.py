"""Downsample mode's hooks (ToDo): self-attention only, queries full. On attn1 (UNets, PixArt, DiT) a pre-hook
passes the downsampled tokens as the attention's own context argument, so the host's attention module and
processor compute keys and values from them; on SD3's joint attention the image key and value projections
take the downsampled tokens; on Flux and Wan the rotated keys and values shrink at diffusers' attention
dispatch; on a fused attention (fuse_qkv_projections: one to_qkv) they shrink inside its SDPA call (arm_fused). With
restore_tokens, DownsampleRestore wraps the first two kinds of attention outermost (it runs the
module twice at a window's first step), and DispatchRestore runs the last kind's attention call twice there.
"""
from __future__ import annotations

import functools
from typing import Any, Optional

from . import key_weights, restore
from .guards import MASKED_DOWNSAMPLE, check_fused, fused
from ..layouts.signatures import InputSpec
from .sites import SiteHook


class DownsampleContext(SiteHook):
    """Self-attention given the downsampled tokens as its context argument (keys and values)."""

    def __init__(self, patch: Any, index: int, tokens: InputSpec, context: Optional[InputSpec],
                 mask: InputSpec) -> None:
        super().__init__(patch, index)
        self.tokens, self.context, self.mask = tokens, context, mask
        self._unfused: Any = None  # the processor last found unfused (fused() asked again when it changes)

    def pre(self, module: Any, args: tuple, kwargs: dict) -> Any:
        # calls.top, block_merge and InputSpec's get and replace inline: every downsampled block of every call
        patch, index = self.patch, self.index
        calls = patch.calls
        call = calls.innermost if calls.direct else calls.top()
        spec = self.tokens
        x = args[spec.index] if spec.index is not None and len(args) > spec.index else kwargs.get(spec.name)
        if call is None:
            down = patch.block_merge(call, index, x)
        else:
            if index in call.pending:  # the block's first hooked sub-layer: downsample now
                patch.settle(call, index, x)
            down = call.merges.get(index)
        if down is None:
            return None
        context = self.context
        if context is None:
            return None
        at = context.index is not None and len(args) > context.index
        if (args[context.index] if at else kwargs.get(context.name)) is not None:
            return None  # keys/values already come from elsewhere (only_cross_attention): nothing to downsample
        processor = getattr(module, "processor", None)  # fused_now's kept answer inline: every downsampled attention
        is_fused = False if processor is not None and processor is self._unfused and (call is None or call.eager) \
            else fused_now(self, module, call)
        mask = self.mask  # InputSpec.get inline
        if (args[mask.index] if mask.index is not None and len(args) > mask.index else kwargs.get(mask.name)) \
                is not None:
            raise ValueError(MASKED_DOWNSAMPLE)
        if is_fused:  # one to_qkv: no context argument to hand the keys' input, they shrink in its SDPA call
            arm_fused(patch, module, down, call)
            return None
        if call is None or call.watch is None:
            small = down(x)
        else:
            small = self._timed(call, "downsample", down, x)
            self._record(call, "downsample", x, small)
        if patch.key_seam is not None:  # armed inside the attention's own forward (CheckWeighed.pre), where
            if call is not None:         # a step cache that skips the attention skips the arming too
                # (a block's own call holds one block: its index is left unread, CallState.for_block)
                call.shared[("weigh", index if call.row is None else None)] = down
        if at:
            i = context.index
            return args[:i] + (small,) + args[i + 1:], kwargs
        return args, {**kwargs, context.name: small}


class DownsampleProjection(SiteHook):
    """A key or value projection of image tokens: it projects the downsampled grid instead."""

    def __init__(self, patch: Any, index: int, attention: Any, name: str, image_keys_first: bool = False) -> None:
        super().__init__(patch, index)
        self.attention, self.name, self.image_keys_first = attention, name, image_keys_first

    def pre(self, module: Any, args: tuple, kwargs: dict) -> Any:
        patch, index = self.patch, self.index  # calls.top and block_merge inline (every downsampled block)
        calls = patch.calls
        call = calls.innermost if calls.direct else calls.top()
        x = args[0] if args else kwargs.get("input")
        if call is None:
            down = patch.block_merge(call, index, x)
        else:
            if index in call.pending:  # the block's first hooked sub-layer: downsample now
                patch.settle(call, index, x)
            down = call.merges.get(index)
        if down is None:
            return None
        modules = getattr(self.attention, "_modules", None)  # a dict read: no module __getattr__ (a Python call)
        current = modules.get(self.name) if modules is not None else None
        if (current if current is not None else getattr(self.attention, self.name)) is not module:
            # Wrapped after apply_patch (a LoRA adapter: the wrapper feeds this layer and its own
            # branch the same input, and only this one would shrink).
            raise ValueError(
                f"{type(self.attention).__name__}.{self.name} was replaced after apply_patch (by a LoRA adapter or "
                f"another wrapper), so mode='downsample' can no longer shrink its input alone. Call apply_patch "
                f"again after loading adapters."
            )
        x = args[0] if args else kwargs["input"]
        # to_k and to_v project the same tensor: downsample it once. One slot per call, overwritten by
        # the next attention, so no block's input outlives its attention.
        last = call.shared.get("projected") if call is not None else None
        if last is not None and last[0] is x:
            small = last[1]
        else:
            if call is None or call.watch is None:
                small = down(x)
            else:
                small = self._timed(call, "downsample", down, x)
                self._record(call, "downsample", x, small)  # once per attention: to_v reuses to_k's
            if call is not None:
                call.shared["projected"] = (x, small)
            if patch.key_seam is not None:  # weigh_downsampled inline
                key_weights.arm(patch, down, self.image_keys_first)
        return ((small,) + args[1:], kwargs) if args else (args, {**kwargs, "input": small})


class FusedKeys(SiteHook):
    """A joint attention whose keys DownsampleProjection shrinks at to_k and to_v, fused after all
    (fuse_qkv_projections, SD3): those never run then, so its keys shrink inside its SDPA call (arm_fused)."""

    def __init__(self, patch: Any, index: int) -> None:
        super().__init__(patch, index)
        self._unfused: Any = None  # the processor last found unfused (fused() asked again when it changes)

    def pre(self, module: Any, args: tuple, kwargs: dict) -> None:
        processor = getattr(module, "processor", None)
        if processor is not None and processor is self._unfused:  # fused_now's kept answer inline: every attention
            return
        call = self.patch.calls.top()
        if not fused_now(self, module, call):
            return
        down = self.patch.block_merge(call, self.index, args[0] if args else kwargs.get("hidden_states"))
        if down is not None:
            arm_fused(self.patch, module, down, call)


def fused_now(hook: Any, module: Any, call: Any) -> bool:
    """Whether the attention `module` runs fused now (guards.fused). Eagerly, a processor found unfused is kept on
    `hook._unfused` and not asked about again until it changes (fused() asks its type first); traced, it is asked as the
    graph is made and nothing is kept (it would be guarded)."""
    processor = getattr(module, "processor", None)
    if call is not None and not call.eager:
        return fused(module)
    if processor is not None and processor is hook._unfused:
        return False
    is_fused = fused(module)
    hook._unfused = processor if "Fused" not in type(processor).__name__ else None
    return is_fused


def open_fused_seam(patch: Any) -> Any:
    """torch's SDPA seam, where a fused attention's keys shrink and are weighed (arm_fused): opened for this patch
    unless it is open already as the key weights' seam."""
    seam = patch.host.key_weight_seam()
    if patch.key_seam is not seam and patch.fused_seam is None:
        patch.fused_seam = seam
        seam.open(patch)
    return seam


def arm_fused(patch: Any, attention: Any, down: Any, call: Any) -> None:
    """The fused `attention`'s next SDPA call takes its image keys and values downsampled by `down` (and weighs them,
    under proportional attention): the host's SDPA seam, opened for this patch at the first fused attention. An
    arming its attention left untaken (no SDPA call inside: a function swapped in for torch's) is refused at the
    next one."""
    check_fused(attention, patch.host, patch.args.downsample_method)
    # Opened at install where the attention was fused already, else here (fused after apply_patch: a compile traced
    # before any eager call then compiles once more)
    seam = open_fused_seam(patch)
    eager = None if call is None else call.eager
    if eager is not False:
        left = seam.armed()
        if left is not None and left.left > 0 and type(left.rewrite).__name__ == "ShrunkKeys":
            raise RuntimeError(
                f"mode='downsample' found no call of torch's scaled_dot_product_attention inside a fused "
                f"{type(attention).__name__} (processor {type(getattr(attention, 'processor', None)).__name__}), so its "
                f"keys were not downsampled; call unfuse_qkv_projections(), or use mode='merge'")
    weights = None
    if patch.key_seam is not None:  # proportional attention: the kept keys weighed in the same call
        weights = patch.host.key_weights(down.inv_counts, True, getattr(down, "uniform", False))
    seam.arm(patch.host.shrunk_keys(down, weights), 1, eager)


class DownsampleDispatch(SiteHook):
    """Self-attention whose processor rotates keys itself (Flux, Wan): seated innermost around the attention
    module, it arms the host's attention dispatch (`patch.seam`, backends/torch_dispatch.py) so the
    processor's one attention call gets its rotated keys and values with the image rows downsampled."""

    def __init__(self, patch: Any, index: int, attention: str, tokens: InputSpec) -> None:
        super().__init__(patch, index)
        self.attention, self.tokens = attention, tokens

    def pre(self, module: Any, args: tuple, kwargs: dict) -> None:
        patch, index = self.patch, self.index  # calls.top, block_merge and InputSpec.get inline (every block)
        calls = patch.calls
        call = calls.innermost if calls.direct else calls.top()
        spec = self.tokens
        x = args[spec.index] if spec.index is not None and len(args) > spec.index else kwargs.get(spec.name)
        if call is None:
            down = patch.block_merge(call, index, x)
        else:
            if index in call.pending:  # the block's first hooked sub-layer: downsample now
                patch.settle(call, index, x)
            down = call.merges.get(index)
        kept = None if call is None or call.restore is None else call.restoring.get(index)
        eager = None if call is None else call.eager  # where the seam arms: the call says, the host is not asked
        if kept is not None:  # restore_tokens: at the dispatch, where only the attention itself runs twice
            patch.seam.arm(DispatchRestore(self, kept[1], restore._key(self, module, 0, call.restore.ordinal),
                                           call.restore), 1, eager)
        elif down is not None:
            patch.seam.arm(functools.partial(self._shrink, down), 1, eager)
            if patch.key_seam is not None:
                weigh_downsampled(patch, down, False)

    def post(self, module: Any, args: tuple, output: Any) -> None:
        calls = self.patch.calls
        call = calls.innermost if calls.direct else calls.top()
        if not self.patch.seam.disarm(None if call is None else call.eager):
            raise RuntimeError(
                f"mode='downsample' found no attention call of diffusers' dispatch inside "
                f"{type(module).__name__} (processor {type(getattr(module, 'processor', None)).__name__}), so "
                f"its keys were not downsampled; use mode='merge' or diffusers' own processor"
            )

    def _shrink(self, down: Any, kwargs: dict) -> dict:
        """The backend's keyword arguments with the image rows (the last N) of keys and values downsampled."""
        if kwargs.get("attn_mask") is not None or kwargs.get("_parallel_config") is not None:
            self._refuse(kwargs)
        key, value = kwargs["key"], kwargs["value"]
        n, k, v = down.num_tokens, key.shape, value.shape  # key.shape: the host's tensors' own (no framework call)
        if len(k) != 4 or k[1] < n or tuple(v[:2]) != tuple(k[:2]):
            shape = self.patch.xp.shape
            raise ValueError(
                f"mode='downsample' expected {self._name()}'s keys and values to end with the {n} image tokens "
                f"[B, S, heads, dim], got {list(shape(key))} and {list(shape(value))}; use mode='merge'")
        calls = self.patch.calls
        call = calls.innermost if calls.direct else calls.top()
        if call is not None and call.watch is not None:
            small_key = self._timed(call, "downsample", down.shrink_tail, key)
            text = k[1] - n
            self._record(call, "downsample", key[:, text:], small_key[:, text:])
            small_value = self._timed(call, "downsample", down.shrink_tail, value)
        else:
            small_key, small_value = down.shrink_tails(key, value)
        if self.patch.seam.observers and not self.patch.host.is_compiling():
            for observe in self.patch.seam.observers:
                observe(n, down.num_kept)
        return {**kwargs, "key": small_key, "value": small_value}

    def _name(self) -> str:
        return f"{self.patch.kind_names[self.index]}.{self.attention}"

    def _refuse(self, kwargs: dict) -> None:
        if kwargs.get("attn_mask") is not None:
            raise ValueError(f"{MASKED_DOWNSAMPLE} ({self._name()}); use mode='merge'")
        raise ValueError(
            f"mode='downsample' does not run under diffusers' context parallelism ({self._name()}): each rank holds "
            f"part of the keys; run the model on one process or without ToMe there")


class DispatchRestore:
    """restore_tokens at diffusers' attention dispatch (Flux, Wan: keys arrive there rotated and normalised, so
    downsampling them there is exactly what a downsampled step does): at a window's first step the backend runs
    with every key and again with the downsampled ones, and the site keeps the first output minus the second; the
    window's later steps run it downsampled and add that. Only the attention itself runs twice, not the module's
    projections (DownsampleRestore's way, for the attentions that downsample before projecting)."""

    __slots__ = ("hook", "down", "key", "restoring")

    def __init__(self, hook: DownsampleDispatch, down: Any, key: tuple, restoring: Any) -> None:
        self.hook, self.down, self.key, self.restoring = hook, down, key, restoring

    def around(self, fn: Any, kwargs: dict) -> Any:
        residuals, restoring, patch = self.restoring.cache.residuals, self.restoring, self.hook.patch
        if restoring.keep:
            full = fn(**kwargs)
            weigh_downsampled(patch, self.down, False)  # the downsampled run's keys alone are weighed
            residuals[self.key] = (restoring.window, full - fn(**self.hook._shrink(self.down, kwargs)))
            return full
        weigh_downsampled(patch, self.down, False)
        out = fn(**self.hook._shrink(self.down, kwargs))
        found = residuals.get(self.key)
        if found is None or found[0] != restoring.window or patch.xp.shape(found[1]) != patch.xp.shape(out):
            return out
        return out + found[1]


def weigh_downsampled(patch: Any, down: Any, image_keys_first: bool) -> None:
    """Proportional attention in downsample mode: each kept key weighs as the tokens of its cell."""
    if patch.key_seam is not None:
        key_weights.arm(patch, down, image_keys_first)


class CheckWeighed(SiteHook):
    """Innermost around a downsampled self-attention under proportional attention: arms the weights of keys its
    context argument got downsampled (DownsampleContext, an outer pre-hook, leaves them in the call), and checks
    after it that its SDPA call took whatever was armed (here or inside its forward)."""

    def pre(self, module: Any, args: tuple, kwargs: dict) -> None:
        call = self.patch.calls.top()
        down = call.shared.pop(("weigh", self.index if call.row is None else None), None) if call is not None else None
        if down is not None:
            weigh_downsampled(self.patch, down, False)

    def post(self, module: Any, args: tuple, output: Any) -> None:
        if self.patch.key_seam is not None:
            key_weights.check_weighed(self.patch, module)


class DownsampleRestore(SiteHook):
    """restore_tokens in downsample mode, outermost of ToMe's links on an attention whose context argument or key and
    value projections take the downsampled tokens (`wrap`; DispatchRestore does it at the dispatch): at a
    window's first step the block does not downsample, and this runs the attention a second time with its keys
    downsampled and keeps, for each tensor it outputs (SD3's joint attention: image and text), the output with
    every key minus the output with the downsampled ones; the window's later steps add it to what they compute.
    The attention's queries are all there at every step, so the residual holds for each token as it was: unlike
    merge mode's, it needs no row and restores every output, the text's included. A residual serves only the
    window it was taken in."""

    def __init__(self, patch: Any, index: int, tokens: InputSpec) -> None:
        super().__init__(patch, index)
        self.tokens = tokens

    def wrap(self, module: Any, inner: Any, args: tuple, kwargs: dict) -> Any:
        call = self.patch.calls.top()
        if call is None or call.restore is None:
            return inner(*args, **kwargs)
        self.patch.current_merge(self.index, self.tokens.get(args, kwargs))  # settles the block's downsampling
        kept = call.restoring.get(self.index)
        if kept is None:  # this block does not downsample (a level max_downsample leaves out)
            return inner(*args, **kwargs)
        residuals, restoring = call.restore.cache.residuals, call.restore
        if restoring.keep:
            full = inner(*args, **kwargs)
            call.merges[self.index] = kept[1]
            try:
                reduced = inner(*args, **kwargs)
            finally:
                call.merges[self.index] = None
            for position, (a, b) in enumerate(_pairs(full, reduced)):
                residuals[restore._key(self, module, position, restoring.ordinal)] = (restoring.window, a - b)
            return full
        out = inner(*args, **kwargs)
        shape, added = self.patch.xp.shape, []
        for position, (x, _) in enumerate(_pairs(out, out)):
            found = residuals.get(restore._key(self, module, position, restoring.ordinal))
            ok = found is not None and found[0] == restoring.window and shape(found[1]) == shape(x)
            added.append(x + found[1] if ok else x)
        return _rebuilt(out, added)


def _pairs(a: Any, b: Any) -> list:
    """The tensors of two outputs of one attention, side by side (a tensor, or a tuple's items that are not None)."""
    if not isinstance(a, tuple):
        return [(a, b)]
    return [(x, y) for x, y in zip(a, b) if x is not None]


def _rebuilt(out: Any, tensors: list) -> Any:
    """`out` with its tensors (as _pairs lists them) replaced by `tensors`."""
    if not isinstance(out, tuple):
        return tensors[0]
    items = iter(tensors)
    return tuple(item if item is None else next(items) for item in out)
