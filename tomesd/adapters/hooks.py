"""ToMe installed as forward hooks on each transformer block's sub-layers.

The host library's own block forward runs unchanged. Per root model (a UNet or a ControlNet):
- a pre-hook on the root reads the latent size of this call;
- a pre-hook on each BasicTransformerBlock computes the merge from the block's input;
- pre-hooks on attn1 / attn2 / ff merge their input, post-hooks unmerge their output.
Everything a call computes lives in thread-local state, never on a module, so concurrent calls
at different resolutions cannot see each other's size or merge.
"""
from __future__ import annotations

import hashlib
import itertools
import struct
import threading
from typing import Any, Dict, List, Optional, Tuple

from tome_core import ToMeArgs, TokenMerge, compute_merge, downsample_level, plan_block

from .frameworks import class_names

BLOCK_CLASS = "BasicTransformerBlock"
PATCH_ATTR = "_tome_patch"
# Sub-layer of a block, and the ToMeArgs flag that merges around it.
SUBLAYERS = (("attn1", "merge_attn"), ("attn2", "merge_crossattn"), ("ff", "merge_mlp"))
_TOKENS_KWARGS = ("hidden_states", "x")
_LATENT_KWARGS = ("sample", "x")
_TIMESTEP_KWARGS = ("timestep", "timesteps", "t")
_GOLDEN = 0x9E3779B97F4A7C15


def transformer_blocks(ops: Any, root: Any) -> List[Any]:
    return [m for _, m in ops.named_modules(root) if BLOCK_CLASS in class_names(m)]


class _CallState:
    __slots__ = ("latent_hw", "finest_level", "timestep", "rand_key", "draws")

    def __init__(self, latent_hw: Tuple[int, int], timestep: Any):
        self.latent_hw = latent_hw
        self.finest_level: Optional[int] = None  # level of the call's first attention block
        self.timestep = timestep
        self.rand_key: Optional[int] = None  # derived from the timestep at the call's first draw
        self.draws = 0


class _ThreadState(threading.local):
    def __init__(self) -> None:
        self.calls: List[_CallState] = []
        self.merges: Dict[int, Optional[TokenMerge]] = {}


def _timestep_key(value: Any) -> Optional[int]:
    """A 64-bit key from a timestep's values (tensor or number), the same on torch and paddle."""
    try:
        values = [float(v) for v in (value.flatten().tolist() if hasattr(value, "flatten") else [value])]
    except (TypeError, ValueError):
        return None
    digest = hashlib.blake2b(struct.pack(f"<{len(values)}d", *values), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def _first_input(args: tuple, kwargs: dict, names: Tuple[str, ...]) -> Tuple[Any, Optional[str]]:
    """The module's main input and, if it came by keyword, its keyword."""
    if args:
        return args[0], None
    for name in names:
        if name in kwargs:
            return kwargs[name], name
    raise TypeError(f"ToMe hook found no positional input and none of {names} among {sorted(kwargs)}")


class ToMePatch:
    """The hooks ToMe puts on one root model; `install` and `remove` are each other's inverse."""

    def __init__(self, root: Any, args: ToMeArgs, ops: Any):
        self.root, self.args, self.ops = root, args, ops
        self.blocks = transformer_blocks(ops, root)
        self._handles: List[Any] = []
        self._state = _ThreadState()
        self._counter = itertools.count()
        self._seed = args.seed
        self._seed_lock = threading.Lock()

    # ---- lifecycle ----
    def validate(self) -> None:
        """Raise, before anything is changed, for a block whose merge could not be computed right."""
        if self.args.merge_mlp:
            for block in self.blocks:
                if getattr(block, "_chunk_size", None) is not None:
                    raise ValueError(_CHUNKED_FF)

    def install(self) -> None:
        ops = self.ops
        self._handles.append(ops.add_pre_hook(self.root, self._enter_root))
        self._handles.append(ops.add_post_hook(self.root, self._exit_root, always_call=True))
        for block in self.blocks:
            self._handles.append(ops.add_pre_hook(block, self._make_block_hook(block)))
            for name, flag in SUBLAYERS:
                sub = getattr(block, name, None)
                if sub is None or not getattr(self.args, flag):
                    continue
                key = id(block)
                self._handles.append(ops.add_pre_hook(sub, self._make_merge_hook(key, check_mask=name == "attn1")))
                self._handles.append(ops.add_post_hook(sub, self._make_unmerge_hook(key)))
        setattr(self.root, PATCH_ATTR, self)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self.root.__dict__.get(PATCH_ATTR) is self:
            delattr(self.root, PATCH_ATTR)

    # ---- hooks ----
    def _enter_root(self, module: Any, args: tuple, kwargs: dict) -> None:
        latent, _ = _first_input(args, kwargs, _LATENT_KWARGS)
        shape = self.ops.shape(latent)
        timestep = args[1] if len(args) > 1 else next((kwargs[k] for k in _TIMESTEP_KWARGS if k in kwargs), None)
        # Pushed before any error: the always-called exit hook pops it even when this hook raises.
        self._state.calls.append(_CallState((shape[-2], shape[-1]), timestep))
        if len(shape) != 4:
            raise ValueError(
                f"ToMe needs {type(module).__name__}'s first input to be a latent [B, C, H, W], got shape {list(shape)}"
            )

    def _exit_root(self, module: Any, args: tuple, output: Any) -> None:
        state = self._state
        if state.calls:
            state.calls.pop()
        if not state.calls:
            state.merges.clear()  # drop the last call's index maps

    def _make_block_hook(self, block: Any):
        key = id(block)

        def hook(module: Any, args: tuple, kwargs: dict) -> None:
            x, _ = _first_input(args, kwargs, _TOKENS_KWARGS)
            self._state.merges[key] = self._plan_merge(module, x)

        return hook

    def _plan_merge(self, block: Any, x: Any) -> Optional[TokenMerge]:
        if not self._state.calls:
            return None  # the block runs outside a call of its root: leave it alone
        call = self._state.calls[-1]
        batch, num_tokens = self.ops.shape(x)[:2]
        if call.finest_level is None:
            call.finest_level = downsample_level(call.latent_hw, num_tokens)
        plan = plan_block(self.args, call.latent_hw, batch, num_tokens, call.finest_level)
        if plan is None:
            return None
        if self.args.merge_mlp and getattr(block, "_chunk_size", None) is not None:
            raise ValueError(_CHUNKED_FF)
        counter = self._draw_counter(call) if plan.use_rand else 0
        return compute_merge(
            self.ops, x, plan.w, plan.h, self.args.sx, self.args.sy, plan.r,
            not plan.use_rand, self._draw_seed() if plan.use_rand else 0, counter,
        )

    def _draw_counter(self, call: _CallState) -> int:
        """Which random draw a block gets: a function of the call's timestep and the block's order
        in the call, so a run is reproducible and concurrent calls cannot shift each other's draws.
        Calls without a timestep take the next draws of this patch's stream, as tomesd does."""
        if call.rand_key is None:
            key = _timestep_key(call.timestep) if call.timestep is not None else None
            call.rand_key = key if key is not None else next(self._counter) * _GOLDEN
        call.draws += 1
        return (call.rand_key ^ (call.draws * _GOLDEN)) & ((1 << 64) - 1)

    def _draw_seed(self) -> int:
        if self._seed is None:
            with self._seed_lock:
                if self._seed is None:  # as tomesd: fork the global RNG at first use, never advance it
                    self._seed = self.ops.global_seed()
        return self._seed

    def _make_merge_hook(self, key: int, check_mask: bool):
        def hook(module: Any, args: tuple, kwargs: dict):
            merge = self._state.merges.get(key)
            if merge is None:
                return None
            if check_mask and kwargs.get("attention_mask") is not None:
                raise ValueError(
                    "ToMe cannot merge self-attention that is given an attention_mask "
                    "(the mask addresses unmerged tokens); call apply_patch with merge_attn=False"
                )
            x, name = _first_input(args, kwargs, _TOKENS_KWARGS)
            if name is None:
                return (merge.merge(x),) + tuple(args[1:]), kwargs
            return args, {**kwargs, name: merge.merge(x)}

        return hook

    def _make_unmerge_hook(self, key: int):
        def hook(module: Any, args: tuple, output: Any):
            merge = self._state.merges.get(key)
            return None if merge is None else merge.unmerge(output)

        return hook


_CHUNKED_FF = (
    "merge_mlp=True cannot be combined with chunked feed-forward (enable_forward_chunking): the "
    "feed-forward would merge each chunk on its own. Disable chunking or use merge_mlp=False."
)
