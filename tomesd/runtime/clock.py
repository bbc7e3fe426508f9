"""The denoising step as a patched pipeline's own loop counts it, for `reuse_steps > 1`.

A bare model can tell one denoising step from the next only by its timestep's value, which is a
host read (a device sync on a GPU, and no graph a compiler can trace). A pipeline knows on the host:
its loop calls `scheduler.set_timesteps` once per run and `scheduler.step` once per step, after
every denoiser call of that step (both guidance halves, the ControlNets). So when `apply_patch` gets
a pipeline, a `StepClock` wraps those two methods on the pipeline's scheduler instance (reversibly:
`remove_patch` restores them) and the patches of its denoisers ask the clock instead of the timestep.

The clock is the one owner of the matches kept across steps, for every denoiser of its pipeline: it
keeps them for one window of `reuse_steps` steps and drops them when a window or a run starts, so the
per-call path reads one host value, whether a match is kept: the window's first call matches, every
later call of the window reuses (the step's other calls too, as when a pipeline runs the guidance halves
as two calls). A compiled denoiser therefore sees two graphs, a matching call and a reusing one, and never
recompiles after. One pipeline object runs one loop at a time (its scheduler's own state allows no more), and so
does its clock; a copy of the pipeline gets a clock of its own with nothing kept.
"""
from __future__ import annotations

import inspect
from typing import Any, Dict

from .reuse import MatchCache

_WRAPPED = ("set_timesteps", "step")


def clockable(obj: Any) -> bool:
    """Whether `obj` is a pipeline whose scheduler has the loop methods the clock follows."""
    scheduler = getattr(obj, "scheduler", None)
    return scheduler is not None and all(callable(getattr(scheduler, name, None)) for name in _WRAPPED)


class StepClock:
    """Counts one pipeline's denoising steps on the host and owns the matches reused across them; with a
    ratio schedule, it also keeps the ratio of the current step (`ratio`), set on the host as each step
    starts, so a compiled denoiser reads one float and sees one graph per distinct ratio."""

    def __init__(self, pipeline: Any, steps_reused: int, schedule: Any = None) -> None:
        self.pipeline = pipeline
        self.steps_reused = steps_reused
        self.schedule = schedule  # the patch's ToMeArgs when it has a ratio_schedule (ratio_at), else None
        self.scheduler: Any = None
        self._saved: Dict[str, Any] = {}  # the scheduler's own instance attributes we shadowed
        self._reset()

    def _reset(self) -> None:
        self.count = 0  # steps done in this run
        self.total = 0  # steps in this run (the scheduler's timesteps after set_timesteps)
        self.ratio = None if self.schedule is None else self.schedule.ratio_at(0.0)
        self.kept = MatchCache()  # keyed (denoiser slot, block or level)

    # ---- the scheduler's loop methods ----
    def _set_timesteps(self, *args: Any, **kwargs: Any) -> Any:
        self._reset()  # a new run
        out = self._call("set_timesteps", args, kwargs)
        timesteps = getattr(self.scheduler, "timesteps", None)
        self.total = len(timesteps) if timesteps is not None else 0  # a length: no tensor value is read
        return out

    def _step(self, *args: Any, **kwargs: Any) -> Any:
        out = self._call("step", args, kwargs)
        self.count += 1
        self.kept.new_step()
        if self.schedule is not None and self.total:
            self.ratio = self.schedule.ratio_at(min(self.count / self.total, 1.0))
        if self.count % self.steps_reused == 0:
            # Dropped on the host as a window starts, so the window's first call always finds none kept
            # (one compiled graph for it, whatever the step).
            self.kept.clear()
        return out

    def window_begins(self) -> bool:
        """Whether the step about to run is the first of its window (restore_tokens runs it unmerged)."""
        return self.count % self.steps_reused == 0

    def window(self) -> int:
        """The number of the window the step about to run belongs to, in this run."""
        return self.count // self.steps_reused

    def _call(self, name: str, args: tuple, kwargs: dict) -> Any:
        return self._original(name)(*args, **kwargs)

    def _original(self, name: str) -> Any:
        own = self._saved.get(name)
        if own is not None:  # the instance's own override (another wrapper) still runs
            return own
        return getattr(type(self.scheduler), name).__get__(self.scheduler)

    # ---- lifecycle ----
    def attach(self) -> None:
        scheduler = self.pipeline.scheduler
        self.scheduler = scheduler
        self._saved = {name: scheduler.__dict__[name] for name in _WRAPPED if name in scheduler.__dict__}
        for name in _WRAPPED:
            setattr(scheduler, name, _LoopMethod(self, name))
        self._reset()

    def detach(self) -> None:
        scheduler, self.scheduler = self.scheduler, None
        if scheduler is None:
            return
        for name in _WRAPPED:
            wrapped = scheduler.__dict__.get(name)
            if isinstance(wrapped, _LoopMethod) and wrapped.clock is self:
                del scheduler.__dict__[name]
            if name in self._saved:
                scheduler.__dict__[name] = self._saved[name]
        self._saved = {}
        self._reset()

    def follow(self) -> None:
        """Called (eagerly) at each denoiser call: a scheduler swapped in after apply_patch
        (`pipe.scheduler = OtherScheduler.from_config(...)`) is followed from its next run on."""
        if self.pipeline.scheduler is not self.scheduler:
            self.detach()
            self.attach()

    # ---- copies keep nothing ----
    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        for name in ("count", "total", "ratio", "kept"):
            state.pop(name)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._reset()


class _LoopMethod:
    """One of the scheduler's loop methods as the clock sees it. It shows the method's own signature:
    pipelines inspect `scheduler.set_timesteps` for the arguments it takes (`timesteps`, `sigmas`)."""

    def __init__(self, clock: StepClock, name: str) -> None:
        self.clock, self.name = clock, name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.clock, "_" + self.name)(*args, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(self.clock._original(self.name))
