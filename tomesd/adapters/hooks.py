"""ToMe installed as forward hooks on each transformer block's sub-layers.

The host library's own block forward runs unchanged. Per root model (a UNet, a diffusion transformer
or a ControlNet):
- a pre-hook on the root reads this call's latent size (or Flux's ids) and timestep, doing no tensor work;
- a pre-hook on each block of a known kind (kinds.BLOCK_KINDS) records the block's input; the merge is
  computed from it at the block's first hooked sub-layer (a block a step cache skips costs nothing);
- pre-hooks on the sub-layers a kind lists merge their image tokens (and gather rotary rows), post-hooks
  unmerge their image output; spans merge at one sub-layer's output and unmerge at another's.

Rules the per-call path keeps (see the README's "How it runs"):
- No host reads: the random pattern is keyed by (seed, timestep tensor, block index) with device
  ops, so a call never syncs and a graph compiler traces it whole.
- One owner per state: what a call computes lives in that call's entry of a call stack, per thread
  in eager mode (concurrent calls at different resolutions never meet), and in a plain list while
  a graph compiler traces (thread-locals break graphs; a compiled graph holds no Python state).
- Checkpointing replays a block after its call ended: with gradients on, each block's latest merge
  is kept so the recompute merges exactly as the forward did.
- Hooks are bound methods of the patch (on paddle wrapped in a plain object the backend registers),
  so patched models deepcopy and pickle, and a copy's patch owns the copy's hooks.
- Matches reused across denoising steps (reuse_steps > 1) are the one state that outlives a call.
  On a patched pipeline its loop counts the steps on the host (clock.StepClock, which owns the kept
  matches): no tensor is read, and a compiled denoiser sees one graph per kind of step. On a bare
  model a step is a new timestep value (read on the host, eager only), and the matches are owned by
  the patch, per thread (one thread runs one denoising loop). Either way they are replaced once k
  steps have passed or the grid or batch changes, dropped when a new run starts and on remove,
  never copied, and never used while gradients are on (training recomputes every call).

mode="downsample" hooks self-attention only: on attn1 (UNets, PixArt, DiT) its pre-hook passes the
downsampled tokens as the attention's own context argument (`encoder_hidden_states` / `context`), so
the host's attention module and processor compute keys and values from them; on SD3's joint attention
the image key and value projections take the downsampled tokens. Queries stay full.
"""
from __future__ import annotations

import functools
import inspect
import math
import threading
from typing import Any, Dict, List, Optional, Sequence, Tuple

from tome_core import (
    KVDownsample, ToMeArgs, TokenMerge, block_grid, compute_downsample, compute_merge, compute_merges,
    compute_shared_merge, compute_shared_merges, num_cells, plan_block, plan_patch_block, rng,
)

from .observe import CallWatch
from .kinds import (
    BLOCK_KINDS, BlockKind, Sublayer, block_kind, ids_input, in_temporal_container, is_video_root, patch_size,
    spacetime_patch,
)

PATCH_ATTR = "_tome_patch"
_TOKENS = ("hidden_states", "x")
_LATENT = ("sample", "x")
_TIMESTEP = ("timestep", "timesteps", "t")
_CONTEXT = ("encoder_hidden_states", "context")

Plan = Any  # a TokenMerge (mode "merge") or a KVDownsample (mode "downsample"), or None


def _refuse_step_cache_inside(module: Any) -> None:
    """Merge mode cannot run under a diffusers hook that keeps a sub-layer's outputs across calls
    (TaylorSeer, FasterCache, ...): inside a merging block those outputs are merged tokens, ordered by each
    step's own matching, so extrapolating or reusing them across steps mixes unrelated tokens (the SD3
    yardstick measured ToMe r=0.5 with TaylorSeer at 13 dB from the baseline, each alone at 23 and 26 dB).
    Caches of whole blocks (First Block Cache) keep unmerged outputs and stack."""
    registry = getattr(module, "_diffusers_hook", None)
    for name, hook in (getattr(registry, "hooks", None) or {}).items():
        if getattr(hook, "_is_stateful", False):
            raise ValueError(
                f"mode='merge' cannot run with diffusers' {name!r} hook on {type(module).__name__} inside a "
                f"merging block: the cache keeps that layer's outputs across steps, and there they are merged "
                f"tokens in each step's own order. Use mode='downsample' (every query token stays), or a cache "
                f"of whole blocks (First Block Cache)"
            )


def transformer_blocks(ops: Any, root: Any) -> List[Any]:
    """The blocks of `root` whose kind ToMe knows (kinds.BLOCK_KINDS), in module order, leaving out
    those inside a temporal container (their tokens are frames)."""
    temporal = {id(m) for _, c in ops.named_modules(root) if in_temporal_container(c) for _, m in ops.named_modules(c)}
    return [m for _, m in ops.named_modules(root) if block_kind(m) is not None and id(m) not in temporal]


KNOWN_BLOCKS = ", ".join(BLOCK_KINDS)


class InputSpec:
    """Where one input of a module's forward arrives: by position `index`, or by keyword `name`."""

    __slots__ = ("name", "index")

    def __init__(self, name: str, index: Optional[int]):
        self.name, self.index = name, index

    @classmethod
    def find(cls, module: Any, names: Sequence[str], first_positional: bool) -> Optional["InputSpec"]:
        """The first of `names` in the module's forward signature (else its first positional
        parameter, when `first_positional`), or None."""
        try:
            params = list(inspect.signature(module.forward).parameters.values())
        except (TypeError, ValueError):
            params = []
        positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        keyword = {p.name for p in params if p.kind == p.KEYWORD_ONLY}
        for name in names:
            if name in positional:
                return cls(name, positional.index(name))
            if name in keyword:
                return cls(name, None)
        if first_positional:
            return cls(positional[0], 0) if positional else cls(names[0], 0)
        return None

    def get(self, args: tuple, kwargs: dict) -> Any:
        if self.index is not None and len(args) > self.index:
            return args[self.index]
        return kwargs.get(self.name)

    def replace(self, args: tuple, kwargs: dict, value: Any) -> Tuple[tuple, dict]:
        i = self.index
        if i is not None and len(args) > i:
            return args[:i] + (value,) + args[i + 1:], kwargs
        return args, {**kwargs, self.name: value}


class _Call:
    """What one call of a root computes; dropped when the call returns."""

    __slots__ = ("latent_hw", "grid_hw", "grid_thw", "coords", "ids", "timestep", "key", "draws", "finest_level",
                 "merges", "pending", "shared", "step", "ratio", "watch")

    def __init__(self) -> None:
        self.latent_hw: Optional[Tuple[int, int]] = None
        self.grid_hw: Optional[Tuple[int, int]] = None  # a diffusion transformer's patch grid
        self.grid_thw: Optional[Tuple[int, int, int]] = None  # a video transformer's (frames, rows, cols)
        # Flux: (ids, N) as the root call gives them, then ((rows, cols), None) once the first block has
        # read each image token's grid coordinates (on the device). Wan: ((frames, rows, cols), None), made
        # by the first block from grid_thw.
        self.coords: Optional[Tuple[Any, Any]] = None
        self.ids: Any = None  # Flux: the ids tensor itself, which tells grids of one token count apart
        self.timestep: Any = None
        self.key: Any = None  # computed at the call's first random draw, inside the forward
        self.draws: Dict[int, Any] = {}  # cells per block -> [blocks, cells] dst places
        self.finest_level: Optional[int] = None  # level of the call's first attention block
        self.merges: Dict[int, Plan] = {}
        self.pending: Dict[int, Tuple[Any, Any, bool]] = {}  # block -> (block, its input, grad mode), until used
        self.shared: Dict[tuple, Any] = {}  # per-level results every block of the call may use
        self.step: int = 0  # denoising step number (reuse_steps > 1), from the timestep's value
        self.ratio: Optional[float] = None  # this step's ratio under a ratio_schedule (from the pipeline's clock)
        self.watch: Optional[CallWatch] = None  # the observations of this call (tomesd.observe), eager only


class _Reuse:
    """One thread's matches kept across denoising steps: a new step is a new timestep value, and a
    new denoising run (a timestep above the last one) starts with none kept."""

    __slots__ = ("last_key", "last_value", "step", "kept")

    def __init__(self) -> None:
        self.last_key: Optional[int] = None
        self.last_value: Optional[float] = None
        self.step = 0
        self.kept: Dict[Any, Tuple[int, tuple, TokenMerge, Any]] = {}  # key -> (step, (batch, h, w), merge, ids)


class _ThreadCalls(threading.local):
    def __init__(self) -> None:
        self.stack: List[_Call] = []
        self.reuse = _Reuse()


def remove_owned_hooks(ops: Any, module: Any, owner: Any) -> None:
    """Remove from `module` every forward hook that is a method of `owner` (with its flags)."""
    for table_name, flag_names in ops.hook_tables:
        table = getattr(module, table_name, None) or {}
        for hook_id, hook in list(table.items()):
            if getattr(getattr(hook, "func", hook), "__self__", None) is owner:
                del table[hook_id]
                for flag_name in flag_names:
                    getattr(module, flag_name, {}).pop(hook_id, None)


class ToMePatch:
    """The hooks ToMe puts on one root model; `install` and `remove` are each other's inverse."""

    def __init__(self, root: Any, args: ToMeArgs, ops: Any):
        self.root, self.args, self.ops = root, args, ops
        # Plain values for the per-call path: paddle's SOT translator cannot simulate ToMeArgs' properties
        # inside a to_static'd forward (it crashed on steps_reused, and raised on rand_seed once a graph
        # break left `_offsets` to a resume function).
        self._steps_reused, self._reuses, self._seed = args.steps_reused, args.reuses, args.rand_seed
        self.clock: Any = None  # a clock.StepClock when a pipeline was patched with reuse_steps > 1
        self.slot = 0  # this denoiser's place among its pipeline's (the clock's keys)
        self.blocks = transformer_blocks(ops, root)
        self.kinds: List[BlockKind] = [block_kind(block) for block in self.blocks]
        self._ids_name = ids_input(root)  # Flux: the input with each image token's grid coordinates
        # A patch grid from the latent's sides; None: a UNet (tomesd's level rule picks the blocks) or Flux.
        self.patch = None if self._ids_name is not None else patch_size(root)
        self._ids_spec = None if self._ids_name is None else InputSpec.find(root, (self._ids_name,), False)
        # A video transformer's (time, height, width) patch: its blocks see every frame in one sequence.
        self.spacetime = spacetime_patch(root)
        # Every block sees one grid (blocks are chosen by index).
        self._one_grid = self.patch is not None or self._ids_name is not None or self.spacetime is not None
        # Video: a 5-D latent; in video UNets frames ride in the batch of the spatial blocks.
        self._latent_dims = 5 if is_video_root(root) or self.spacetime is not None else 4
        self._latent_spec = InputSpec.find(root, _LATENT, first_positional=True)
        self._timestep_spec = InputSpec.find(root, _TIMESTEP, first_positional=False)
        # (block index, sub-layer name or "") -> where that module's token input arrives
        self._specs: Dict[Tuple[int, str], InputSpec] = {}
        self._hooked: List[Any] = []
        self._init_runtime()

    def _init_runtime(self) -> None:
        self._threads = _ThreadCalls()
        self._traced: List[_Call] = []  # the call stack while a graph compiler traces
        self._replay: Dict[int, Plan] = {}  # block index -> its latest merge, gradients on
        self.observers: List[Any] = []  # observe.Observation objects recording this patch's calls

    # ---- copies: runtime state is per object and never copied ----
    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        for name in ("_threads", "_traced", "_replay", "observers"):
            state.pop(name)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._init_runtime()

    # ---- lifecycle ----
    def validate(self) -> None:
        """Raise, before anything is changed, for a block whose merge could not be computed right."""
        if self.args.steps_reused > 1 and self._timestep_spec is None:
            raise ValueError(
                f"reuse_steps needs the timestep input to tell denoising steps apart, and "
                f"{type(self.root).__name__}.forward takes none of {_TIMESTEP}"
            )
        name = type(self.root).__name__
        if self._ids_name is not None and self._ids_spec is None:
            raise ValueError(f"{name}.forward takes no {self._ids_name!r}: ToMe reads the image tokens' grid from it")
        if self._one_grid and self.args.max_downsample is not None:
            raise ValueError(
                f"max_downsample has no meaning on {name}: a diffusion transformer's blocks all see one "
                f"token grid. Choose blocks by index with blocks=[...] instead"
            )
        if self.args.mode == "merge" and self.args.st != 1 and self.spacetime is None:
            raise ValueError(
                f"st (the dst stride along time) has no meaning on {name}: its blocks see one frame's tokens. It is "
                f"for video transformers (Wan, CogVideoX), whose blocks see every frame in one sequence"
            )
        if not self._one_grid and self.args.blocks is not None:
            raise ValueError(
                f"blocks chooses blocks of a diffusion transformer by index; {name} is a UNet, whose blocks "
                f"are chosen by max_downsample"
            )
        if self.args.mode == "downsample":
            for block, kind in zip(self.blocks, self.kinds):
                if kind.no_downsample:
                    raise ValueError(f"mode='downsample' cannot run on {type(block).__name__}: {kind.no_downsample}")
                for way in kind.downsample:
                    attn = getattr(block, way.attention, None)
                    if attn is None:
                        continue
                    if way.via == "projections":
                        _check_projections(attn)
                    elif _fused(attn):
                        raise ValueError(_FUSED_QKV)
                    if way.via == "context" and InputSpec.find(attn, _CONTEXT, first_positional=False) is None:
                        raise ValueError(
                            f"mode='downsample' passes keys and values to self-attention through its context "
                            f"argument, and {type(attn).__name__}.forward takes none of {_CONTEXT}"
                        )
                    if way.via == "projections" and not all(hasattr(attn, p) for p in _KV_PROJECTIONS):
                        raise ValueError(
                            f"mode='downsample' shrinks {type(block).__name__}.{way.attention}'s keys and values "
                            f"at its {' and '.join(_KV_PROJECTIONS)} projections, and it has none"
                        )
        if self.args.mode == "merge" and self.args.merge_mlp:
            for block in self.blocks:
                if getattr(block, "_chunk_size", None) is not None:
                    raise ValueError(_CHUNKED_FF)
        if self.args.mode == "merge":
            for block in self.blocks:
                for _, sub in self.ops.named_modules(block):
                    if sub is not block:
                        _refuse_step_cache_inside(sub)

    def install(self) -> None:
        ops = self.ops
        self._hook(self.root, ops.add_pre_hook, self._enter_root)
        self._hook(self.root, functools.partial(ops.add_post_hook, always_call=True), self._exit_root)
        for index, (block, kind) in enumerate(zip(self.blocks, self.kinds)):
            self._specs[(index, "")] = InputSpec.find(block, kind.tokens, first_positional=True)
            self._hook(block, ops.add_pre_hook, functools.partial(self._enter_block, index))
            if self.args.mode == "downsample":
                for way in kind.downsample:
                    sub = getattr(block, way.attention, None)
                    if sub is None:
                        continue
                    if way.via == "context":
                        self._specs[(index, "attn1")] = InputSpec.find(sub, _TOKENS, first_positional=True)
                        self._specs[(index, "context")] = InputSpec.find(sub, _CONTEXT, first_positional=False)
                        self._hook(sub, ops.add_pre_hook, functools.partial(self._downsample_context, index))
                    else:
                        for projection in _KV_PROJECTIONS:
                            self._hook(getattr(sub, projection), ops.add_pre_hook,
                                       functools.partial(self._downsample_projection, index, sub, projection))
                continue
            for layer in kind.sublayers:
                sub = getattr(block, layer.name, None)
                if sub is None or not getattr(self.args, layer.flag):
                    continue
                self._specs[(index, layer.name)] = InputSpec.find(sub, layer.tokens, first_positional=True)
                if layer.rotary is not None:  # by keyword, or where the signature puts it (Wan passes it by position)
                    self._specs[(index, layer.name + ":rotary")] = (
                        InputSpec.find(sub, (layer.rotary,), first_positional=False) or InputSpec(layer.rotary, None))
                self._hook(sub, ops.add_pre_hook, functools.partial(self._merge_input, index, layer))
                self._hook(sub, ops.add_post_hook,
                           functools.partial(self._unmerge_output, index, layer.outputs, layer.flag))
            for span in kind.spans:
                start, end = getattr(block, span.start, None), getattr(block, span.end, None)
                if start is None or end is None or not getattr(self.args, span.flag):
                    continue
                self._hook(start, ops.add_post_hook,
                           functools.partial(self._merge_output, index, span.start_output, span.flag))
                self._hook(end, ops.add_post_hook, functools.partial(self._unmerge_output, index, (), span.flag))
                inner = getattr(block, span.rotary_at, None) if span.rotary_at else None
                if inner is not None:
                    self._hook(inner, ops.add_pre_hook,
                               functools.partial(self._gather_rotary, index, span.rotary, span.flag))
        setattr(self.root, PATCH_ATTR, self)

    def _hook(self, module: Any, register: Any, hook: Any) -> None:
        register(module, hook)
        if not any(m is module for m in self._hooked):
            self._hooked.append(module)

    def remove(self) -> None:
        for module in self._hooked:
            remove_owned_hooks(self.ops, module, self)
        self._hooked.clear()
        self._specs.clear()
        self._replay.clear()
        self._threads = _ThreadCalls()  # drops kept matches of this thread and, with it, of all threads
        self.clock = None  # the pipeline's clock (targets.remove detaches it from the scheduler)
        if self.root.__dict__.get(PATCH_ATTR) is self:
            delattr(self.root, PATCH_ATTR)

    # ---- the call stack ----
    def _stack(self) -> List[_Call]:
        return self._traced if self.ops.is_compiling() else self._threads.stack

    def _watch(self) -> Optional[CallWatch]:
        """The current call's observations, or None (nothing observes, or a graph is being traced)."""
        stack = self._stack()
        return stack[-1].watch if stack else None

    def _records(self, call: _Call, index: int) -> List[Any]:
        return call.watch.blocks(index, type(self.blocks[index]).__name__) if call.watch is not None else []

    def _note(self, call: _Call, index: int, computed: int = 0, reused: int = 0) -> None:
        for record in self._records(call, index):
            record.computed += computed
            record.reused += reused

    def _note_site(self, index: int, flag: str, before: Any, after: Any) -> None:
        """Tokens in and out of a site (the sequence's length as the sub-layer would see it, and sees it)."""
        stack = self._stack()
        site = flag[len("merge_"):] if flag.startswith("merge_") else flag
        pair = (self.ops.shape(before)[1], self.ops.shape(after)[1])
        for record in self._records(stack[-1], index):
            record.sites.setdefault(site, []).append(pair)

    def _site_merge(self, index: int, flag: str) -> Optional[TokenMerge]:
        """Block `index`'s merge for the site `flag` turns on: with per-site ratios the block holds one merge
        per site (all from one matching), else one merge for every site."""
        merge = self._current_merge(index)
        return merge.get(flag) if isinstance(merge, dict) else merge

    def _current_merge(self, index: int) -> Plan:
        stack = self._stack()
        if stack:
            call = stack[-1]
            pending = call.pending.pop(index, None)
            if pending is not None:  # the block's first hooked sub-layer: match now
                self._settle(index, call, *pending)
            return call.merges.get(index)
        # A block running after its root's call: a checkpointed block recomputed in backward.
        return self._replay.get(index) if self.ops.grad_enabled() else None

    def _settle(self, index: int, call: _Call, block: Any, x: Any, grad: bool) -> None:
        """Block `index`'s merge, from its input `x`; `grad`: gradients were on when the block was entered."""
        if call.coords is None and call.grid_thw is not None:  # Wan: each token's (frame, row, col), on the device
            f, h, w = call.grid_thw
            token = self.ops.arange(f * h * w, x)
            call.coords = (token // (h * w), (token // w) % h, token % w), None
        if call.coords is not None:  # the image is the block input's last N tokens (Flux: text may come first)
            ids, n = call.coords
            if n is not None:  # the first block: (rows, cols) from the ids rows (_, row, col), on the device
                ids = ids[0] if len(self.ops.shape(ids)) == 3 else ids
                call.coords = (self.ops.to_int64(ids[:, 1]), self.ops.to_int64(ids[:, 2])), None
            x = x[:, self.ops.shape(x)[1] - self.ops.shape(call.coords[0][0])[0]:]
        started = None if call.watch is None else call.watch.start()
        merge = self._plan_merge(index, block, x, call, grad)
        call.merges[index] = merge
        if call.watch is not None:
            call.watch.stop("downsample" if self.args.mode == "downsample" else "match", started)
            for record in self._records(call, index):
                record.merge = merge
        if merge is not None and grad and not self.ops.is_compiling():
            self._replay[index] = merge

    # ---- hooks ----
    def _enter_root(self, module: Any, args: tuple, kwargs: dict) -> None:
        ops, call = self.ops, _Call()
        # Pushed before any error: the always-called exit hook pops it even when this hook raises.
        self._stack().append(call)
        if self.observers and not ops.is_compiling():
            call.watch = CallWatch(self.observers, type(module).__name__)
        latent = self._latent_spec.get(args, kwargs)
        if latent is None:
            raise TypeError(f"ToMe found no '{self._latent_spec.name}' input in this call of {type(module).__name__}")
        shape = ops.shape(latent)
        if self._ids_spec is not None:
            call.coords = self._image_ids(module, args, kwargs, shape)
            call.ids = call.coords[0]
        elif len(shape) != self._latent_dims:
            layout = "a latent [B, C, H, W]" if self._latent_dims == 4 else "a video latent (frames, then H and W last)"
            raise ValueError(
                f"ToMe needs {type(module).__name__}'s '{self._latent_spec.name}' input to be {layout}, "
                f"got shape {list(shape)}"
            )
        else:
            call.latent_hw = (shape[-2], shape[-1])
        if self.patch is not None:
            call.grid_hw = (shape[-2] // self.patch, shape[-1] // self.patch)
        if self.spacetime is not None:
            frame_axis, (pt, ph, pw) = self.spacetime
            call.grid_thw = (shape[frame_axis] // pt, shape[-2] // ph, shape[-1] // pw)
        if self._timestep_spec is not None:
            call.timestep = self._timestep_spec.get(args, kwargs)
        if self.clock is not None and self.clock.schedule is not None:
            if not ops.is_compiling():
                self.clock.follow()
            call.ratio = self.clock.ratio  # a float set on the host as the step began
        if self._steps_reused > 1 and not ops.grad_enabled():  # training never reuses (see _plan_merge)
            if self.clock is None:
                call.step = self._denoising_step(call.timestep)
            elif not ops.is_compiling():
                self.clock.follow()
        if self._replay and not ops.grad_enabled() and not ops.is_compiling():
            self._replay.clear()  # inference after training: nothing left to recompute

    def _image_ids(self, module: Any, args: tuple, kwargs: dict, shape: Tuple[int, ...]) -> Tuple[Any, int]:
        """(ids [N, 3], N) of a packed latent's image tokens, checked by shape only: the root's pre-hook
        does no tensor work (a graph tracer then sees one graph); the first block reads the coordinates."""
        ids = self._ids_spec.get(args, kwargs)
        if len(shape) != 3 or ids is None:
            raise ValueError(
                f"ToMe needs {type(module).__name__}'s packed latent [B, N, C] and its {self._ids_name} [N, 3], got "
                f"{list(shape)} and {None if ids is None else list(self.ops.shape(ids))}"
            )
        ids_shape = self.ops.shape(ids)
        rows = ids_shape[1] if len(ids_shape) == 3 else ids_shape[0]  # older diffusers: ids with a batch axis
        if rows != shape[1]:
            raise ValueError(
                f"{self._ids_name} has {rows} rows for {shape[1]} latent tokens: ToMe merges the "
                f"latent's own tokens only (reference-image tokens, as in Flux Kontext, are not supported)"
            )
        return ids, shape[1]

    def _exit_root(self, module: Any, args: tuple, output: Any) -> None:
        stack = self._stack()
        if stack:
            stack.pop()

    def _enter_block(self, index: int, module: Any, args: tuple, kwargs: dict) -> None:
        stack = self._stack()
        if not stack:
            return  # replayed by checkpointing: the sub-layers use the replay record
        # Matched lazily, at the block's first hooked sub-layer: a block that a step cache (diffusers'
        # First Block Cache) skips costs no matching.
        call = stack[-1]
        if self.args.mode == "downsample":
            for way in self.kinds[index].downsample:
                attn = getattr(module, way.attention, None)
                if way.via == "projections" and attn is not None:
                    _check_projections(attn)  # the processor may have been swapped after apply_patch
        call.merges.pop(index, None)
        # The grad mode is taken here: LDM's checkpointing runs the block's body under no_grad inside a
        # block entered with gradients on, and training (replay kept, nothing reused) is decided by the latter.
        call.pending[index] = (module, self._specs[(index, "")].get(args, kwargs), self.ops.grad_enabled())

    def _denoising_step(self, timestep: Any) -> int:
        """This thread's denoising step number: it advances when the timestep's value changes, so
        several calls in one step (classifier-free guidance as two calls, a ControlNet) share it."""
        if self.ops.is_compiling():
            raise RuntimeError(
                "reuse_steps > 1 cannot run inside a compiled graph: telling a new denoising step from "
                "the same one needs the timestep's value on the host. Compile with reuse_steps=1 or "
                "mode='downsample', or run this patch eagerly."
            )
        if timestep is None:
            raise ValueError("reuse_steps needs the timestep of each call, and this call passed None")
        state = self._threads.reuse
        value = self.ops.host_float(timestep)
        key = rng.timestep_key(self.ops, value)
        if state.last_value is not None and value > state.last_value:
            state.kept.clear()  # timesteps only fall within a run: a rise starts a new one
        if key != state.last_key:
            state.last_key, state.last_value = key, value
            state.step += 1
        return state.step

    def _plan_merge(self, index: int, block: Any, x: Any, call: _Call, grad: bool) -> Plan:
        ops, args = self.ops, self.args
        batch, num_tokens = ops.shape(x)[:2]
        if call.coords is not None:  # Flux: one token list, its grid given by coordinates
            plan = plan_patch_block(args, (num_tokens, 1), batch, num_tokens, index, call.ratio)
        elif call.grid_hw is not None:
            plan = plan_patch_block(args, call.grid_hw, batch, num_tokens, index, call.ratio)
        else:
            if call.finest_level is None:
                grid = block_grid(call.latent_hw, num_tokens)
                call.finest_level = None if grid is None else grid[0]
            if call.finest_level is None:
                return None
            plan = plan_block(args, call.latent_hw, batch, num_tokens, call.finest_level, call.ratio)
        if plan is None:
            return None
        if args.mode == "downsample":
            key = ("downsample", batch, plan.h, plan.w)
            if key not in call.shared:  # the same index map for every block of the level
                call.shared[key] = compute_downsample(
                    ops, x, batch, plan.w, plan.h, args.downsample_factor, args.downsample_method
                )
                self._note(call, index, computed=1)
            else:
                self._note(call, index, reused=1)
            return call.shared[key]
        if args.merge_mlp and getattr(block, "_chunk_size", None) is not None:
            raise ValueError(_CHUNKED_FF)
        if not self._reuses:
            return self._match(index, x, plan, call)
        # Reused matches: a block's own (or, with share_across_blocks, its level's first block's),
        # kept for reuse_steps denoising steps while the batch and token count stay the same.
        key = ("level", plan.level) if args.share_across_blocks else index
        if key in call.shared:
            self._note(call, index, reused=1)
            return call.shared[key]
        # Kept across calls only when steps are reused (share_across_blocks alone lives within a call),
        # and never while training: there each call is a new batch of images.
        shape = (batch, plan.h, plan.w, call.grid_thw)  # Wan: two grids of one token count are told apart
        clock = self.clock
        if clock is not None and self._steps_reused > 1 and not grad:
            # The pipeline's loop says which step this is; the clock drops its matches as a window starts, so
            # the window's first call matches and every later call (the step's other guidance half, as Wan's
            # pipeline calls it, and the window's later steps) reuses, as the timestep rule does.
            entry = clock.kept.get((self.slot, key))
            if entry is not None and entry[0] == shape:
                merge = entry[1]
                self._note(call, index, reused=1)
            else:
                merge = self._match(index, x, plan, call)
                clock.kept[(self.slot, key)] = (shape, merge)
            call.shared[key] = merge
            return merge
        across_calls = self._steps_reused > 1 and not ops.is_compiling() and not grad
        kept = self._threads.reuse.kept if across_calls else {}
        entry = kept.get(key)
        # Flux: grids of one token count differ by their ids; the pipeline passes one ids tensor per run.
        grid = call.ids
        if entry is not None and call.step - entry[0] < self._steps_reused and entry[1] == shape and entry[3] is grid:
            merge = entry[2]
            self._note(call, index, reused=1)
        else:
            merge = self._match(index, x, plan, call)
            kept[key] = (call.step, shape, merge, grid)
        call.shared[key] = merge
        return merge

    def _match(self, index: int, x: Any, plan: Any, call: _Call) -> Optional[TokenMerge]:
        ops, args = self.ops, self.args
        self._note(call, index, computed=1)
        offsets = None
        if call.coords is not None:
            # One matching for the batch (per-token rotary rows have no batch axis), so the random
            # pattern need not differ between guidance halves: it follows use_rand whatever the batch.
            coords = call.coords[0]
            strides = (args.st, args.sy, args.sx)[-len(coords):]  # (sy, sx) on an image, (st, sy, sx) on a video
            if args.use_rand:
                volume = math.prod(strides)  # a space-time cell's places span its frames too
                offsets = self._offsets(index, x, ops.shape(x)[1] // volume, volume, call)
            if plan.site_r:
                return _per_site(plan, compute_shared_merges(ops, x, coords, strides, [r for _, r in plan.site_r], offsets))
            return compute_shared_merge(ops, x, coords, strides, plan.r, offsets)
        if plan.use_rand:
            offsets = self._offsets(index, x, num_cells(plan.w, plan.h, args.sx, args.sy), args.sx * args.sy, call)
        if plan.site_r:  # per-site ratios: one matching, a merge per site
            return _per_site(plan, compute_merges(ops, x, plan.w, plan.h, args.sx, args.sy,
                                                  [r for _, r in plan.site_r], offsets))
        return compute_merge(ops, x, plan.w, plan.h, args.sx, args.sy, plan.r, offsets)

    def _offsets(self, index: int, x: Any, cells: int, places: int, call: _Call) -> Any:
        """Block `index`'s dst place in each of `cells` cells of `places` tokens (sx * sy on an image,
        st * sy * sx on a space-time grid): one table per call and cell count. A patch's cell size never
        changes, so the cell count alone keys the table (an int: paddle's SOT cannot simulate a tuple key)."""
        ops = self.ops
        table = call.draws.get(cells)
        if table is None:
            if call.key is None:
                call.key = rng.call_key(ops, self._seed, call.timestep)
            table = rng.randint(ops, x, [len(self.blocks), cells], places, call.key)
            call.draws[cells] = table
        return table[index]

    def _merge_input(self, index: int, layer: Sublayer, module: Any, args: tuple, kwargs: dict):
        merge = self._site_merge(index, layer.flag)
        if merge is None:
            return None
        if not self.ops.is_compiling():
            _refuse_step_cache_inside(module)  # a cache applied after the patch
        name = layer.name
        if layer.rotary is not None:
            spec = self._specs[(index, name + ":rotary")]
            rows = spec.get(args, kwargs)
            if rows is not None:
                args, kwargs = spec.replace(args, kwargs, tuple(merge.gather_rows(t, layer.rotary_axis) for t in rows))
        if name == self.kinds[index].self_attention and kwargs.get("attention_mask") is not None:
            raise ValueError(
                "ToMe cannot merge self-attention that is given an attention_mask (the mask addresses "
                "unmerged tokens); call apply_patch with merge_attn=False"
            )
        spec = self._specs[(index, name)]
        # The image tokens, or a sequence ending with them (CogVideoX's feed-forward sees [text, image]).
        tokens, watch = spec.get(args, kwargs), self._watch()
        started = None if watch is None else watch.start()
        merged = merge.merge_tail(tokens)
        if watch is not None:
            watch.stop("merge", started)
            self._note_site(index, layer.flag, tokens, merged)
        return spec.replace(args, kwargs, merged)

    def _downsample_context(self, index: int, module: Any, args: tuple, kwargs: dict):
        down: Optional[KVDownsample] = self._current_merge(index)
        if down is None:
            return None
        context = self._specs[(index, "context")]
        if context is None or context.get(args, kwargs) is not None:
            return None  # keys/values already come from elsewhere (only_cross_attention): nothing to downsample
        if _fused(getattr(self.blocks[index], "attn1", None)):
            raise ValueError(_FUSED_QKV)
        if kwargs.get("attention_mask") is not None:
            raise ValueError(
                "mode='downsample' cannot shrink self-attention's keys when it is given an attention_mask "
                "(the mask addresses every token)"
            )
        x, watch = self._specs[(index, "attn1")].get(args, kwargs), self._watch()
        started = None if watch is None else watch.start()
        small = down(x)
        if watch is not None:
            watch.stop("downsample", started)
            self._note_site(index, "downsample", x, small)
        return context.replace(args, kwargs, small)

    def _downsample_projection(self, index: int, attn: Any, name: str, module: Any, args: tuple, kwargs: dict):
        """A key or value projection of image tokens: it projects the downsampled grid instead."""
        down: Optional[KVDownsample] = self._current_merge(index)
        if down is None:
            return None
        if getattr(attn, name) is not module:
            # Wrapped after apply_patch (a LoRA adapter: the wrapper feeds this layer and its own
            # branch the same input, and only this one would shrink).
            raise ValueError(
                f"{type(attn).__name__}.{name} was replaced after apply_patch (by a LoRA adapter or another "
                f"wrapper), so mode='downsample' can no longer shrink its input alone. Call apply_patch again "
                f"after loading adapters."
            )
        x = args[0] if args else kwargs["input"]
        # to_k and to_v project the same tensor: downsample it once. One slot per call, overwritten by
        # the next attention, so no block's input outlives its attention.
        stack = self._stack()
        last = stack[-1].shared.get("projected") if stack else None
        watch = self._watch()
        if last is not None and last[0] is x:
            small = last[1]
        else:
            started = None if watch is None else watch.start()
            small = down(x)
            if stack:
                stack[-1].shared["projected"] = (x, small)
            if watch is not None:  # recorded once per attention: to_v reuses to_k's
                watch.stop("downsample", started)
                self._note_site(index, "downsample", x, small)
        return ((small,) + args[1:], kwargs) if args else (args, {**kwargs, "input": small})

    def _unmerge_output(self, index: int, positions: Tuple[int, ...], flag: str, module: Any, args: tuple,
                        output: Any) -> Any:
        """The image tokens of a sub-layer's output back to every token (the last N of a joined sequence)."""
        merge = self._site_merge(index, flag)
        if merge is None:
            return None
        watch = self._watch()
        started = None if watch is None else watch.start()
        if not positions:
            output = merge.unmerge_tail(output)
        elif not isinstance(output, tuple):  # a processor that returns the image tokens alone
            output = merge.unmerge(output)
        else:
            output = tuple(merge.unmerge(item) if i in positions and item is not None else item
                           for i, item in enumerate(output))
        if watch is not None:
            watch.stop("unmerge", started)
        return output

    def _merge_output(self, index: int, position: Optional[int], flag: str, module: Any, args: tuple, output: Any) -> Any:
        """A span's start: the image tokens (the last N) of this sub-layer's output merge."""
        merge = self._site_merge(index, flag)
        if merge is None:
            return None
        if not self.ops.is_compiling():
            inner = getattr(self.blocks[index], self.kinds[index].self_attention, None)
            if inner is not None:
                _refuse_step_cache_inside(inner)  # a cache applied after the patch
        watch = self._watch()
        started = None if watch is None else watch.start()
        tokens = output if position is None else output[position]
        merged = merge.merge_tail(tokens)
        if watch is not None:
            watch.stop("merge", started)
            self._note_site(index, flag, tokens, merged)
        if position is None:
            return merged
        return tuple(merged if i == position else item for i, item in enumerate(output))

    def _gather_rotary(self, index: int, rotary: str, flag: str, module: Any, args: tuple, kwargs: dict):
        """Inside a span: the attention's rotary rows follow the merged tokens."""
        merge = self._site_merge(index, flag)
        if merge is None or kwargs.get(rotary) is None:
            return None
        return args, {**kwargs, rotary: tuple(merge.gather_rows(rows) for rows in kwargs[rotary])}


def _per_site(plan: Any, merges: Optional[Dict[int, TokenMerge]]) -> Optional[Dict[str, TokenMerge]]:
    """{merge flag: its site's merge}; a site whose r is 0 is left out (it does not merge)."""
    if merges is None:
        return None
    return {flag: merges[r] for flag, r in plan.site_r if r > 0}


_CHUNKED_FF = (
    "merge_mlp=True cannot be combined with chunked feed-forward (enable_forward_chunking): the "
    "feed-forward would merge each chunk on its own. Disable chunking or use merge_mlp=False."
)

_FUSED_QKV = (
    "mode='downsample' cannot run on fused QKV projections (fuse_qkv_projections): the fused self-attention "
    "computes keys and values from its queries' input. Call unfuse_qkv_projections() first."
)


_KV_PROJECTIONS = ("to_k", "to_v")


def _check_projections(attn: Any) -> None:
    """Downsampling at to_k / to_v needs a processor that projects the image through them once per call:
    a fused processor runs to_qkv instead (nothing would shrink), a PAG processor splits the batch and
    runs a second attention whose mask addresses every token."""
    if _fused(attn):
        raise ValueError(_FUSED_QKV)
    processor = type(getattr(attn, "processor", None)).__name__
    if "PAG" in processor:
        raise ValueError(
            f"mode='downsample' cannot run under {processor} (perturbed-attention guidance splits the batch and "
            f"masks every token); use mode='merge' or a plain processor"
        )


def _fused(attn: Any) -> bool:
    """diffusers' fused processors run self-attention through one to_qkv (there is no to_kv), so it
    cannot take other keys; unfusing swaps the processor back and keeps the fused weights around."""
    fused_processor = "Fused" in type(getattr(attn, "processor", None)).__name__
    return fused_processor and getattr(attn, "to_kv", None) is None
