"""What one call of a patched denoiser computes, and where it lives while the call runs.

One owner per state: a call's state is one entry of a call stack, per thread in eager mode (concurrent
calls at different resolutions never meet), and in a plain list while a graph compiler traces
(thread-locals break graphs; a compiled graph holds no Python state). It is dropped when the call returns.
Checkpointing replays a block after its call ended: with gradients on, each block's latest merge is kept
(`Replay`) so the recompute merges exactly as the forward did.
"""
from __future__ import annotations

import threading
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

# What a block merges (or downsamples) with in a call: a TokenMerge, {site flag: TokenMerge} (per-site
# ratios), a KVDownsample, or None.
BlockMerge = Any


class CallState:
    """What one call of a root computes; dropped when the call returns."""

    __slots__ = ("grid", "coords", "ids", "tail", "head", "timestep", "key", "draws", "finest_level", "merges",
                 "pending", "shared", "step", "ratio", "watch", "band", "restore", "restoring", "unified", "partitions",
                 "memo", "idle", "outer", "grid_tokens",
                 "images", "eager", "xp", "rotary", "regional", "row", "down_grid", "plans", "like")

    def __init__(self) -> None:
        # The layout's reading of this call's token grid, from shapes only (tomesd/layouts/): the latent's
        # (h, w) on a UNet, the patch grid (h, w) of a diffusion transformer, (frames, rows, cols) of a
        # video transformer, Flux's (ids, N).
        self.grid: Any = None
        # Per-token grid coordinates on the device, made by the call's first block from `grid` (Flux, Wan,
        # CogVideoX): (rows, cols) or (frames, rows, cols).
        self.coords: Optional[Tuple[Any, ...]] = None
        self.grid_tokens: Optional[int] = None  # the tokens `coords` give (their length), once read
        self.ids: Any = None  # Flux: the ids tensor itself, which tells grids of one token count apart
        # Each image token's image ([N], on the device) when the ids may mark several (layouts.Ids: a reference's
        # tokens after the target's, on a bare model): tokens of different images never merge (tome_core/images.py)
        self.images: Any = None
        self.tail = 0  # reference tokens after the image's, passed whole (references.py: Flux Kontext)
        self.head = 0  # condition tokens before the image's in a block's input, passed whole (Framepack's history)
        # A unified sequence's per-call reading (layouts/unified.py): the text lengths' source, the image's starts
        self.unified: Dict[Any, Any] = {}
        self.timestep: Any = None
        self.key: Any = None  # computed at the call's first random draw, inside the forward
        self.draws: Dict[int, Any] = {}  # cells per block -> [blocks, cells] dst places
        # Every block's partition of a grid (or of the coordinates), made at the call's first block on it
        self.partitions: Dict[Any, Any] = {}
        # Index constants by shape (tome_core's Matching): the patch's own dict for this size and device in eager mode,
        # kept across calls (runtime/kept.py); a fresh one while a graph compiler traces (a traced tensor must not
        # outlive its trace)
        self.memo: Dict[Any, Any] = {}
        # Each block's plan by the shapes it was made for (Matcher._plan): the patch's own for this size, kept across
        # eager calls (runtime/kept.py); a traced call plans as it traces and keeps none
        self.plans: Dict[Any, Any] = {}
        # Blocks the layout found at a level ToMe never merges (the UNets' level rule): their hooks come off
        # after the call (ToMePatch.park)
        self.idle: List[int] = []
        self.eager = True  # False while a graph compiler traces the call (its hooks then touch no Python-only state)
        # The array backend of this call: the backend's eager variant (`xp.eager`: torch's reads shapes with no
        # Python frame) unless a graph compiler traces it; None: the patch's own
        self.xp: Any = None
        self.outer: Optional["CallState"] = None  # the call this one runs inside (CallStacks.innermost after it)
        # A rotary (cos, sin) pair the call's blocks take, joined along its last axis for one gather a block
        # (runtime/sites.py: gather_pair): (cos, sin, joined, the tables' versions), eager calls only
        self.rotary: Optional[Tuple[Any, Any, Any, Any]] = None
        self.finest_level: Optional[int] = None  # UNets: level of the call's first attention block
        # Whether this eager call's blocks are compiled on their own (diffusers' compile_repeated_blocks): each block
        # then runs in a call of its own (CallState.for_block), traced alike for every block
        self.regional = False
        # A block's own call: the block's index as an int64 [1] tensor on the device (its random pattern's row), which
        # a graph compiler takes as an input, not as a constant (one graph serves every block); None elsewhere
        self.row: Any = None
        # A block's own call: the first block like this one (its kind, what its layout tells of it, whether `blocks`
        # picks it), whose index stands in for this block's wherever a plan or layout reads one: a graph per such
        # class of blocks, not per block
        self.like: Optional[int] = None
        # mode='downsample''s (frames, rows, cols) where the latent's shape does not give them (Flux's ids): read on the
        # host by the eager root of blocks compiled on their own (ToMePatch.regional_call), for the blocks to take
        self.down_grid: Any = None
        self.merges: Dict[int, BlockMerge] = {}
        self.pending: Dict[int, Tuple[Any, Any, bool]] = {}  # block -> (block, its input, grad mode), until used
        self.shared: Dict[Any, Any] = {}  # per-level results every block of the call may use
        self.step: int = 0  # denoising step number (reuse_steps > 1 on a bare model), from the timestep's value
        self.ratio: Optional[float] = None  # this step's ratio under a ratio_schedule (from the pipeline's clock)
        self.watch: Any = None  # observe.CallWatch: the observations of this call (tomesd.observe), eager only
        # The band rule (tome_core/bands.py): None (one matching over the grid), or a Band: this process's
        # band of a context-parallel run, or every band of bands=P on one process.
        self.band: Optional[Band] = None
        # restore_tokens: the call's restore.CallRestore, and per block (the matcher's matching, its merge), also
        # kept at the window's unmerged step, where `merges` holds None
        self.restore: Any = None
        self.restoring: Dict[int, Tuple[Any, Any]] = {}

    @classmethod
    def for_block(cls, outer: "CallState", xp: Any, row: Any, like: int) -> "CallState":
        """A call of one block inside the eager call `outer`, for a block compiled on its own: it reads what `outer`
        read from the root's inputs, computes everything else itself, and holds that one block's merge. Nothing in it
        names the block's index (OneBlock ignores its keys; `row` is a tensor; `like` is the first block like it), so a
        compiled block's graph is the same for every block of its class and shape."""
        call = cls()
        call.eager, call.xp, call.row, call.outer, call.like = False, xp, row, outer, like
        call.grid, call.ids, call.tail, call.head = outer.grid, outer.ids, outer.tail, outer.head
        call.unified = dict(outer.unified)
        call.timestep, call.band, call.ratio, call.step = outer.timestep, outer.band, outer.ratio, outer.step
        call.finest_level, call.down_grid = outer.finest_level, outer.down_grid
        call.pending, call.merges, call.idle = OneBlock(), OneBlock(), _NoIdle()
        return call


class OneBlock:
    """A block's own call's dict of its one block (pending input, merge): keys are ignored, so a traced block never
    reads its index (a graph compiler would specialize on it: a graph per block)."""

    __slots__ = ("value", "full")

    def __init__(self) -> None:
        self.value: Any = None
        self.full = False

    def __contains__(self, key: Any) -> bool:
        return self.full

    def get(self, key: Any, default: Any = None) -> Any:
        return self.value if self.full else default

    def pop(self, key: Any, default: Any = None) -> Any:
        value = self.value if self.full else default
        self.value, self.full = None, False
        return value

    def __setitem__(self, key: Any, value: Any) -> None:
        self.value, self.full = value, True


class _NoIdle:
    """A block's own call parks nothing (its hooks stay on a compiled block, whose graph would otherwise change)."""

    __slots__ = ()

    def append(self, item: Any) -> None:
        return None

    def __len__(self) -> int:
        return 0


class Band(NamedTuple):
    """`count` bands of the token sequence; `index`: the one this process holds (a context-parallel rank's),
    or None when it holds them all (bands=P on one process)."""

    count: int
    index: Optional[int] = None


class _ThreadCalls(threading.local):
    def __init__(self) -> None:
        self.stack: List[CallState] = []


class CallStacks:
    """The stack of calls in flight: one per thread in eager mode, one plain list while a graph is traced.

    Every hook of every block asks for the current call, so the common case costs no question to the host:
    while one thread alone runs the patch, `innermost` is its innermost call (set and restored around each call,
    traced or not). Calls from a second thread at once mark the stacks `shared` until none is left, and then
    each hook finds its own thread's call (`top`)."""

    def __init__(self, host: Any) -> None:
        self.host = host
        self._compiling = host.is_compiling
        # A host whose graph tracer can run a block's hooks apart from its root's (paddle's AST to_static) asks at every
        # hook, where its is_compiling refuses the trace by name.
        self._ask_each_hook = getattr(host, "asks_each_hook", False)
        self._threads = _ThreadCalls()
        self._traced: List[CallState] = []
        self.innermost: Optional[CallState] = None
        self.shared = False
        # Whether `innermost` is every hook's call (no second thread, no host asking at each hook): hooks then read
        # it inline, `calls.innermost if calls.direct else calls.top()`, with no Python call
        self.direct = not self._ask_each_hook
        self._active = 0  # eager calls in flight, every thread
        self._owner: Optional[int] = None  # the thread they belong to while not shared
        self._lock = threading.Lock()

    def push(self, call: CallState, eager: bool) -> None:
        call.outer = self.innermost
        if not eager:
            self._traced.append(call)
            self.innermost = call
            return
        self._threads.stack.append(call)
        with self._lock:
            thread = threading.get_ident()
            if self._active and thread != self._owner:
                self.shared, self.direct = True, False
            self._active += 1
            self._owner = thread if self._active == 1 else self._owner
            if not self.shared:
                self.innermost = call

    def enter_block(self, local: CallState) -> None:
        """`local` (CallState.for_block) is every hook's call until leave_block: the block's hooks then find it as
        they find any call."""
        if self.shared:
            self._threads.stack.append(local)
        else:
            self.innermost = local

    def leave_block(self, local: CallState) -> None:
        outer = local.outer
        if outer is not None and outer.finest_level is None:  # the first attention block's level, for the others
            outer.finest_level = local.finest_level
        if self.shared:
            stack = self._threads.stack
            if stack and stack[-1] is local:
                stack.pop()
        elif self.innermost is local:
            self.innermost = outer

    def pop(self) -> Optional[CallState]:
        if self._compiling():
            call = self._traced.pop() if self._traced else None
            self.innermost = None if call is None else call.outer
            return call
        stack = self._threads.stack
        call = stack.pop() if stack else None
        with self._lock:
            self._active = max(self._active - 1, 0)
            if not self._active:
                self.shared, self._owner, self.innermost = False, None, None
                self.direct = not self._ask_each_hook
            elif not self.shared and call is not None:
                self.innermost = call.outer
        return call

    def current(self) -> List[CallState]:
        """This thread's stack of calls (the traced one while a graph compiler traces)."""
        return self._traced if self._compiling() else self._threads.stack

    def top(self) -> Optional[CallState]:
        if self._ask_each_hook:
            self._compiling()
        if not self.shared:
            return self.innermost
        stack = self._traced if self._compiling() else self._threads.stack
        return stack[-1] if stack else None


class Replay:
    """Each block's latest merge while gradients are on, for a checkpointed block recomputed in backward
    after its root's call ended."""

    def __init__(self) -> None:
        self.merges: Dict[int, BlockMerge] = {}

    def keep(self, index: int, merge: BlockMerge) -> None:
        self.merges[index] = merge

    def get(self, index: int) -> BlockMerge:
        return self.merges.get(index)

    def clear(self) -> None:
        self.merges.clear()

    def __bool__(self) -> bool:
        return bool(self.merges)
