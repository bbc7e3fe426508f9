"""diffusers' attention dispatch as a seam after the rotary embedding: mode="downsample" shrinks the rotated keys
there, and merge mode rotates each sample's queries and keys there by its own rows (`rotation_at_dispatch`).

Flux's and Wan's attention processors project queries, keys and values, rotate queries and keys by
per-token rows, and call `dispatch_attention_fn`, which looks the attention backend's function up by name
in `_AttentionBackendRegistry._backends` at every call. No module boundary lies between rotation and
attention, but that lookup is one: while a patch needs it, each registered backend function is wrapped.
The attention module's innermost hook arms the wrapper for its own call (`arm`), the first backend call
inside hands its rotated keys and values to the armed function, and the module's post-hook checks that
one did (`disarm`). A rotary embedding acts on each token alone, so keeping rows of rotated keys equals
rotating the kept rows: the host's processor runs unchanged.

Unarmed, a wrapper passes the call through as it came, so other models in the process see the backend they
had. The wrappers go when the last patch using them is removed (seam.py: users, the armed slot).
"""
from __future__ import annotations

import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .seam import Arming
from .torch_seam import Seam

KeyValues = Callable[[Dict[str, Any]], Dict[str, Any]]
_new_arming = object.__new__  # an Arming (slots, no state beyond them) made without running its __init__


def _registry() -> Any:
    try:
        from diffusers.models.attention_dispatch import _AttentionBackendRegistry
    except ImportError:
        return None
    return _AttentionBackendRegistry


def available() -> bool:
    """Whether the installed diffusers dispatches attention by a registry of backends."""
    return _registry() is not None and hasattr(_registry(), "_backends")


class DispatchSeam(Seam):
    """The wrapped backends of this process: one instance, shared by every patch that uses them."""

    def __init__(self) -> None:
        super().__init__()
        # Called eagerly with (image keys before, after) at each downsampling: the benchmark's token count.
        self.observers: List[Callable[[int, int], None]] = []

    # What a refusal names when an attention armed for proportional attention made no call of it
    weighs_in = "diffusers' attention dispatch (dispatch_attention_fn)"
    bypasses = "a processor that computes attention itself"
    remedy = "give the attention a processor that calls dispatch_attention_fn (its model's default processor)"

    def __reduce__(self) -> str:  # a copied patch shares the process's seam
        return "SEAM"

    def arm(self, rewrite: Any, uses: int = 1, eager: Optional[bool] = None) -> None:
        """Arm one attention's call; a second arming for the same call (a per-sample rotation, then proportional
        attention's weights under context parallelism) runs after the first, on what it gave."""
        if eager is None:
            eager = not self._compiling()
        if not eager:
            current = self._traced
            if current is not None and current.left > 0:
                rewrite = _Both(current.rewrite, rewrite)
            self._traced = Arming(rewrite, uses)
            return
        slot = self._thread  # Seam.arm inline: every rotating or downsampling attention of every block
        current = slot.armed if self._eager_armed else None
        if current is not None and current.left > 0:
            rewrite = _Both(current.rewrite, rewrite)
        arming = _new_arming(Arming)  # Arming(rewrite, uses) with no Python frame for its __init__
        arming.rewrite, arming.left = rewrite, uses
        with self._count_lock:
            if slot.armed is None:
                self._eager_armed += 1
            slot.armed = arming

    def _wrap(self) -> None:
        self.cover_new_backends()

    def cover_new_backends(self) -> None:
        """Wrap every registered backend not wrapped yet: at the first user, and at each call's entry (eagerly),
        since engines register backends of their own later (cache-dit's parallelism bridges its attention
        into diffusers' registry when it is enabled)."""
        if not self._users:
            return
        backends = _registry()._backends
        for name, fn in list(backends.items()):
            if not isinstance(fn, _Wrapped):
                backends[name] = _Wrapped(self, fn)

    def _unwrap(self) -> None:
        """Unwrap every wrapper of ours that holds a backend's place. It unwraps what is there now, never a
        function recorded at wrapping: code that put its own function in a backend's place while the seam was
        open (and that was wrapped in turn at a root's entry) may have put the earlier one back since, and a
        recorded function would bring a stale one back to life. A backend registered again since keeps the new
        function."""
        registry = _registry()
        if registry is None:  # the interpreter is shutting down (a user collected at exit)
            return
        backends = registry._backends
        for name, current in list(backends.items()):
            if isinstance(current, _Wrapped) and current.seam is self:
                backends[name] = current.fn


class _Wrapped:
    """A registered backend function, rewriting the keys and values of an armed call before it runs.
    diffusers calls backends by keyword only, and reads their parameter names from what it registered."""

    __slots__ = ("seam", "fn", "__wrapped__")

    def __init__(self, seam: DispatchSeam, fn: Callable) -> None:
        self.seam, self.fn = seam, fn
        self.__wrapped__ = fn

    def __call__(self, **kwargs: Any) -> Any:
        seam = self.seam  # Seam.armed inline: every attention call of every model while the seam is open
        arming = seam._traced
        if seam._eager_armed:
            arming = seam._thread.armed if arming is None else seam.armed()
        elif arming is not None and not seam._compiling():
            arming = None  # a trace left it (its disarm never ran): not this eager call's (Seam.armed)
        if arming is not None and arming.left > 0:  # one attention per arming: an IP-Adapter's second stays whole
            arming.left -= 1
            rewrite = arming.rewrite  # _run inline
            around = getattr(rewrite, "around", None)
            return around(self.fn, kwargs) if around is not None else self.fn(**rewrite(kwargs))
        return self.fn(**kwargs)


def _run(rewrite: Any, fn: Callable, kwargs: Dict[str, Any]) -> Any:
    """A rewrite either maps the backend's keyword arguments (`rewrite(kwargs)`) or runs the backend itself
    (`rewrite.around(fn, kwargs)`: proportional attention's weights, whose output drops their channel)."""
    around = getattr(rewrite, "around", None)
    return around(fn, kwargs) if around is not None else fn(**rewrite(kwargs))


class _Both:
    """Two armings of one attention call: `then` runs on what `first` gave."""

    __slots__ = ("first", "then")

    def __init__(self, first: Any, then: Any) -> None:
        self.first, self.then = first, then

    def around(self, fn: Callable, kwargs: Dict[str, Any]) -> Any:
        return _run(self.first, lambda **given: _run(self.then, fn, given), kwargs)


SEAM = DispatchSeam()


def dispatches(processor: Any) -> bool:
    """Whether an attention processor's code calls diffusers' `dispatch_attention_fn` (its module imports it)."""
    module = sys.modules.get(type(processor).__module__) if processor is not None else None
    return module is not None and callable(getattr(module, "dispatch_attention_fn", None))


def rotation_at_dispatch(how: str, rows: Any, image_first: bool = False, identity: bool = True) -> Tuple[Any, KeyValues]:
    """Per-sample rotary rows for a processor that takes rows with no batch axis: (rows that leave its queries
    and keys as they are, the rewrite that rotates them by each sample's rows at the dispatch). The rewrite
    calls the host's own rotation with the batch folded into the sequence, so each element is computed as the
    host computes it; the identity rows (cos 1, sin 0) change no bit (x * 1 + y * 0 == x). image_first: the rows
    are the image's only and the dispatch gets [image, text] (HunyuanVideo 1.5 rotates the image before joining
    the text): its first tokens rotate, the text's stay. Without `identity`, None for a processor that skips the
    rotation when given no rows."""
    if how != "cos_sin":
        raise ValueError(f"no rotation at the attention dispatch is known as {how!r}")
    from diffusers.models.embeddings import apply_rotary_emb

    cos, sin = rows  # [B, S, D] each
    batch, length = cos.shape[:2]
    flat = (cos.reshape(batch * length, -1), sin.reshape(batch * length, -1))

    def rotate(kwargs: Dict[str, Any]) -> Dict[str, Any]:
        out = dict(kwargs)
        for name in ("query", "key"):
            whole = kwargs[name]
            x = whole[:, :length] if image_first and whole.shape[1] > length else whole
            if tuple(x.shape[:2]) != (batch, length):
                raise ValueError(f"ToMe's per-sample rotary rows are for {batch} samples of {length} tokens; the "
                                 f"attention's {name} is {list(x.shape)}")
            flat_x = x.reshape(1, batch * length, *x.shape[2:])
            rotated = apply_rotary_emb(flat_x, flat, sequence_dim=1).reshape(x.shape)
            out[name] = torch.cat([rotated, whole[:, length:]], dim=1) if x is not whole else rotated
        return out

    return ((torch.ones_like(cos[0]), torch.zeros_like(sin[0])) if identity else None), rotate
