"""Each block's matching in a call: planned by the layout, computed by tome_core, kept across steps by the
match cache (reuse.py) or shared across a level's blocks, with its random dst pattern.

No host reads: the random pattern is keyed by (seed, timestep tensor, block index) with device ops, so a
call never syncs and a graph compiler traces it whole. A bare model's reuse_steps reads its timestep on the
host (eager only, refused under a compiler); a pipeline's clock counts steps instead.
"""
from __future__ import annotations

import math
from itertools import repeat
from typing import Any, Dict, Optional, Tuple

from tome_core import band_coordinate_merges, band_range, banded_coordinate_merges, banded_grid_merges, \
    compute_coordinate_merges, compute_downsample, compute_merges, coordinate_cells, coordinate_partitions, \
    grid_partitions, num_cells, rng

from .calls import BlockMerge, CallState
from .guards import CHUNKED_FF
from .kept import KeptBySize
from .restore import CallRestore
from .reuse import TimestepSteps

# A partition table's device where the host cannot say it (no device_attr): every block then moves its partition
# there, as on_device_of does (a no-op on the block's own device).
_ANY = object()


class Matcher:
    """The matchings of one patch. `patch` gives: args, xp and host, layout, blocks, clock and slot."""

    def __init__(self, patch: Any) -> None:
        self.patch = patch
        args = patch.args
        # Plain values for the per-call path: paddle's SOT translator cannot simulate ToMeArgs' properties
        # inside a to_static'd forward (it crashed on steps_reused, and raised on rand_seed once a graph
        # break left `_offsets` to a resume function).
        self.steps_reused, self.reuses, self.seed = args.steps_reused, args.reuses, args.rand_seed
        self.steps = TimestepSteps()  # a bare model's steps and kept matchings (reuse_steps > 1)
        # Index constants and each block's plans, per size and device, for eager calls (CallState.memo and .plans)
        self.kept = KeptBySize(args.kept_sizes)
        # The attribute naming a tensor's device, where the host gives one (read by the builtin getattr: no Python
        # frame, and traceable): a block on the partition table's device then skips on_device_of
        self.device_attr = getattr(patch.host, "device_attr", None)

    def __getstate__(self) -> dict:
        return self.__dict__  # copies build their own constants and plans (KeptBySize copies its limit alone)

    def reset(self) -> None:
        self.steps = TimestepSteps()  # drops this patch's kept matchings in every thread
        self.kept = KeptBySize(self.kept.limit)

    def denoising_step(self, timestep: Any) -> int:
        """This thread's denoising step number on a bare model: it advances when the timestep's value changes."""
        host = self.patch.host
        if host.is_compiling():
            raise RuntimeError(
                "reuse_steps > 1 cannot run inside a compiled graph: telling a new denoising step from "
                "the same one needs the timestep's value on the host. Compile with reuse_steps=1 or "
                "mode='downsample', or run this patch eagerly."
            )
        if timestep is None:
            raise ValueError("reuse_steps needs the timestep of each call, and this call passed None")
        shape = tuple(getattr(timestep, "shape", ()))
        if len(shape) > 1:
            # One timestep per frame or token (Cosmos Video2World, Wan 2.2 TI2V): the first ones may be a clean
            # condition frame's, the same at every step, so the step would never advance and a matching made at
            # the first step would be kept for the whole run.
            raise ValueError(
                f"reuse_steps on a bare {type(self.patch.root).__name__} tells its steps apart by the timestep's value, and "
                f"this call's timestep has shape {list(shape)} (one per frame or token, whose first may be a "
                f"condition's, constant over the steps). Patch the pipeline instead (its scheduler counts the "
                f"steps), or use reuse_steps=1")
        value = host.host_float(timestep)
        return self.steps.advance(value, rng.timestep_key(self.patch.xp, value), self.steps_reused)

    def call_restore(self) -> CallRestore:
        """restore_tokens: this call's place in its step and whether its step keeps residuals or adds them, from
        whoever counts the steps (the pipeline's clock, else the timestep rule): host values only."""
        if self.patch.host.is_compiling():
            raise RuntimeError(
                "restore_tokens runs eagerly: its steps keep and add residuals by the Python-side step count. "
                "Compile with reuse_steps alone (restore_tokens=False), or run this patch eagerly.")
        clock = self.patch.clock
        counter = clock if clock is not None else self.steps
        cache = clock.kept if clock is not None else self.steps.cache
        return CallRestore(cache, cache.next_call(self.patch.slot), counter.window_begins(), counter.window())

    def block_merge(self, index: int, block: Any, x: Any, call: CallState, grad: bool) -> BlockMerge:
        """Block `index`'s merge (or downsampling) from its image tokens `x`, or None where it does not reduce."""
        patch, args = self.patch, self.patch.args
        xp = call.xp or patch.xp  # the call's: eager or traced (CallState.xp)
        batch, num_tokens = xp.shape(x)[:2]
        # Every band this process matches (bands=P on one process) is planned as one band: its share of r.
        band = call.band
        bands = band.count if band is not None and band.index is None else 1
        # _plan's kept plan, looked up inline (every block of every call asks), by everything the plan reads (the
        # settings are the patch's; a grid that plans read is a tuple of ints). A string key: paddle's SOT translator
        # cannot simulate a dict keyed by tuples. Eager calls only: a traced call plans as it traces, once per graph,
        # and its values may be symbolic (a ratio schedule's ratio, a float dynamo does not specialize), which no
        # key can be made of.
        num_tokens //= bands
        key = kept = None
        if call.eager:
            key = (f"{index} {batch} {num_tokens} {bands} {call.ratio} {call.finest_level} "
                   f"{call.grid if patch.layout.plans_by_grid else None}")
            kept = call.plans.get(key)
        if kept is None:
            plan = self._plan(index, call, batch, num_tokens, bands, key)
        else:
            plan, call.finest_level, idle = kept
            if idle:
                call.idle.append(index)
        if plan is None:
            return None
        if args.mode == "downsample":
            if call.tail:
                raise ValueError(
                    f"mode='downsample' cannot leave a reference image's {call.tail} tokens out (Flux Kontext, "
                    f"Qwen-Image-Edit): use mode='merge', which merges the target's tokens and passes the "
                    f"reference's whole")
            frames, h, w = patch.layout.downsample_grid(call, plan, patch.host)
            key = ("downsample", batch, frames, h, w)
            if key not in call.shared:  # the same index map for every block of the level
                call.shared[key] = compute_downsample(
                    xp, x, batch, w, h, args.downsample_factor, args.downsample_method, frames)
                if call.watch is not None:
                    self._note(call, index, computed=1)
            elif call.watch is not None:
                self._note(call, index, reused=1)
            return call.shared[key]
        if args.merge_mlp and getattr(block, "_chunk_size", None) is not None:
            raise ValueError(CHUNKED_FF)
        if not self.reuses:
            return self._match(index, x, plan, call)
        # Reused matches: a block's own (or, with share_across_blocks, its level's first block's), kept for
        # reuse_steps denoising steps while the batch and the grid stay the same.
        key = ("level", plan.level) if args.share_across_blocks else index
        if key in call.shared:
            self._note(call, index, reused=1)
            return call.shared[key]
        merge = self._kept_or_matched(index, key, x, plan, call, grad)
        call.shared[key] = merge
        return merge

    def _plan(self, index: int, call: CallState, batch: int, num_tokens: int, bands: int, key: Any) -> Any:
        """The layout's plan of block `index`, kept under `key`, everything it reads (block_merge): the same shapes
        plan alike at every call, so the plan is made once per block and shape, not per call (None: not kept)."""
        idle = len(call.idle)
        plan = self.patch.layout.plan(self.patch.args, call, batch, num_tokens, index, bands)
        if key is None:  # a traced call: nothing kept
            return plan
        plans = call.plans
        if len(plans) > 65536:  # a ratio schedule's every ratio at one size: bounded all the same
            plans.clear()
        plans[key] = (plan, call.finest_level, len(call.idle) > idle)
        return plan

    def _kept_or_matched(self, index: int, key: Any, x: Any, plan: Any, call: CallState, grad: bool) -> Any:
        """Kept across calls only when steps are reused (share_across_blocks alone lives within a call), and
        never while training: there each call is a new batch of images."""
        patch = self.patch
        shape = patch.layout.reuse_shape(call, plan, (call.xp or patch.xp).shape(x)[0])
        clock = patch.clock
        if clock is not None and self.steps_reused > 1 and not grad:
            # The pipeline's loop says which step this is; the clock empties its cache as a window starts, so
            # the window's first call matches and every later call (the step's other guidance half, as Wan's
            # pipeline calls it, and the window's later steps) reuses, as the timestep rule does.
            cache, cache_key, grid, step, window = clock.kept, (patch.slot, key), None, 0, None
        elif self.steps_reused > 1 and not patch.host.is_compiling() and not grad:
            # Flux: grids of one token count differ by their ids; a pipeline passes one ids tensor per run.
            cache, cache_key, grid, step, window = self.steps.cache, key, call.ids, call.step, self.steps_reused
        else:
            return self._match(index, x, plan, call)
        merge = cache.lookup(cache_key, shape, grid, step, window)
        if merge is not None:
            self._note(call, index, reused=1)
            return merge
        merge = self._match(index, x, plan, call)
        cache.store(cache_key, shape, merge, grid, step)
        return merge

    def _match(self, index: int, x: Any, plan: Any, call: CallState) -> Any:
        patch, args = self.patch, self.patch.args
        xp = call.xp or patch.xp
        if call.watch is not None:
            self._note(call, index, computed=1)
        offsets, band = None, call.band
        rs = [r for _, r in plan.site_r] if plan.site_r else [plan.r]  # per-site ratios: one matching, a merge per site
        if call.coords is not None:
            # Each sample matched on its own where every block's rotary rows can follow it (patch.per_sample), else
            # one matching for the batch. Either way one random pattern for the batch (keyed by seed, timestep and
            # block), so a batch split over calls draws alike.
            strides = (args.st, args.sy, args.sx)[-len(call.coords):]  # (sy, sx) on an image, (st, sy, sx) on a video
            per_sample = patch.per_sample
            if band is None:
                # The call's partition table, read inline (_coordinate_partition makes it at the call's first block)
                table = call.partitions.get(("coordinates", args.use_rand))
                if table is None:
                    table = self._coordinate_partition(x, strides, call, xp)
                # (a block's own call holds its own row alone: CallState.for_block)
                order, position, images = table[0][index if args.use_rand and call.row is None else 0]
                if table[2] is _ANY or table[2] != getattr(x, self.device_attr):  # a block on another device
                    order, position = patch.host.on_device_of(order, x), patch.host.on_device_of(position, x)
                    images = None if images is None else patch.host.on_device_of(images, x)
                partition = (order, position, table[1])
                merges = compute_coordinate_merges(xp, x, call.coords, strides, rs, per_sample=per_sample,
                                                   partition=partition, memo=call.memo, images=images)
            else:
                images = None if call.images is None else patch.host.on_device_of(call.images, x)
                coords = tuple(patch.host.on_device_of(c, x) for c in call.coords)
                n = xp.shape(coords[0])[0]  # the whole grid's tokens: `x` holds one band of them
                if args.use_rand:
                    volume = math.prod(strides)  # a space-time cell's places span its frames too
                    offsets = self._offsets(index, x, n // volume, volume, call)  # the whole grid's draw
                if band.index is None:
                    merges = banded_coordinate_merges(xp, x, coords, strides, rs, offsets, band.count, per_sample, images)
                else:  # a context-parallel rank: its own band
                    merges = band_coordinate_merges(xp, x, coords, strides, rs, offsets,
                                                    band_range(n, band.count, band.index), per_sample, images)
        else:
            bands = 1 if band is None else band.count  # context parallelism is refused on grid layouts (guards)
            h = plan.h * bands
            if bands == 1:
                # The call's partition table, read inline (_grid_partition makes it at the call's first block)
                table = call.partitions.get((plan.w, plan.h, plan.use_rand))
                if table is None:
                    table = self._grid_partition(x, plan, call, xp)
                partition = table[0][index if plan.use_rand and call.row is None else 0]  # block k's (order, position)
                if table[1] is _ANY or table[1] != getattr(x, self.device_attr):  # a block on another device
                    partition = (patch.host.on_device_of(partition[0], x), patch.host.on_device_of(partition[1], x))
                merges = compute_merges(xp, x, plan.w, h, args.sx, args.sy, rs, partition=partition, memo=call.memo)
            else:
                if plan.use_rand:
                    offsets = self._offsets(index, x, num_cells(plan.w, h, args.sx, args.sy), args.sx * args.sy, call)
                merges = banded_grid_merges(xp, x, plan.w, h, args.sx, args.sy, rs, offsets, bands)
        if plan.site_r:
            return _per_site(plan, merges)
        return None if merges is None else merges.get(plan.r)

    def _grid_partition(self, x: Any, plan: Any, call: CallState, xp: Any) -> Tuple[Any, Any, Any]:
        """The call's partitions of its grid (`_match` reads block k's): every block's (order, position), drawn
        and sorted in one go at the call's first block on this grid (with random dst; else one partition serves
        them all), as ([(order, position) of block k for k < K], the device they are on: a block on another takes
        its pair there)."""
        args = self.patch.args
        offsets = None
        if plan.use_rand:
            offsets = self._draws(x, num_cells(plan.w, plan.h, args.sx, args.sy), args.sx * args.sy, call)
        parts = grid_partitions(xp, x, plan.w, plan.h, args.sx, args.sy, offsets)
        # Row k of each as block k's (order, position): the blocks read theirs by position, with no select or slice
        # at every block (unstack and zip run no Python frame per row)
        table = (list(zip(*map(xp.unstack, parts))), self._device(parts[0]))
        call.partitions[(plan.w, plan.h, plan.use_rand)] = table
        return table

    def _coordinate_partition(self, x: Any, strides: Any, call: CallState, xp: Any) -> Tuple[Any, int, Any]:
        """The call's partitions of its coordinates (`_match` reads block k's): every block's (order, position),
        made at once, and where the tokens hold several images (call.images) each token's image in that order, as
        ([(order, position, images or None) of block k for k < K], num_dst, the device they are on)."""
        use_rand = self.patch.args.use_rand
        # The cells depend on the coordinates alone, which a run keeps (a pipeline passes one ids tensor; a video's
        # come from its shape): made once for them, kept among the eager calls' constants, not at every call
        kept = call.memo.get("coordinate cells")
        if kept is not None and kept[0] is call.coords and kept[1] == strides:
            cells = kept[2]
        else:
            cells = coordinate_cells(xp, call.coords, strides)
            call.memo["coordinate cells"] = (call.coords, strides, cells)
        offsets = self._draws(x, cells.num_dst, cells.volume, call) if use_rand else None
        order, position, num_dst = coordinate_partitions(xp, cells, offsets)
        parts = [order, position]
        if call.images is not None:  # each token's image in every block's order: one gather a call
            parts.append(xp.reshape(xp.take(call.images, xp.reshape(order, [-1]), 0), xp.shape(order)))
        # Row k of each as block k's (order, position, images or None), as _grid_partition keeps them
        rows = list(map(xp.unstack, parts))
        if call.images is None:
            rows.append(repeat(None))
        per_block = list(zip(*rows))
        table = call.partitions[("coordinates", use_rand)] = (per_block, num_dst, self._device(order))
        return table

    def _device(self, table: Any) -> Any:
        return _ANY if self.device_attr is None else getattr(table, self.device_attr)

    def _draws(self, x: Any, cells: int, places: int, call: CallState) -> Any:
        """The call's [blocks, cells] table of dst places in cells of `places` tokens (sx * sy on an image,
        st * sy * sx on a space-time grid): block b's pattern is row b, a function of (seed, timestep, b)."""
        table = call.draws.get(cells)
        if table is None:
            if call.key is None:
                call.key = rng.call_key(self.patch.xp, self.seed, call.timestep)
            if call.row is not None:  # a block's own call: its row alone, from its index on the device
                xp = call.xp or self.patch.xp
                row = self.patch.host.on_device_of(call.row, x)
                table = rng.randint(xp, x, [1, cells], places, call.key, rng.row_counters(xp, x, cells, row))
                call.draws[cells] = table
                return table
            # The draw's counters depend on its size alone: kept among the eager calls' constants
            n, xp = len(self.patch.blocks) * cells, self.patch.xp
            memo_key = f"rng counters {n} {getattr(x, 'device', None) or getattr(x, 'place', None)}"
            steps = call.memo.get(memo_key)
            if steps is None:
                steps = call.memo[memo_key] = rng.counters(xp, x, n)
            table = rng.randint(xp, x, [len(self.patch.blocks), cells], places, call.key, steps)
            call.draws[cells] = table
        return table

    def _offsets(self, index: int, x: Any, cells: int, places: int, call: CallState) -> Any:
        """Block `index`'s dst place in each of `cells` cells (the band rule's matchings, which cut the whole
        grid's draw per band). A patch's cell size never changes, so the cell count alone keys the table (an int:
        paddle's SOT cannot simulate a tuple key)."""
        # One draw for every block, on the first block's device: a block on another device takes its row there.
        return self.patch.host.on_device_of(self._draws(x, cells, places, call)[0 if call.row is not None else index], x)

    def _note(self, call: CallState, index: int, computed: int = 0, reused: int = 0) -> None:
        if call.watch is not None:
            call.watch.note(index, self.patch.kind_names[index], computed, reused)


def _per_site(plan: Any, merges: Optional[Dict[int, Any]]) -> Optional[Dict[str, Any]]:
    """{merge flag: its site's merge}; a site whose r is 0 is left out (it does not merge)."""
    if merges is None:
        return None
    return {flag: merges[r] for flag, r in plan.site_r if r > 0}
