"""What the hosts' seams share (torch_dispatch.py: diffusers' attention dispatch; torch_sdpa.py: torch's
scaled_dot_product_attention; paddle_sdpa.py: ppdiffusers' attention functions): a function of the host wrapped
while some patch uses it, and one attention call's arming of the wrapper. Framework-free: a host's seam says how it
knows that a graph compiler traces (`_compiling`).

The patches using a seam are held by weak reference: a patched model's copy dropped without remove_patch stops
counting when it is collected, so the wrapper still goes with the last user. The armed slot is per thread in
eager mode and a plain attribute while a graph compiler traces (thread-locals break graphs), as calls.py keeps
calls.
"""
from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Dict, Optional


class Arming:
    """One attention call's rewrite, and how many calls of the wrapped function are still to take it."""

    __slots__ = ("rewrite", "left")

    def __init__(self, rewrite: Callable, uses: int = 1) -> None:
        self.rewrite, self.left = rewrite, uses

    def take(self) -> bool:
        """Whether this call takes the arming (and one fewer call is left to)."""
        if self.left <= 0:
            return False
        self.left -= 1
        return True


class _ThreadSlot(threading.local):
    def __init__(self) -> None:
        self.armed: Optional[Arming] = None


class Seam:
    """A wrapped host function of this process, shared by every patch that uses it. Subclasses say how the
    function is wrapped (`_wrap`, at the first user) and unwrapped (`_unwrap`, after the last)."""

    def __init__(self) -> None:
        self._thread = _ThreadSlot()
        self._traced: Optional[Arming] = None
        self._users: Dict[int, "weakref.ref[Any]"] = {}
        # Eager armings held in thread slots now, every thread (a plain int): while there are none, `armed` reads no
        # thread-local and asks no question to the host
        self._eager_armed = 0
        self._count_lock = threading.Lock()

    def _wrap(self) -> None:
        raise NotImplementedError

    def _compiling(self) -> bool:
        """Whether a graph compiler traces this call (its armed slot is then a plain attribute)."""
        raise NotImplementedError

    def _unwrap(self) -> None:
        raise NotImplementedError

    # ---- users ----
    def open(self, user: Any) -> None:
        """`user` (a patch) starts to use the seam: wrap (on the first user)."""
        key = id(user)
        if key in self._users:
            return
        first = not self._users
        self._users[key] = weakref.ref(user, lambda _, key=key: self._release(key))
        if first:
            self._wrap()

    def close(self, user: Any) -> None:
        """`user` is done with the seam: the last one unwraps."""
        self._release(id(user))

    def _release(self, key: int) -> None:
        if self._users.pop(key, None) is None or self._users:
            return
        self._unwrap()
        self.clear()

    @property
    def in_use(self) -> bool:
        return bool(self._users)

    # ---- one attention call ----
    # `eager`: whether a graph compiler traces the caller's call, where the caller knows it (the runtime's
    # CallState.eager, read once a call); None asks the host (`_compiling`: three Python calls in torch).
    def arm(self, rewrite: Callable, uses: int = 1, eager: Optional[bool] = None) -> None:
        arming = Arming(rewrite, uses)
        if eager is None:
            eager = not self._compiling()
        if not eager:
            self._traced = arming
            return
        slot = self._thread
        with self._count_lock:
            if slot.armed is None:
                self._eager_armed += 1
            slot.armed = arming

    def disarm(self, eager: Optional[bool] = None) -> bool:
        """Clear this call's arming; whether the calls it was for took it."""
        if eager:  # _take_slot inline: every armed attention of every block
            slot = self._thread
            arming = slot.armed
            if arming is not None:
                with self._count_lock:
                    slot.armed = None
                    self._eager_armed -= 1
        else:
            arming = self._take_slot(eager)
        return arming is None or arming.left == 0

    def clear(self) -> None:
        """Drop an arming left by an attention call that raised (the root's exit calls this)."""
        self._take_slot()

    def _take_slot(self, eager: Optional[bool] = None) -> Optional[Arming]:
        if eager is None:
            eager = not self._compiling()
        if not eager:
            arming, self._traced = self._traced, None
            return arming
        slot = self._thread
        arming = slot.armed
        if arming is not None:
            with self._count_lock:
                slot.armed = None
                self._eager_armed -= 1
        return arming

    def armed(self) -> Optional[Arming]:
        """This call's arming. While no thread holds an eager one, the traced slot (None in eager mode), with no
        question to the host; while one does and none is traced, this thread's (a wrapper of the host's function
        runs where its attention's hook armed: the whole model eager, or the whole model traced). A traced arming
        met by an eager call is one a trace left behind (its disarm never ran): the host is asked, and it is not
        this call's. (A thread tracing while another holds an eager arming reads its thread slot here, a graph break
        under fullgraph=True: mixing eager and compiled calls of patched models across threads is not supported.)"""
        if not self._eager_armed:
            traced = self._traced
            return traced if traced is None or self._compiling() else None
        if self._traced is None:
            return self._thread.armed
        return self._traced if self._compiling() else self._thread.armed
