"""Where a patch's hooks go on its root's blocks (install), and how hooks of a patch are found and taken
off again: merge sites, spans, downsampling, the attention dispatch seam, a step cache's seat inside a span.
Functions of a `patch` (runtime.ToMePatch), which keeps the list of modules it hooked (`track`)."""
from __future__ import annotations

import functools
from typing import Any, Tuple

from . import guards
from ..layouts.entries import MASK_AXES, MASK_AXES_OR_REFUSED, SLICED_MASKS, BlockKind, Span, sublayer
from ..layouts.signatures import CONTEXT, MASK, TOKENS, InputSpec
from .downsample_sites import CheckWeighed, DownsampleContext, DownsampleDispatch, DownsampleProjection, \
    DownsampleRestore, FusedKeys, open_fused_seam
from .key_masks import MaskSlice
from .key_weights import WeighSpanKeys, open_key_seam, weighs
from .sites import MergeSite
from .span_sites import SpanEnd, SpanInterior, SpanRotary, SpanStart
from .unmerge_at import UnmergeAtFunction, open_call_seam


def owned_by(target: Any, owner: Any) -> bool:
    """Whether a hook object (or a link's owner) is `owner` or one of its hooks (its `patch`)."""
    return target is not None and (target is owner or getattr(target, "patch", None) is owner)


def _owner(hook: Any) -> Any:
    return getattr(getattr(hook, "func", hook), "__self__", None)  # paddle's LayerHook keeps the method as func


def remove_owned_hooks(host: Any, module: Any, owner: Any, owns: Any = None) -> None:
    """Remove from `module` every hook that belongs to `owner`: a patch, or one hook object of it (or, given
    `owns`, every hook whose object `owns(object)` accepts)."""
    owns = owns or functools.partial(owned_by, owner=owner)
    remove_inner = getattr(host, "remove_inner_hooks", None)
    if remove_inner is not None:
        remove_inner(module, owns)
    for table_name, flag_names in host.hook_tables:
        table = getattr(module, table_name, None) or {}
        for hook_id, hook in list(table.items()):
            if owns(_owner(hook)):
                del table[hook_id]
                for flag_name in flag_names:
                    getattr(module, flag_name, {}).pop(hook_id, None)


def install_downsample(patch: Any, index: int, block: Any, kind: BlockKind) -> None:
    host = patch.host
    for way in kind.downsample:
        attn = getattr(block, way.attention, None)
        if attn is None:
            continue
        tokens = InputSpec.find(attn, TOKENS, first_positional=True)
        if way.via != "dispatch" and guards.fused(attn):  # its keys shrink at SDPA: the seam opened now, not in a trace
            open_fused_seam(patch)
        if patch.args.restore_tokens and way.via != "dispatch":  # outermost of this patch's links: reruns them
            host.add_inner_wrapper(attn, DownsampleRestore(patch, index, tokens).wrap, patch)
            track(patch, attn)
        if way.via == "context":  # seated before the weights' check, which takes what it leaves in the call
            hook = DownsampleContext(patch, index, tokens, InputSpec.find(attn, CONTEXT, first_positional=False),
                                     _mask_spec(attn))
            around(patch, attn, hook.pre, None)
        if patch.args.proportional_attention:
            open_key_seam(patch)
            check = CheckWeighed(patch, index)
            around(patch, attn, check.pre, check.post)
            weigh_projections(patch, attn)
        if way.via == "dispatch":
            open_seam(patch)
            hook = DownsampleDispatch(patch, index, way.attention, tokens)
            around(patch, attn, hook.pre, hook.post)
        elif way.via == "projections":
            if getattr(host, "shrunk_keys", None) is not None:  # fused later (one to_qkv): the keys shrink at SDPA
                around(patch, attn, FusedKeys(patch, index).pre, None)
            first = any(layer.image_keys_first for layer in kind.sublayers if layer.name == way.attention)
            for projection in guards.KV_PROJECTIONS:
                hook = DownsampleProjection(patch, index, attn, projection, first)
                # A forward pre-hook, not a link in the projection's forward chain (one Python call where the hook
                # costs torch three): what the projection is called with stays what hooks on it see
                add_hook(patch, getattr(attn, projection), host.add_pre_hook, hook.pre)


def open_seam(patch: Any) -> None:
    if patch.seam is None:
        patch.seam = patch.host.attention_seam()
        patch.seam.open(patch)


def rows_per_sample(patch: Any) -> Tuple[bool, bool]:
    """(whether every merged block's rotary rows can follow a matching per sample, whether some of them
    are applied at the attention dispatch for it): rows with a batch axis follow as they are; rows with
    none, where the processor dispatches and the kind says how it rotates (kinds.ROTATIONS). Else the
    coordinate layouts match once for the batch."""
    if patch.args.mode != "merge":
        return False, False
    dispatches = getattr(patch.host, "dispatches", None)
    at_dispatch = False
    for block, kind in zip(patch.blocks, patch.kinds):
        sites = [(getattr(block, layer.name, None), layer) for layer in kind.sublayers if layer.rotary is not None]
        sites += [(sublayer(block, span.rotary_at), span) for span in kind.spans if span.rotary_at is not None]
        for module, site in sites:
            if module is None or site.rotary_axis != 0:  # rows with a batch axis (a negative axis counts from the end)
                continue
            if not site.rotates or dispatches is None or not dispatches(getattr(module, "processor", None)):
                return False, False
            at_dispatch = True
    return True, at_dispatch


def install_merge(patch: Any, index: int, block: Any, kind: BlockKind) -> None:
    host = patch.host
    for layer in kind.sublayers:
        sub = getattr(block, layer.name, None)
        if sub is None or not getattr(patch.args, layer.flag):
            continue
        if weighs(patch, layer.flag):
            open_key_seam(patch)
            weigh_projections(patch, sub)
        rotary = None
        if layer.rotary is not None:  # by keyword, or where the signature puts it (Wan passes it by position)
            rotary = InputSpec.find(sub, (layer.rotary,), first_positional=False) or InputSpec(layer.rotary, None)
        hook = MergeSite(patch, index, layer, InputSpec.find(sub, layer.tokens, first_positional=True), rotary,
                         mask=_mask_spec(sub) if layer.name == kind.self_attention and kind.mask in MASK_AXES_OR_REFUSED
                         else None,
                         mask_axes=MASK_AXES.get(kind.mask, ()))
        around(patch, sub, hook.pre, hook.post)
    for span in kind.spans:
        start = sublayer(block, span.start)
        ends = [end for end in (sublayer(block, path) for path in span.ends) if end is not None]
        if start is None or not ends or not getattr(patch.args, span.flag):
            continue
        # The start merges outside its forward chain, the ends unmerge inside theirs: a cache on either
        # keeps full tokens.
        add_hook(patch, start, host.add_post_hook, SpanStart(patch, index, span).post)
        unmerge = UnmergeAtFunction(patch, index, span) if span.unmerge_at else None
        if unmerge is not None:  # the image unmerges at a function's output inside the span (unmerge_at.py)
            open_call_seam(patch, span.unmerge_at)
            add_hook(patch, start, host.add_post_hook, unmerge.arm)  # after the start's merge
        for end in ends:
            if unmerge is not None:
                add_hook(patch, end, host.add_pre_hook, unmerge.check)
            else:
                around(patch, end, None, SpanEnd(patch, index, span).post)
        inner = sublayer(block, span.rotary_at) if span.rotary_at is not None else None
        if inner is not None:
            spec = InputSpec.find(inner, (span.rotary,), first_positional=False) or InputSpec(span.rotary, None)
            rotary = SpanRotary(patch, index, span, spec)
            if inner is block:  # after the block's entry hook: seated inside its link (or after its pre-hook)
                around(patch, inner, rotary.pre, None)
            else:  # around the attention's own forward, where an arming of the dispatch belongs
                around(patch, inner, rotary.pre, rotary.post)
        if weighs(patch, span.flag):
            _weigh_span(patch, index, block, span, start, ends)
        seat_span_cache(patch, index, span)
    if kind.mask in SLICED_MASKS:  # after the merge site's own hooks, so it runs after them (key_masks.py)
        flag = kind.sublayers[0].flag if kind.sublayers else kind.spans[0].flag  # the site of kind.self_attention
        attn = sublayer(block, kind.self_attention)
        if attn is not None and getattr(patch.args, flag):
            spec = InputSpec.find(attn, MASK + ("hidden_states_masks",), first_positional=False) or _mask_spec(attn)
            image_first, axes = SLICED_MASKS[kind.mask]
            around(patch, attn, MaskSlice(patch, index, flag, spec, image_first, axes).pre, None)


def weigh_projections(patch: Any, attention: Any) -> None:
    """An attention that forms its scores itself (the original LDM code's) takes the weights in its query and key
    projections, one more channel per head (backends/torch_projections.py); one that calls SDPA, there."""
    hooks = getattr(patch.host, "projection_hooks", None)
    pair = hooks(patch.key_seam, attention, patch) if hooks is not None else None
    if pair is not None:
        add_hook(patch, attention.to_q, patch.host.add_post_hook, pair[0])
        add_hook(patch, attention.to_k, patch.host.add_post_hook, pair[1])


def _weigh_span(patch: Any, index: int, block: Any, span: Span, start: Any, ends: list) -> None:
    """Proportional attention inside a span: armed around the module that calls the attention, else from the
    span's start (after its merge) to its first end, for one attention per end."""
    open_key_seam(patch)
    called = sublayer(block, span.attention_call) if span.attention_call is not None else None
    if called is not None:
        hook = WeighSpanKeys(patch, index, span)
        around(patch, called, hook.pre, hook.post)
    else:
        hook = WeighSpanKeys(patch, index, span, uses=len(ends))
        add_hook(patch, start, patch.host.add_post_hook, hook.pre)
        add_hook(patch, ends[0], patch.host.add_post_hook, hook.post)


def seat_span_cache(patch: Any, index: int, span: Span) -> None:
    """A step cache on the attention inside a span (diffusers' caches hook Flux's single-block `attn`)
    would see merged tokens: its output unmerges inside the cache and merges again outside it, so the cache
    keeps and replays full tokens. Seated while a cache is there (checked at install and by the span's
    start at each call): without one the pair would cost two gathers, and round-off, for nothing."""
    attention = sublayer(patch.blocks[index], span.attention)
    if attention is None or attention is patch.blocks[index]:
        return
    owners = getattr(patch.host, "inner_hook_owners", None)
    if owners is None:  # a host with no forward chains to seat in (paddle): no diffusers caches either
        return
    seated = [o for o in owners(attention) if isinstance(o, SpanInterior) and o.patch is patch]
    if guards.keeps_outputs(attention) == bool(seated):
        return
    if seated:  # the cache was removed
        remove_owned_hooks(patch.host, attention, seated[0])
        return
    interior = SpanInterior(patch, index, span)
    patch.host.add_inner_hooks(attention, None, interior.unmerge, interior)
    add_hook(patch, attention, patch.host.add_post_hook, interior.merge)


def around(patch: Any, module: Any, pre: Any, post: Any) -> Any:
    """`pre` and `post` around `module`'s own forward: innermost in its forward chain where the host
    can seat them there (torch: inside diffusers' and accelerate's wrappers; the link is returned, its `post`
    settable later), else as forward hooks (None returned)."""
    inner = getattr(patch.host, "add_inner_hooks", None)
    if inner is not None:  # owned by the hook object (its patch's, and its block's: ToMePatch.park finds it)
        link = inner(module, pre, post, getattr(pre or post, "__self__", patch))
        track(patch, module)
        return link
    if pre is not None:
        add_hook(patch, module, patch.host.add_pre_hook, pre)
    if post is not None:
        add_hook(patch, module, patch.host.add_post_hook, post)
    return None


def add_hook(patch: Any, module: Any, register: Any, hook: Any) -> None:
    register(module, hook)
    track(patch, module)


def track(patch: Any, module: Any) -> None:
    """`module` holds hooks of this patch (detach visits it)."""
    if not any(m is module for m in patch._hooked):
        patch._hooked.append(module)


def _mask_spec(attention: Any) -> InputSpec:
    """Where an attention's mask arrives: a host passing it by position is seen as one passing it by name."""
    return InputSpec.find(attention, MASK, first_positional=False) or InputSpec(MASK[0], None)
