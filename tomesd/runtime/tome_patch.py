"""A patch's lifecycle on one root model: which hooks go where (install), their removal (remove), copies,
and the root's and blocks' entry hooks that set up each call. `install` and `remove` are each other's inverse.

The host library's own forwards run unchanged. Per root model (a UNet, a diffusion transformer or a
ControlNet): a pre-hook on the root reads this call's token grid (tomesd/layouts/) and timestep, doing no tensor
work; a pre-hook on each block of a known kind (tomesd/families/) records the block's input, and the merge
is computed from it at the block's first hooked sub-layer (matcher.py); the sub-layers' hooks (sites.py)
merge and unmerge. Hooks are methods of small objects that point back at the patch (on paddle wrapped in a
plain object the backend registers), so patched models deepcopy and pickle, and a copy's patch owns the
copy's hooks; what a call computes lives in calls.py and is never copied.

A little past 300 lines: the lifecycle and the per-call entry share the patch's state, and the entry's work is written
inline (every Python call there is paid on every call).
"""
from __future__ import annotations

import functools
import threading
import weakref
from typing import Any, List, Optional

from . import guards, key_weights
from .calls import Band, BlockMerge, CallStacks, CallState, Replay
from .install import (
    add_hook, around, install_downsample, install_merge, open_seam, remove_owned_hooks, rows_per_sample,
    seat_span_cache,
)
from ..families import block_kind, in_temporal_container, layout_of, root_kind
from ..layouts.entries import BlockKind, Span
from ..layouts.grids import Layout
from .matcher import Matcher
from .observe import CallWatch
from .restore import SiteRestore
from ..layouts.signatures import LATENT, TIMESTEP, InputSpec
from .sites import BlockEntry

PATCH_ATTR = "_tome_patch"


def transformer_blocks(host: Any, root: Any) -> List[Any]:
    """The blocks of `root` whose kind ToMe knows (kinds.BLOCK_KINDS), in module order, leaving out
    those inside a temporal container (their tokens are frames) or a module its root kind skips
    (RootKind.skip_blocks)."""
    skipped = root_kind(root).skip_blocks
    temporal = {id(m) for name, c in host.named_modules(root) if in_temporal_container(c) or name in skipped
                for _, m in host.named_modules(c)}
    return [m for _, m in host.named_modules(root) if block_kind(m) is not None and id(m) not in temporal]


class RootHooks:
    """The root's entry and exit: a call's state is pushed and popped around its forward."""

    def __init__(self, patch: "ToMePatch") -> None:
        self.patch = patch

    def pre(self, module: Any, args: tuple, kwargs: dict) -> None:
        self.patch.enter_root(module, args, kwargs)

    def post(self, module: Any, args: tuple, output: Any) -> None:
        call = self.patch.calls.pop()
        if call is not None and call.regional:
            self.patch.regional_lock.release()
        if call is not None and call.idle and not self.patch.host.is_compiling():
            self.patch.park(call.idle)
        for seam in (self.patch.seam, self.patch.key_seam, self.patch.call_seam, self.patch.fused_seam):
            if seam is not None:
                seam.clear()  # an attention that raised left its arming


# The patches whose hooks are on a model now (weakly: a dropped patched model leaves with its patch). The test
# suite checks after every test that none is left (tests/conftest.py).
HOOKED: "weakref.WeakSet[ToMePatch]" = weakref.WeakSet()


class ToMePatch:
    """The hooks ToMe puts on one root model, and what they share."""

    def __init__(self, root: Any, args: Any, host: Any, xp: Any):
        self.root, self.args, self.host, self.xp = root, args, host, xp
        self.eager_xp = getattr(xp, "eager", xp)  # the backend's variant for calls no graph compiler traces
        # Read by the hooks inline, each where the host gives it: the attribute naming a tensor's device (read by
        # the builtin getattr: a block's input on its sub-layer's device needs no on_device_of) and the plain tensor
        # type (tokens of that exact type need no on_local_tokens)
        self.device_attr: Optional[str] = getattr(host, "device_attr", None)
        self.plain_tensor: Any = getattr(host, "plain_tensor", None)
        self.clock: Any = None  # a clock.StepClock when a pipeline was patched with reuse_steps > 1 or a schedule
        self.references: Any = None  # a references.ReferenceSplit when its pipeline joins reference tokens
        self.slot = 0  # this denoiser's place among its pipeline's (the clock's keys)
        self.host_ratio: Optional[float] = None  # a scheduled ratio the host's loop set for its next call (ComfyUI)
        self.blocks = transformer_blocks(host, root)
        self.kinds: List[BlockKind] = [block_kind(block) for block in self.blocks]
        self.kind_names = [type(block).__name__ for block in self.blocks]
        self.layout = layout_of(root, root_kind(root), xp)
        # Whether the layout keeps the base image_tokens (the whole input) and placed (a head and a tail alone to place)
        self.base_image_tokens = type(self.layout).image_tokens is Layout.image_tokens
        self.base_placed = type(self.layout).placed is Layout.placed
        self.latent_spec = InputSpec.find(root, LATENT, first_positional=True)
        self.timestep_spec = InputSpec.find(root, TIMESTEP, first_positional=False)
        self.matcher = Matcher(self)
        self._hooked: List[Any] = []
        self.seam: Any = None  # the host's attention dispatch seam, while this patch uses it (install/detach)
        self.key_seam: Any = None  # the host's SDPA seam, while this patch weighs keys (key_weights.py)
        self.call_seam: Any = None  # a function its blocks call by name, while a span unmerges there (unmerge_at.py)
        # The host's SDPA seam, once a downsampled attention was found fused (downsample_sites.arm_fused)
        self.fused_seam: Any = None
        # Whether a coordinate layout matches each sample on its own (install: every rotary table can follow).
        self.per_sample = False
        # A plain int for the per-call path (paddle's SOT translator reads plain values best); downsample has none.
        self.bands = args.bands or 1
        self.downsampling = args.mode == "downsample"
        self.parked: set = set()  # blocks whose hooks park() took off
        self.checked_processors: dict = {}  # (block, attention) -> the processor downsampling last found fit
        self.entries: List[BlockEntry] = []  # each block's entry hook (install)
        # Blocks compiled on their own (regional_call): (the device their index tensors are on,), None before any, and
        # whether each entry's exit is seated
        self.rows_on: Any = None
        self.exits_seated = False
        self._init_runtime()

    def _init_runtime(self) -> None:
        self.calls = CallStacks(self.host)
        self.regional_lock = threading.RLock()  # held by a call whose blocks are compiled on their own (enter_root)
        self.replay = Replay()
        self.observers: List[Any] = []  # observe.Observation objects recording this patch's calls

    # ---- copies: runtime state is per object and never copied ----
    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        for name in ("calls", "replay", "observers", "regional_lock"):
            state.pop(name)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._init_runtime()
        self.matcher.reset()  # a copy keeps no matchings
        if self._hooked:  # a copy of an installed patch: its model's copy holds the hooks
            HOOKED.add(self)
        for seam in (self.seam, self.key_seam, self.call_seam, self.fused_seam):
            if seam is not None:
                seam.open(self)  # the copy's hooks use the process's seams as well

    # ---- lifecycle ----
    def validate(self) -> None:
        guards.validate(self)

    def install(self, mark: bool = True) -> None:
        """Hook the root and the blocks; with `mark`, the root names its patch (PATCH_ATTR), as a patch that
        stays does. A host that installs for one call only (ComfyUI: hosts/comfyui_patcher.py) leaves the root unmarked.
        `detach` undoes the hooks."""
        host, root_hooks = self.host, RootHooks(self)
        HOOKED.add(self)
        self.per_sample, rotates_at_dispatch = rows_per_sample(self)
        if rotates_at_dispatch:
            open_seam(self)
        add_hook(self, self.root, host.add_pre_hook, root_hooks.pre)
        add_hook(self, self.root, functools.partial(host.add_post_hook, always_call=True), root_hooks.post)
        alike: dict = {}  # what tells blocks apart besides their random row -> the first such block (BlockEntry.like)
        for index, (block, kind) in enumerate(zip(self.blocks, self.kinds)):
            tokens = (InputSpec(kind.tokens[0], kind.token_position) if kind.token_position is not None
                      else InputSpec.find(block, kind.tokens, first_positional=True))
            entry_hook = BlockEntry(self, index, tokens)
            # Innermost in the block's forward chain, ahead of every other link of the patch there (torch: one Python
            # call a block, where a forward pre-hook costs torch three; else a forward pre-hook)
            entry_hook.link = around(self, block, entry_hook.pre, None)
            chosen = self.args.blocks is None or index in self.args.blocks
            entry_hook.like = alike.setdefault((self.kind_names[index], self.layout.block_class(index), chosen), index)
            self.entries.append(entry_hook)
            if self.args.mode == "downsample":
                install_downsample(self, index, block, kind)
            else:
                install_merge(self, index, block, kind)
        key_weights.weigh_at_dispatch_where_all_dispatch(self)
        if mark:
            setattr(self.root, PATCH_ATTR, self)

    def seat_span_cache(self, index: int, span: Span) -> None:
        """install.seat_span_cache, as a span's start asks for it at each call (a cache added after the patch)."""
        seat_span_cache(self, index, span)

    def park(self, blocks: List[int]) -> None:
        """Take off the hooks of `blocks`, which the layout found never reduce (a UNet's blocks below the levels
        ToMe merges: which level a block sits at is its architecture's), so that they cost nothing from the next
        call on. Eager calls only; remove_patch takes off the rest as ever. (A later call whose finest attention level
        no block's token count explains, an odd latent size, would have taken a deeper level as the finest: its
        blocks there stay parked and unmerged, never merged wrongly.)"""
        idle = set(blocks)

        def owns(target: Any) -> bool:
            return getattr(target, "patch", None) is self and getattr(target, "index", None) in idle

        for module in self._hooked:
            remove_owned_hooks(self.host, module, self, owns)
        self.parked.update(idle)

    def detach(self) -> None:
        """Take this patch's hooks off (what it keeps across calls stays)."""
        for module in self._hooked:
            remove_owned_hooks(self.host, module, self)
        self._hooked.clear()
        self.entries.clear()
        self.rows_on, self.exits_seated = None, False
        HOOKED.discard(self)
        for seam in (self.seam, self.key_seam, self.call_seam, self.fused_seam):
            if seam is not None:
                seam.close(self)
        self.seam = self.key_seam = self.call_seam = self.fused_seam = None

    def remove(self) -> None:
        self.detach()
        self.replay.clear()
        self.matcher.reset()  # drops kept matches of every thread
        self.clock = None  # the pipeline's clock (targets.remove detaches it from the scheduler)
        self.references = None  # the pipeline's reference split (targets.remove detaches it)
        if self.root.__dict__.get(PATCH_ATTR) is self:
            delattr(self.root, PATCH_ATTR)

    # ---- a call ----
    def enter_root(self, module: Any, args: tuple, kwargs: dict) -> None:
        host, call = self.host, CallState()
        eager = call.eager = not host.is_compiling()
        # Blocks compiled on their own find their call through `calls.innermost` alone (a trace reads no thread's
        # stack): such calls of this patch run one at a time, each holding the lock until the exit hook releases it
        regional = eager and host.compiled_blocks(self.blocks)
        if regional:
            self.regional_lock.acquire()
        # Pushed before any error: the always-called exit hook pops it (and releases the lock) even when this raises.
        self.calls.push(call, eager)
        call.regional = regional
        call.xp = self.eager_xp if eager else self.xp
        if eager:
            if self.observers:
                call.watch = CallWatch(self.observers, type(module).__name__)
            if self.seam is not None:
                self.seam.cover_new_backends()
            elif self.key_seam is not None and hasattr(self.key_seam, "cover_new_backends"):
                self.key_seam.cover_new_backends()  # the weights at the dispatch (key_weights)
        latent = self.latent_spec.get(args, kwargs)
        if latent is None:
            raise TypeError(f"ToMe found no '{self.latent_spec.name}' input in this call of {type(module).__name__}")
        shape = self.layout.latent_shape(latent)
        self.layout.read(call, module, args, kwargs, shape, self.latent_spec.name)
        if eager:  # index constants and plans kept across calls, per size and device (a traced call makes its own)
            kept = self.matcher.kept.of((tuple(shape), getattr(latent, self.device_attr or "device", None)))
            call.memo, call.plans = kept.memo, kept.plans
        if regional:
            self.regional_call(call, latent)
        call.band = self._band(module)
        if self.timestep_spec is not None:
            call.timestep = self.timestep_spec.get(args, kwargs)
        if self.clock is not None and self.clock.schedule is not None:
            if eager:
                self.clock.follow()
            call.ratio = self.clock.ratio  # a float set on the host as the step began
        elif self.host_ratio is not None:
            call.ratio = self.host_ratio
        if self.matcher.steps_reused > 1 and not host.grad_enabled():  # training never reuses (see matcher)
            if self.clock is None:
                call.step = self.matcher.denoising_step(call.timestep)
            elif eager:
                self.clock.follow()
            if self.args.restore_tokens:
                call.restore = self.matcher.call_restore()
        if self.replay and eager and not host.grad_enabled():
            self.replay.clear()  # inference after training: nothing left to recompute

    def regional_call(self, call: CallState, latent: Any) -> None:
        """An eager call whose blocks are compiled on their own (diffusers' compile_repeated_blocks): each block runs
        in a call of its own (CallState.for_block), which takes its random pattern's row from the block's index as a
        tensor on the device (a graph compiler would make a graph per block of an int), and leaves it at the block's
        exit. What shares work across blocks or steps through Python state cannot cross a compiled block's edge."""
        if not self.exits_seated:  # the first such call (apply_patch checked blocks compiled before it)
            guards.check_blocks_compiled_alone(self)
        if self.downsampling:  # what the blocks' downsampling would read on the host, read here (eager)
            call.down_grid = self.layout.host_downsample_grid(call, self.host)
        like = latent[0] if isinstance(latent, (list, tuple)) else latent  # Z-Image: a list of latents
        device = getattr(like, self.device_attr or "device", None)
        if self.rows_on is None or self.rows_on[0] != device:
            for index, entry in enumerate(self.entries):
                entry.row = self.host.index_tensor(index, like)
            self.rows_on = (device,)
        if not self.exits_seated:
            for entry in self.entries:
                if entry.link is not None:
                    entry.link.post = entry.post
            self.exits_seated = True

    def _band(self, module: Any) -> Optional[Band]:
        """This call's band rule: a context-parallel rank's own band, bands=P's every band, or None."""
        split = self.host.context_split(module)
        if split is not None:
            guards.check_context_split(self, split)
            if self.args.proportional_attention:
                key_weights.weigh_at_dispatch(self)
            return Band(split.count, split.index)
        return Band(self.bands) if self.bands > 1 else None

    def watch(self) -> Optional[CallWatch]:
        """The current call's observations, or None (nothing observes, or a graph is being traced)."""
        call = self.calls.top()
        return None if call is None else call.watch

    # The per-call path: a hook finds its call once (calls.top) and asks with it.
    def site_merge(self, index: int, flag: str, like: Any = None) -> Any:
        """Block `index`'s merge for the site `flag` turns on in the current call (call_merge)."""
        return self.call_merge(self.calls.top(), index, flag, like)

    def call_merge(self, call: Optional[CallState], index: int, flag: str, like: Any = None) -> Any:
        """Block `index`'s merge in `call` for the site `flag` turns on: with per-site ratios the block holds one
        merge per site (all from one matching), else one merge for every site. `like`: the tokens the site holds."""
        if call is None:
            merge = self.block_merge(call, index, like)
        else:  # block_merge, inline: asked at every site of every block
            if index in call.pending:  # the block's first hooked sub-layer: match now
                self.settle(call, index, like)
            merge = call.merges.get(index)
        return merge.get(flag) if type(merge) is dict else merge

    def site_restore(self, index: int, flag: str) -> Optional[SiteRestore]:
        return self.call_restore(self.calls.top(), index, flag)

    def call_restore(self, call: Optional[CallState], index: int, flag: str) -> Optional[SiteRestore]:
        """Block `index`'s restoring for the site `flag` turns on in `call` (restore_tokens), or None."""
        kept = None if call is None else call.restoring.get(index)
        if kept is None:
            return None
        matching, merge = kept
        merge = merge.get(flag) if isinstance(merge, dict) else merge
        return None if merge is None else SiteRestore(matching, merge, call.restore)

    def current_merge(self, index: int, like: Any = None) -> BlockMerge:
        return self.block_merge(self.calls.top(), index, like)

    def block_merge(self, call: Optional[CallState], index: int, like: Any = None) -> BlockMerge:
        """Block `index`'s merge in `call`, matched at its first hooked sub-layer, on the device of the
        tokens that sub-layer holds (`like`): a model split over devices moves the block's input inside the
        block (accelerate's device hooks), after the block's entry hook recorded it."""
        if call is not None:
            if index in call.pending:  # the block's first hooked sub-layer: match now
                self.settle(call, index, like)
            return call.merges.get(index)
        # A block running after its root's call: a checkpointed block recomputed in backward.
        return self.replay.get(index) if self.host.grad_enabled() else None

    def settle(self, call: CallState, index: int, like: Any) -> None:
        """Block `index`'s merge in `call`, from its entry's input (`call.pending`), on the device of `like` (the
        tokens its first hooked sub-layer holds; None: where the input is)."""
        block, x, grad = call.pending.pop(index)  # grad: gradients were on when the block was entered
        own = index
        if call.row is not None:  # a block's own call: the first block like it stands in (CallState.for_block)
            index = call.like
        attr = self.device_attr
        if like is not None and (attr is None or getattr(x, attr, None) != getattr(like, attr, None)):
            x = self.host.on_device_of(x, like)
        watch = call.watch
        started = None if watch is None else watch.start()
        layout = self.layout
        # The base layout's image tokens are the whole input and its placing has nothing to place without a head or
        # a tail: each skipped where the layout keeps the base's (every block of every call asks).
        matching = self.matcher.block_merge(index, block, x if self.base_image_tokens else
                                            layout.image_tokens(call, x, index), call, grad)
        plain = self.base_placed and not call.tail and not call.head
        merge = matching if plain else layout.placed(call, x, index, matching)
        if call.restore is not None and merge is not None:
            call.restoring[index] = (matching, merge)
            if call.restore.keep:
                merge = None  # the window's first step runs unmerged and keeps residuals (restore.py)
        call.merges[index] = merge
        if watch is not None:
            watch.stop("downsample" if self.args.mode == "downsample" else "match", started)
            watch.used(index, self.kind_names[index], merge)
        if merge is not None and grad and not self.host.is_compiling():
            self.replay.keep(own, merge)

