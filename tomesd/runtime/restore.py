"""Restored tokens (restore_tokens=True, with reuse_steps=k): a merged-away token gets its row's output plus
its own difference to the row, not a copy of the row.

The first step of each window of k steps runs unmerged (its blocks are matched as usual, but nothing merges) and
each merging site keeps, for every call of that step, its output minus the output unmerged from its merged rows'
means: one tensor the size of the site's output. The window's later steps, merged with the same matching, add it
to what they unmerge. Where the site's matching is not the one a residual was taken with (a block a step cache
skipped at the window's first step, a new grid), nothing is added. Device ops only; the residuals live in the
match cache that owns the window's matchings (reuse.MatchCache: the pipeline clock's, or a bare model's
per-thread one), keyed by site, output position and the call's place in its step (guidance halves run as two
calls each keep their own).
"""
from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Tuple


class CallRestore(NamedTuple):
    """What a call of a restoring patch needs: the cache holding the residuals, its place among its denoiser's
    calls in this step, whether this step keeps residuals (the window's first, unmerged) or adds them, and the
    window's number in its run (downsample mode ties a residual to it: it has no matching to tie it to)."""

    cache: Any
    ordinal: int
    keep: bool
    window: int = 0


class SiteRestore(NamedTuple):
    """A site's restoring in this call: the block's matching as the matcher gave it (its identity ties a residual to
    it), the site's merge, and the call's CallRestore."""

    matching: Any
    merge: Any
    call: CallRestore


def _key(hook: Any, where: Any, position: int, ordinal: int) -> tuple:
    """A residual's place: the site (its block, and the module whose output it is, or the hook's kind where no module
    is given), the output's position and the call's place in its step. Never the hook object itself: ComfyUI's node
    puts new hooks on the model for each of its calls, and the residuals must outlive them."""
    return hook.index, id(where) if where is not None else type(hook).__name__, position, ordinal


def keep(hook: Any, site: SiteRestore, positions: Tuple[int, ...], output: Any, head: bool = False,
         where: Any = None) -> None:
    """At the window's unmerged step: keep each of the site's image outputs' residual (`head`: an output's image is
    its first N tokens, Span.image_first / Sublayer.image_first)."""
    local, merge = hook.patch.host.on_local_tokens, site.merge

    def residual(position: int, x: Any, tail: bool) -> Any:
        # tome_core: each token minus its row's mean (over the image at the sequence's end, or at its start)
        spread = local(lambda t: merge.spread(t, tail and not head, head), x)
        site.call.cache.residuals[_key(hook, where, position, site.call.ordinal)] = (site.matching, spread)
        return x

    _each(positions, output, residual)


def add(hook: Any, site: SiteRestore, positions: Tuple[int, ...], output: Any, where: Any = None) -> Any:
    """At a merged step: each unmerged image output plus its residual, where one was kept with this matching."""
    shape = hook.patch.xp.shape

    def restored(position: int, x: Any, tail: bool) -> Any:
        kept = site.call.cache.residuals.get(_key(hook, where, position, site.call.ordinal))
        if kept is None or kept[0] is not site.matching or shape(kept[1]) != shape(x):
            return x
        return x + kept[1]

    return _each(positions, output, restored)


def _each(positions: Tuple[int, ...], output: Any, fn: Callable[[int, Any, bool], Any]) -> Any:
    """`fn(position, tokens, tail)` over the outputs unmerge_output unmerges: the whole output (a sequence ending
    with the image tokens: tail=True), a processor's image tokens alone, or the items of a tuple at `positions`."""
    if not positions:
        return fn(-1, output, True)
    if not isinstance(output, tuple):
        return fn(0, output, False)
    return tuple(fn(i, item, False) if i in positions and item is not None else item for i, item in enumerate(output))


def residual_bytes(xp: Any, cache: Any) -> int:
    """The bytes a cache's residuals hold (bench reports it): torch and paddle tensors both give element_size()."""
    return sum(math.prod(xp.shape(residual)) * residual.element_size() for _, residual in cache.residuals.values())
