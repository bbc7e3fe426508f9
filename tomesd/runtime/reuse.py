"""Matchings kept across denoising steps (reuse_steps > 1): one cache mechanism for bare models and pipelines.

Who says which step a call belongs to differs: on a patched pipeline its loop counts the steps on the host
(clock.StepClock owns that pipeline's cache and empties it as each window of reuse_steps steps starts);
on a bare model a step is a new timestep value, read on the host, eager only (`TimestepSteps`, one per
thread, since one thread runs one denoising loop). Either way an entry serves a block while the batch and
the token grid stay those it was computed for; it is never copied with the model and never used while
gradients are on (training recomputes every call).
"""
from __future__ import annotations

import threading
from typing import Any, Dict, Optional, Tuple


class MatchCache:
    """Kept matchings: key (a block index, or a level with share_across_blocks; a slot per denoiser of a
    pipeline) -> (the step it was computed at, the grid shape, the grid object, the matching). With
    restore_tokens, also each site's residuals (restore.py) and the calls each denoiser made in this step."""

    __slots__ = ("_entries", "residuals", "_calls")

    def __init__(self) -> None:
        self._entries: Dict[Any, Tuple[int, tuple, Any, Any]] = {}
        # (site hook id, output position, call in the step) -> (the matching it was taken with, the residual)
        self.residuals: Dict[Tuple[int, int, int], Tuple[Any, Any]] = {}
        self._calls: Dict[int, int] = {}  # denoiser slot -> its calls so far in this step

    def lookup(self, key: Any, shape: tuple, grid: Any = None, step: int = 0, window: Optional[int] = None) -> Any:
        """The kept matching for `key`, or None: kept for this grid shape (and the same grid object, which
        tells Flux's grids of one token count apart), and, with a `window`, fewer than `window` steps ago."""
        entry = self._entries.get(key)
        if entry is None or entry[1] != shape or entry[2] is not grid:
            return None
        if window is not None and step - entry[0] >= window:
            return None
        return entry[3]

    def store(self, key: Any, shape: tuple, merge: Any, grid: Any = None, step: int = 0) -> None:
        self._entries[key] = (step, shape, grid, merge)

    def clear(self) -> None:
        self._entries.clear()
        self.residuals.clear()
        self._calls.clear()

    def next_call(self, slot: int) -> int:
        """This call's place among the calls denoiser `slot` made in this step (the guidance halves as two calls):
        each keeps its own residuals."""
        made = self._calls.get(slot, 0)
        self._calls[slot] = made + 1
        return made

    def new_step(self) -> None:
        self._calls.clear()

    def __len__(self) -> int:
        return len(self._entries)


class _ThreadSteps(threading.local):
    def __init__(self) -> None:
        self.last_key: Optional[int] = None
        self.last_value: Optional[float] = None
        self.step = 0
        self.window_start: Optional[int] = None  # the step that began the current window of reuse_steps
        self.cache = MatchCache()


class TimestepSteps:
    """A bare model's denoising steps, one count per thread: a new step is a new timestep value, and a new
    run (a timestep above the last one) starts with nothing kept. Several calls in one step (guidance as two
    calls, a ControlNet) share it."""

    def __init__(self) -> None:
        self._threads = _ThreadSteps()

    # Copies keep nothing: kept matchings belong to the thread and the model object that made them.
    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self._threads = _ThreadSteps()

    @property
    def cache(self) -> MatchCache:
        return self._threads.cache

    def advance(self, value: float, key: int, window: int = 1) -> int:
        """This thread's step number for a call at timestep `value` (`key`: its exact bits); steps fall in
        windows of `window` steps from a run's first."""
        state = self._threads
        if state.last_value is not None and value > state.last_value:
            state.cache.clear()  # timesteps only fall within a run: a rise starts a new one
            state.window_start = None
        if key != state.last_key:
            state.last_key, state.last_value = key, value
            state.step += 1
            state.cache.new_step()
            if state.window_start is None or state.step - state.window_start >= window:
                state.window_start = state.step
        return state.step

    def window_begins(self) -> bool:
        """Whether this thread's current step is the first of its window."""
        state = self._threads
        return state.step == state.window_start

    def window(self) -> int:
        """This thread's current window, named by the step that began it."""
        window = self._threads.window_start
        return -1 if window is None else window
