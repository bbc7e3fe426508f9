"""The hooks ToMe puts on a block's sub-layers: small objects whose `pre` / `post` methods the runtime
registers and removes. Each asks the patch for its block's merge in the current call (computed at the
block's first hooked sub-layer) and does no other state keeping.

Merge mode: pre-hooks on the sub-layers a block kind lists merge their image tokens (and gather rotary
rows), post-hooks unmerge their image output; spans (span_sites.py) merge at one sub-layer's output and unmerge at
another's. Downsample mode's hooks are in downsample_sites.py. The per-block work is written inline here (an
input's read and replacement, the call's merge): every Python call it saves is paid on every block of every step.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

from . import guards, key_weights, restore
from .calls import CallState
from .guards import MASKED_SELF_ATTENTION
from ..layouts.entries import Sublayer
from ..layouts.signatures import InputSpec


class SiteHook:
    """A hook of one block (`index`) of one patch."""

    def __init__(self, patch: Any, index: int) -> None:
        self.patch, self.index = patch, index

    def _record(self, call: Any, site: str, before: Any, after: Any) -> None:
        watch = None if call is None else call.watch
        if watch is not None:
            shape = self.patch.xp.shape
            watch.site(self.index, self.patch.kind_names[self.index], site, shape(before)[1], shape(after)[1])

    def _along_tokens(self, call: Any, work: str, fn: Any, x: Any) -> Any:
        """`fn`, a merge or unmerge, on `x` (a DTensor's local tensor under tensor parallelism), timed as `work`."""
        if call is None or call.watch is None:
            return self.patch.host.on_local_tokens(fn, x)
        return self._timed(call, work, self.patch.host.on_local_tokens, fn, x)

    def _timed(self, call: Any, work: str, fn: Any, *args: Any) -> Any:
        watch = None if call is None else call.watch
        if watch is None:
            return fn(*args)
        started = watch.start()
        out = fn(*args)
        watch.stop(work, started)
        return out


class BlockEntry(SiteHook):
    """The block's input, kept until its first hooked sub-layer computes the merge from it: a block that a
    step cache (diffusers' First Block Cache) skips costs no matching. In downsample mode, the block's attention
    processors are checked as they enter (again only when one was swapped)."""

    def __init__(self, patch: Any, index: int, spec: InputSpec) -> None:
        super().__init__(patch, index)
        self.spec = spec
        self.link: Any = None  # where the host seated `pre` (its post is seated later: ToMePatch.regional_call)
        self.row: Any = None  # the block's index as a tensor on the device, for a block compiled on its own
        self.ways = patch.kinds[index].downsample  # read here, not by index (a traced block never reads it)
        self.like = index  # the first block like this one (ToMePatch.install; CallState.like)

    def pre(self, module: Any, args: tuple, kwargs: dict) -> None:
        spec = self.spec  # InputSpec.get inline: every block of every call
        x = args[spec.index] if spec.index is not None and len(args) > spec.index else kwargs.get(spec.name)
        patch, index = self.patch, self.index
        calls = patch.calls
        call = calls.innermost if calls.direct else calls.top()
        if call is None:
            return  # replayed by checkpointing: the sub-layers use the replay record
        if call.regional:  # blocks compiled on their own: this block runs in a call of its own (exit: `post`)
            call = CallState.for_block(call, patch.xp, self.row, self.like)
            calls.enter_block(call)
        if patch.downsampling:
            checked = patch.checked_processors
            for way in self.ways:
                modules = getattr(module, "_modules", None) if call.eager else None  # a dict read, no Python call
                attn = modules.get(way.attention) if modules is not None else None
                attn = attn if attn is not None else getattr(module, way.attention, None)
                # The processor may have been swapped after apply_patch: checked again whenever it is another one.
                processor = getattr(attn, "processor", attn)
                if attn is not None and (not call.eager or checked.get((index, way.attention)) is not processor):
                    guards.check_downsample_way(attn, way, type(module).__name__, patch.host,
                                                patch.args.downsample_method)
                    if call.eager:
                        checked[(index, way.attention)] = processor
        call.merges.pop(index, None)
        # The grad mode is taken here: LDM's checkpointing runs the block's body under no_grad inside a
        # block entered with gradients on, and training (replay kept, nothing reused) is decided by the latter.
        call.pending[index] = (module, x, patch.host.grad_enabled())

    def post(self, module: Any, args: tuple, output: Any) -> None:
        """The block's exit, seated once its root's calls find blocks compiled on their own (ToMePatch.regional_call):
        its own call ends."""
        calls = self.patch.calls
        call = calls.innermost if calls.direct else calls.top()
        if call is not None and call.row is not None:
            calls.leave_block(call)


class MergeSite(SiteHook):
    """A sub-layer whose input holds the image tokens: they merge before it, its image output unmerges."""

    def __init__(self, patch: Any, index: int, layer: Sublayer, spec: InputSpec, rotary: Optional[InputSpec],
                 mask: Optional[InputSpec], mask_axes: Tuple[int, ...] = ()) -> None:
        super().__init__(patch, index)
        # mask: where a self-attention's attention_mask arrives (by name or by position); None elsewhere. It is
        # refused, or gathered for the merged tokens along `mask_axes` (entries.MASK_AXES: a unified sequence's).
        self.layer, self.spec, self.rotary, self.mask, self.mask_axes = layer, spec, rotary, mask, mask_axes
        self.also = [InputSpec(name, None) for name in layer.also]
        self.weighs = key_weights.weighs(patch, layer.flag)  # proportional attention over its merged keys

    def pre(self, module: Any, args: tuple, kwargs: dict) -> Any:
        # The image tokens, or a sequence ending with them (CogVideoX's feed-forward sees [text, image]); InputSpec.get
        # inline (every merging site of every block asks).
        spec = self.spec
        tokens = args[spec.index] if spec.index is not None and len(args) > spec.index else kwargs.get(spec.name)
        patch, index = self.patch, self.index
        calls = patch.calls  # calls.top and call_merge inline: every merging site of every block asks
        call = calls.innermost if calls.direct else calls.top()
        if call is None:
            merge = patch.call_merge(call, index, self.layer.flag, tokens)
        else:
            if index in call.pending:  # the block's first hooked sub-layer: match now
                patch.settle(call, index, tokens)
            merge = call.merges.get(index)
            if type(merge) is dict:
                merge = merge.get(self.layer.flag)
        if merge is None:
            return None
        rotary = self.rotary
        if rotary is not None:  # InputSpec.get and replace inline
            i = rotary.index
            at = i is not None and len(args) > i
            rows = args[i] if at else kwargs.get(rotary.name)
            if rows is not None:
                rows = self._follow(merge, rows, module, call)
                if at:
                    args = args[:i] + (rows,) + args[i + 1:]
                else:
                    kwargs = {**kwargs, rotary.name: rows}
        mask = self.mask
        if mask is not None:  # InputSpec.get inline
            mask = args[mask.index] if mask.index is not None and len(args) > mask.index else kwargs.get(mask.name)
        if mask is not None and not self.mask_axes:
            raise ValueError(MASKED_SELF_ATTENTION)
        if mask is not None:  # each merged row's entries are its representative's
            for axis in self.mask_axes:
                mask = merge.gather_rows(mask, len(patch.xp.shape(mask)) + axis)
            args, kwargs = self.mask.replace(args, kwargs, mask)
        fn = merge.merge_head if self.layer.image_first else merge.merge_tail
        if call is None or call.watch is None:
            merged = fn(tokens) if type(tokens) is patch.plain_tensor else patch.host.on_local_tokens(fn, tokens)
        else:
            merged = self._along_tokens(call, "merge", fn, tokens)
            self._record(call, self.layer.flag, tokens, merged)
        if self.weighs:
            key_weights.arm(patch, merge, self.layer.image_keys_first)
        for spec in self.also:  # the same tokens given again (Lumina 2's context): the same merged tensor
            given = spec.get(args, kwargs)
            if given is not None and given is not tokens:
                raise ValueError(f"{type(module).__name__} was given other tokens as {spec.name} than as its own: ToMe "
                                 f"merges them only as the same tensor (self-attention); call apply_patch with "
                                 f"merge_attn=False")
            if given is not None:
                args, kwargs = spec.replace(args, kwargs, merged)
        i = self.spec.index  # InputSpec.replace inline
        if i is not None and len(args) > i:
            return args[:i] + (merged,) + args[i + 1:], kwargs
        return args, {**kwargs, self.spec.name: merged}

    def _follow(self, merge: Any, rows: Any, module: Any = None, call: Any = None) -> Any:
        layer, item = self.layer, self.layer.rotary_item
        if item is None:
            # own_processor inline
            own = layer.rows_optional and type(getattr(module, "processor", None)).__module__.startswith("diffusers.")
            return follow_rotary(self, merge, rows, layer.rotary_axis, layer.rotates, layer.image_keys_first, own, call)
        image = follow_rotary(self, merge, rows[item], layer.rotary_axis, layer.rotates, call=call)
        return tuple(image if i == item else table for i, table in enumerate(rows))  # the text's rows stay

    def post(self, module: Any, args: tuple, output: Any) -> Any:
        patch, layer = self.patch, self.layer
        calls = patch.calls
        call = calls.innermost if calls.direct else calls.top()
        if layer.rotates:  # check_rotated, its passing case inline
            seam = patch.seam
            if seam is not None and not seam.disarm(None if call is None else call.eager):
                check_rotated(self, module, call, False)
        if self.weighs and patch.call_merge(call, self.index, layer.flag) is not None:
            key_weights.check_weighed(patch, module)
        if call is not None and call.watch is None and not call.restoring and self.index not in call.pending:
            # unmerge_output inline, where nothing watches or restores (every merging site of every block)
            merge = call.merges.get(self.index)
            if type(merge) is dict:
                merge = merge.get(layer.flag)
            if merge is None:
                return None
            if not layer.outputs:
                fn = merge.unmerge_head if layer.image_first else merge.unmerge_tail
                return fn(output) if type(output) is patch.plain_tensor else patch.host.on_local_tokens(fn, output)
            return _unmerged(patch.host.on_local_tokens, merge, layer.outputs, output, layer.image_first,
                             patch.plain_tensor)
        return unmerge_output(self, layer.flag, layer.outputs, output, layer.image_first, module, call)


def gather_rotary(merge: Any, rows: Any, axis: int, image_first: bool = False) -> Any:
    """Rotary rows (one table, a tuple of them such as (cos, sin), or a dict of them such as AnyFlow's
    {"query": rows, "key": rows}) following the merged tokens (`image_first`: rows over [image, text], the image's
    first)."""
    if isinstance(rows, dict):
        return {name: gather_rotary(merge, table, axis, image_first) for name, table in rows.items()}
    if isinstance(rows, (tuple, list)):
        return merge.gather_tables(rows, axis, image_first)
    return merge.gather_rows(rows, axis, image_first)


def gather_pair(xp: Any, merge: Any, rows: Tuple[Any, Any], axis: int, image_first: bool, call: Any) -> Tuple[Any, ...]:
    """A rotary (cos, sin) pair's rows for the merged tokens with one gather: the call joins the pair along its last
    axis once (eager calls: the join is kept on the call, with each table's version, so a table changed in place
    is joined again), each block gathers the joined rows and splits them (views; the values are the same as two
    gathers'). A pair whose tables differ in shape or dtype, or whose rows lie along the last axis, gathers each."""
    cos, sin = rows
    try:
        versions = (getattr(cos, "_version", None), getattr(sin, "_version", None))
    except RuntimeError:  # torch's inference tensors (torch.inference_mode) track no version: their identity alone
        versions = None
    held = call.rotary
    if held is None or held[0] is not cos or held[1] is not sin or held[3] != versions:
        rank = len(cos.shape)
        if cos.shape != sin.shape or cos.dtype != sin.dtype or axis % rank == rank - 1:
            return merge.gather_tables(rows, axis, image_first)
        held = call.rotary = (cos, sin, xp.concat([cos, sin], -1), versions)
    gathered = merge.gather_rows(held[2], axis, image_first)
    width = cos.shape[-1]
    return gathered[..., :width], gathered[..., width:]


def own_processor(module: Any) -> bool:
    """Whether `module`'s attention processor is its library's own (diffusers'), not one set by a user."""
    return type(getattr(module, "processor", None)).__module__.startswith("diffusers.")


def follow_rotary(hook: SiteHook, merge: Any, rows: Any, axis: int, rotates: str, image_first: bool = False,
                  optional: bool = False, call: Any = None) -> Any:
    """The rows the attention about to run takes for the merged tokens. A matching per sample gives each sample
    its own rows: a table with no batch axis ([S, D], axis 0) takes its one sample's rows for a batch of one;
    for more, the processor gets identity rows (None where it skips the rotation then: `optional`) and the
    attention dispatch, armed here, rotates each sample by its own (kinds.ROTATIONS; the site's post-hook checks
    the dispatch took them). `call`: the current call, where the hook has found it (its `eager` tells the seam
    where to arm)."""
    patch = hook.patch
    xp = patch.xp if call is None or call.xp is None else call.xp  # the call's: eager or traced
    # gather_rotary's (cos, sin) case inline (Flux's and Wan's rows at every block)
    if type(rows) is not tuple:
        gathered = gather_rotary(merge, rows, axis, image_first)
    elif call is not None and call.eager and len(rows) == 2:
        gathered = gather_pair(xp, merge, rows, axis, image_first, call)
    else:
        gathered = merge.gather_tables(rows, axis, image_first)
    if axis != 0 or len(xp.shape(merge.representatives)) == 1:  # rows with a batch axis (axis < 0: from the end)
        return gathered
    if merge.batch == 1:
        return tuple(table[0] for table in gathered) if isinstance(gathered, tuple) else gathered[0]
    identity, rotate = patch.host.rotation_at_dispatch(rotates, gathered, image_first, not optional)
    patch.seam.arm(rotate, 1, None if call is None else call.eager)
    return identity


def check_rotated(hook: SiteHook, module: Any, call: Any = None, passed: Optional[bool] = None) -> None:
    """After an attention given identity rows: its dispatch did rotate the queries and keys (`call`: the current
    call, whose `eager` tells the seam where it armed; `passed`: whether the seam's disarm found it taken, where
    the hook disarmed already)."""
    seam = hook.patch.seam
    if passed is None:
        passed = seam is None or seam.disarm(None if call is None else call.eager)
    if not passed:
        raise RuntimeError(
            f"ToMe gave {type(module).__name__} identity rotary rows and armed diffusers' attention dispatch to rotate "
            f"each sample by its own rows, but its processor {type(getattr(module, 'processor', None)).__name__} made "
            f"no call of the dispatch (a processor set after apply_patch?); call apply_patch again after changing "
            f"processors, or run a batch of one")


def unmerge_output(hook: SiteHook, flag: str, positions: Tuple[int, ...], output: Any, head: bool = False,
                   where: Any = None, call: Any = False) -> Any:
    """The image tokens of a sub-layer's output back to every token (the last N of a joined sequence; with `head`,
    its first N). `where`: the module whose output it is (restored tokens key their residuals by it); `call`: the
    current call, where the hook has found it already."""
    patch = hook.patch
    if call is False:
        calls = patch.calls
        call = calls.innermost if calls.direct else calls.top()
    if call is None or hook.index in call.pending:
        merge = patch.call_merge(call, hook.index, flag)
    else:  # call_merge inline
        merge = call.merges.get(hook.index)
        if type(merge) is dict:
            merge = merge.get(flag)
    restoring = None if call is None or not call.restoring else patch.call_restore(call, hook.index, flag)
    if merge is None:
        if restoring is not None:  # the window's unmerged step (restore_tokens): keep the residuals
            restore.keep(hook, restoring, positions, output, head, where)
        return None

    local, plain = patch.host.on_local_tokens, patch.plain_tensor
    if call is None or call.watch is None:
        if not positions and type(output) is plain:
            output = (merge.unmerge_head if head else merge.unmerge_tail)(output)
        else:
            output = _unmerged(local, merge, positions, output, head, plain)
    else:
        output = hook._timed(call, "unmerge", _unmerged, local, merge, positions, output, head, plain)
    return output if restoring is None else restore.add(hook, restoring, positions, output, where)


def _unmerged(local: Any, merge: Any, positions: Tuple[int, ...], output: Any, head: bool, plain: Any = None) -> Any:
    """`output`'s image tokens unmerged: the whole output (no `positions`), or its items at `positions`; `local`
    (on_local_tokens) for tensors not of the `plain` type."""
    if not positions:
        fn = merge.unmerge_head if head else merge.unmerge_tail
        return fn(output) if type(output) is plain else local(fn, output)
    one = merge.unmerge_head if head else merge.unmerge  # the image alone (or followed by tokens that pass)
    if not isinstance(output, tuple):  # a processor that returns the image tokens alone
        return one(output) if type(output) is plain else local(one, output)
    items = list(output)
    for i in positions:
        if i < len(items) and items[i] is not None:
            item = items[i]
            items[i] = one(item) if type(item) is plain else local(one, item)
    return tuple(items)
