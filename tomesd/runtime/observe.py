"""What a patch did, seen from outside: the records of the public inspection seam.

`tomesd.observe(model)` (targets.observe, which finds the patches) records, for every call of a patched denoiser inside the `with` block, per block:
the tokens in and out at each site that merged (or the keys and values downsampled), whether the block's
matching was computed in that call or reused (from an earlier step, or from its level's first block), and
the merge itself. With `timing=True` it also adds up the seconds spent in ToMe's own work (matching,
merge, unmerge, downsampling). Tests and the bench observe through it; nothing replaces the runtime's
functions.

Recording happens on the host, in eager mode only (a graph compiler traces no recording), and reads only
shapes: an observed forward still reads no tensor value and still runs on the `meta` device. Observers
are per patch object and never copied with the model.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

# The kinds of ToMe's own work that `timing=True` adds up.
WORK = ("match", "merge", "unmerge", "downsample")


@dataclass
class BlockRecord:
    """One block in one call. `sites`: site name -> (tokens in, tokens out) for each time the site ran
    (a merging site's image tokens in and out; `downsample`: the keys and values in and out)."""

    index: int
    kind: str
    computed: int = 0  # matchings (or downsample index maps) computed for this block in this call
    reused: int = 0  # matchings taken from an earlier step's call or from another block of the call
    merge: Any = None  # what the block used: a TokenMerge, {site: TokenMerge}, a KVDownsample, or None
    sites: Dict[str, List[Tuple[int, int]]] = field(default_factory=dict)

    def tokens(self, site: str) -> List[Tuple[int, int]]:
        return self.sites.get(site, [])


@dataclass
class CallRecord:
    """One call of one patched denoiser (a UNet, a transformer, a ControlNet)."""

    model: str
    blocks: Dict[int, BlockRecord] = field(default_factory=dict)

    @property
    def computed(self) -> int:
        return sum(block.computed for block in self.blocks.values())

    @property
    def reused(self) -> int:
        return sum(block.reused for block in self.blocks.values())

    def merged_blocks(self, site: str = "attn") -> List[int]:
        """Indices of the blocks whose `site` ran on fewer tokens than it was given."""
        return sorted(i for i, b in self.blocks.items() if any(o < n for n, o in b.tokens(site)))


class Observation:
    """Everything recorded while observing: `calls` in the order they began, `seconds` per kind of work."""

    def __init__(self, timing: bool = False, sync: Optional[Callable[[], None]] = None):
        self.timing = timing
        self.sync = sync  # called around each timed piece of work (an accelerator runs asynchronously)
        self.calls: List[CallRecord] = []
        self.seconds: Dict[str, float] = {work: 0.0 for work in WORK}

    @property
    def total_seconds(self) -> float:
        return sum(self.seconds.values())

    def begin_call(self, model: str) -> CallRecord:
        record = CallRecord(model)
        self.calls.append(record)
        return record

    def clear(self) -> None:
        self.calls.clear()
        self.seconds = {work: 0.0 for work in WORK}

class CallWatch:
    """The observations one call reports to, and its record in each (made as the call begins)."""

    __slots__ = ("observations", "records")

    def __init__(self, observations: List[Observation], model: str):
        self.observations = list(observations)
        self.records = [observation.begin_call(model) for observation in self.observations]

    def blocks(self, index: int, kind: str) -> List[BlockRecord]:
        found = []
        for record in self.records:
            block = record.blocks.get(index)
            if block is None:
                block = record.blocks[index] = BlockRecord(index, kind)
            found.append(block)
        return found

    def note(self, index: int, kind: str, computed: int = 0, reused: int = 0) -> None:
        """A matching computed for block `index`, or taken from a cache or another block."""
        for block in self.blocks(index, kind):
            block.computed += computed
            block.reused += reused

    def used(self, index: int, kind: str, merge: Any) -> None:
        for block in self.blocks(index, kind):
            block.merge = merge

    def site(self, index: int, kind: str, site: str, tokens_in: int, tokens_out: int) -> None:
        site = site[len("merge_"):] if site.startswith("merge_") else site  # "merge_attn" -> "attn"
        for block in self.blocks(index, kind):
            block.sites.setdefault(site, []).append((tokens_in, tokens_out))

    def start(self) -> Optional[float]:
        """The clock as a piece of ToMe's work starts, or None when no observation times it."""
        timing = [o for o in self.observations if o.timing]
        if not timing:
            return None
        for sync in {o.sync for o in timing if o.sync is not None}:
            sync()
        return time.perf_counter()

    def stop(self, work: str, started: Optional[float]) -> None:
        if started is None:
            return
        timing = [o for o in self.observations if o.timing]
        for sync in {o.sync for o in timing if o.sync is not None}:
            sync()
        elapsed = time.perf_counter() - started
        for observation in timing:
            observation.seconds[work] += elapsed
