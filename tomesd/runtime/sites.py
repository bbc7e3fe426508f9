"""The hooks ToMe puts on a block's sub-layers: small objects whose `pre` / `post` methods the runtime
registers and removes. Each asks the patch for its block's merge in the current call (computed at the
block's first hooked sub-layer) and does no other state keeping.

Merge mode: pre-hooks on the sub-layers a block kind lists merge their image tokens (and gather rotary
rows), post-hooks unmerge their image output; spans merge at one sub-layer's output and unmerge at
another's. Downsample mode's hooks are in downsample_sites.py.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

from . import key_weights, restore
from .guards import MASKED_SELF_ATTENTION
from ..layouts.entries import Span, Sublayer, sublayer
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
    step cache (diffusers' First Block Cache) skips costs no matching."""

    def __init__(self, patch: Any, index: int, spec: InputSpec) -> None:
        super().__init__(patch, index)
        self.spec = spec

    def pre(self, module: Any, args: tuple, kwargs: dict) -> None:
        spec = self.spec  # InputSpec.get inline: every block of every call
        self.patch.enter_block(self.index, module,
                               args[spec.index] if spec.index is not None and len(args) > spec.index
                               else kwargs.get(spec.name))


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
        patch = self.patch
        call = patch.calls.top()
        merge = patch.call_merge(call, self.index, self.layer.flag, tokens)
        if merge is None:
            return None
        if self.rotary is not None:
            rows = self.rotary.get(args, kwargs)
            if rows is not None:
                rows = self._follow(merge, rows, module)
                args, kwargs = self.rotary.replace(args, kwargs, rows)
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
            merged = patch.host.on_local_tokens(fn, tokens)
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

    def _follow(self, merge: Any, rows: Any, module: Any = None) -> Any:
        layer, item = self.layer, self.layer.rotary_item
        if item is None:
            return follow_rotary(self, merge, rows, layer.rotary_axis, layer.rotates, layer.image_keys_first,
                                 layer.rows_optional and own_processor(module))
        image = follow_rotary(self, merge, rows[item], layer.rotary_axis, layer.rotates)
        return tuple(image if i == item else table for i, table in enumerate(rows))  # the text's rows stay

    def post(self, module: Any, args: tuple, output: Any) -> Any:
        if self.layer.rotates:
            check_rotated(self, module)
        call = self.patch.calls.top()
        if self.weighs and self.patch.call_merge(call, self.index, self.layer.flag) is not None:
            key_weights.check_weighed(self.patch, module)
        return unmerge_output(self, self.layer.flag, self.layer.outputs, output, self.layer.image_first, module, call)


def gather_rotary(merge: Any, rows: Any, axis: int, image_first: bool = False) -> Any:
    """Rotary rows (one table, a tuple of them such as (cos, sin), or a dict of them such as AnyFlow's
    {"query": rows, "key": rows}) following the merged tokens (`image_first`: rows over [image, text], the image's
    first)."""
    if isinstance(rows, dict):
        return {name: gather_rotary(merge, table, axis, image_first) for name, table in rows.items()}
    if isinstance(rows, (tuple, list)):
        gathered = []
        for table in rows:
            gathered.append(merge.gather_rows(table, axis, image_first))
        return tuple(gathered)
    return merge.gather_rows(rows, axis, image_first)


def own_processor(module: Any) -> bool:
    """Whether `module`'s attention processor is its library's own (diffusers'), not one set by a user."""
    return type(getattr(module, "processor", None)).__module__.startswith("diffusers.")


def follow_rotary(hook: SiteHook, merge: Any, rows: Any, axis: int, rotates: str, image_first: bool = False,
                  optional: bool = False) -> Any:
    """The rows the attention about to run takes for the merged tokens. A matching per sample gives each sample
    its own rows: a table with no batch axis ([S, D], axis 0) takes its one sample's rows for a batch of one;
    for more, the processor gets identity rows (None where it skips the rotation then: `optional`) and the
    attention dispatch, armed here, rotates each sample by its own (kinds.ROTATIONS; the site's post-hook checks
    the dispatch took them)."""
    gathered = gather_rotary(merge, rows, axis, image_first)
    xp = hook.patch.xp
    if axis != 0 or len(xp.shape(merge.representatives)) == 1:  # rows with a batch axis (axis < 0: from the end)
        return gathered
    if merge.batch == 1:
        return tuple(table[0] for table in gathered) if isinstance(gathered, tuple) else gathered[0]
    identity, rotate = hook.patch.host.rotation_at_dispatch(rotates, gathered, image_first, identity=not optional)
    hook.patch.seam.arm(rotate)
    return identity


def check_rotated(hook: SiteHook, module: Any) -> None:
    """After an attention given identity rows: its dispatch did rotate the queries and keys."""
    seam = hook.patch.seam
    if seam is not None and not seam.disarm():
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
        call = patch.calls.top()
    merge = patch.call_merge(call, hook.index, flag)
    restoring = None if call is None or not call.restoring else patch.call_restore(call, hook.index, flag)
    if merge is None:
        if restoring is not None:  # the window's unmerged step (restore_tokens): keep the residuals
            restore.keep(hook, restoring, positions, output, head, where)
        return None

    local = patch.host.on_local_tokens
    if call is None or call.watch is None:
        output = _unmerged(local, merge, positions, output, head)
    else:
        output = hook._timed(call, "unmerge", _unmerged, local, merge, positions, output, head)
    return output if restoring is None else restore.add(hook, restoring, positions, output, where)


def _unmerged(local: Any, merge: Any, positions: Tuple[int, ...], output: Any, head: bool) -> Any:
    if not positions:
        return local(merge.unmerge_head if head else merge.unmerge_tail, output)
    one = merge.unmerge_head if head else merge.unmerge  # the image alone (or followed by tokens that pass)
    if not isinstance(output, tuple):  # a processor that returns the image tokens alone
        return local(one, output)
    items = list(output)
    for i in positions:
        if i < len(items) and items[i] is not None:
            items[i] = local(one, items[i])
    return tuple(items)


class _SpanHook(SiteHook):
    """A hook of one span of a block (kinds.Span)."""

    def __init__(self, patch: Any, index: int, span: Span) -> None:
        super().__init__(patch, index)
        self.span = span


class SpanStart(_SpanHook):
    """A span's start: the image tokens (the last N, or the first N: Span.image_first) of this sub-layer's output
    merge."""

    def __init__(self, patch: Any, index: int, span: Span) -> None:
        super().__init__(patch, index, span)
        self._caches_seen: Any = None  # the diffusers hooks on the span's attention when last looked at
        self._attention: Any = None  # that attention, found at the first call

    def _cache_changed(self) -> bool:
        """Whether the diffusers hooks on the span's attention differ from the last call's (a step cache added or
        removed since): only then is the cache's seat looked at again."""
        attention = self._attention
        if attention is None:
            attention = self._attention = sublayer(self.patch.blocks[self.index], self.span.attention)
        registry = getattr(attention, "__dict__", {}).get("_diffusers_hook")
        seen = (registry, tuple(getattr(registry, "hooks", None) or ()))
        if seen == self._caches_seen:
            return False
        self._caches_seen = seen
        return True

    def post(self, module: Any, args: tuple, output: Any) -> Any:
        position = self.span.start_output
        tokens = output if position is None else output[position]
        call = self.patch.calls.top()
        merge = self.patch.call_merge(call, self.index, self.span.flag, tokens)
        if merge is None:
            return None
        if call is not None and call.eager and self._cache_changed():
            self.patch.seat_span_cache(self.index, self.span)  # a cache added or removed after the patch
        merged = self._along_tokens(call, "merge", _merge_fn(merge, self.span), tokens)
        self._record(call, self.span.flag, tokens, merged)
        if position is None:
            return merged
        return tuple(merged if i == position else item for i, item in enumerate(output))


class SpanEnd(_SpanHook):
    """A span's end: its image output unmerges."""

    def post(self, module: Any, args: tuple, output: Any) -> Any:
        return unmerge_output(self, self.span.flag, (), output, self.span.image_first, module)


def _merge_fn(merge: Any, span: Span) -> Any:
    return merge.merge_head if span.image_first else merge.merge_tail


class SpanInterior(_SpanHook):
    """A step cache on the attention inside a span (runtime.seat_span_cache): `unmerge` is seated inside the
    cache, `merge` outside it, so the cache keeps full tokens and the span goes on with merged ones."""

    def unmerge(self, module: Any, args: tuple, output: Any) -> Any:
        return unmerge_output(self, self.span.flag, (), output, self.span.image_first, module)

    def merge(self, module: Any, args: tuple, output: Any) -> Any:
        call = self.patch.calls.top()
        merge = self.patch.call_merge(call, self.index, self.span.flag)
        return None if merge is None else self._along_tokens(call, "merge", _merge_fn(merge, self.span), output)


class SpanRotary(_SpanHook):
    """Inside a span: the attention's rotary rows follow the merged tokens (given to the attention, or to the
    block itself where attention is a function)."""

    def __init__(self, patch: Any, index: int, span: Span, spec: InputSpec) -> None:
        super().__init__(patch, index, span)
        self.spec = spec

    def pre(self, module: Any, args: tuple, kwargs: dict) -> Any:
        merge = self.patch.site_merge(self.index, self.span.flag)
        rows = self.spec.get(args, kwargs)
        if merge is None or rows is None:
            return None
        rows = follow_rotary(self, merge, rows, self.span.rotary_axis, self.span.rotates, self.span.image_first,
                             self.span.rows_optional and own_processor(module))
        return self.spec.replace(args, kwargs, rows)

    def post(self, module: Any, args: tuple, output: Any) -> None:
        if self.span.rotates:
            check_rotated(self, module)
