"""The hooks of a block's spans (entries.Span): tokens merged at one sub-layer's output and unmerged at the outputs of
others, for blocks whose sub-layers are not called on the image tokens alone (Flux's single-stream blocks) or whose
attention is a function rather than a module (Black Forest Labs' layout). A span's start merges, its ends unmerge;
its interior seats a step cache inside the span, and its rotary hook makes the rows follow the merged tokens."""
from __future__ import annotations

from typing import Any

from ..layouts.entries import Span, sublayer
from ..layouts.signatures import InputSpec
from .sites import SiteHook, check_rotated, follow_rotary, unmerge_output


class _SpanHook(SiteHook):
    """A hook of one span of a block (entries.Span)."""

    def __init__(self, patch: Any, index: int, span: Span) -> None:
        super().__init__(patch, index)
        self.span = span


# What _cache_changed sees on an attention holding no diffusers hooks
_NO_CACHES = (None, ())


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
        span, patch, index = self.span, self.patch, self.index
        position = span.start_output
        tokens = output if position is None else output[position]
        calls = patch.calls  # calls.top and call_merge inline (every span of every block)
        call = calls.innermost if calls.direct else calls.top()
        if call is None:
            merge = patch.call_merge(call, index, span.flag, tokens)
        else:
            if index in call.pending:  # the block's first hooked sub-layer: match now
                patch.settle(call, index, tokens)
            merge = call.merges.get(index)
            if type(merge) is dict:
                merge = merge.get(span.flag)
        if merge is None:
            return None
        if call is not None and call.eager:
            # _cache_changed asked only where the attention may hold diffusers hooks, or held them at the last call
            attention = self._attention
            if (attention is None or self._caches_seen != _NO_CACHES
                    or "_diffusers_hook" in getattr(attention, "__dict__", ())) and self._cache_changed():
                patch.seat_span_cache(index, span)  # a cache added or removed after the patch
        fn = merge.merge_head if span.image_first else merge.merge_tail
        if call is None or call.watch is None:
            merged = fn(tokens) if type(tokens) is patch.plain_tensor else patch.host.on_local_tokens(fn, tokens)
        else:
            merged = self._along_tokens(call, "merge", fn, tokens)
            self._record(call, span.flag, tokens, merged)
        if position is None:
            return merged
        if position == 0 and len(output) == 2:  # (tokens, other): no generator
            return merged, output[1]
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
        span, patch = self.span, self.patch
        calls = patch.calls  # site_merge inline
        call = calls.innermost if calls.direct else calls.top()
        if call is None or self.index in call.pending:
            merge = patch.call_merge(call, self.index, span.flag)
        else:
            merge = call.merges.get(self.index)
            if type(merge) is dict:
                merge = merge.get(span.flag)
        spec = self.spec  # InputSpec.get and replace inline
        i = spec.index
        at = i is not None and len(args) > i
        rows = args[i] if at else kwargs.get(spec.name)
        if merge is None or rows is None:
            return None
        own = span.rows_optional and type(getattr(module, "processor", None)).__module__.startswith("diffusers.")
        rows = follow_rotary(self, merge, rows, span.rotary_axis, span.rotates, span.image_first, own, call)
        if at:
            return args[:i] + (rows,) + args[i + 1:], kwargs
        return args, {**kwargs, spec.name: rows}

    def post(self, module: Any, args: tuple, output: Any) -> None:
        if self.span.rotates:  # check_rotated, its passing case inline
            calls, seam = self.patch.calls, self.patch.seam
            call = calls.innermost if calls.direct else calls.top()
            if seam is not None and not seam.disarm(None if call is None else call.eager):
                check_rotated(self, module, call, False)
