"""Timing ToMe's own work inside a benchmarked forward: this project's through its inspection seam
(tomesd.observe), the reference's by wrapping its functions."""
from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple


class MachineryTimer:
    """Adds up the time spent in ToMe's own functions (matching, merge, unmerge) during a forward."""

    def __init__(self, kit: Any):
        self.kit, self.total = kit, 0.0

    def wrap(self, fn: Callable) -> Callable:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            self.kit.sync()
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            self.kit.sync()
            self.total += time.perf_counter() - start
            if isinstance(out, tuple) and out and all(callable(o) for o in out):
                return tuple(self.wrap(o) for o in out)  # the references return (merge, unmerge)
            return out

        return wrapped

    @contextlib.contextmanager
    def installed(self, targets: List[Tuple[Any, str]]) -> Iterator[None]:
        saved = [(owner, name, getattr(owner, name)) for owner, name in targets]
        for owner, name, fn in saved:
            setattr(owner, name, self.wrap(fn))
        try:
            yield
        finally:
            for owner, name, fn in saved:
                setattr(owner, name, fn)


@contextlib.contextmanager
def own_work(model: Any, cfg: Any, settings: Any, kit: Any) -> Iterator[Optional[Any]]:
    """This project's ToMe work, timed through its inspection seam (None: not this project's patch, or a
    compiled run, where ToMe's functions are no separate calls)."""
    if cfg.method != "tome" or settings.compile:
        yield None
        return
    import tomesd

    with tomesd.observe(model, timing=True, sync=kit.sync) as observed:
        yield observed


def host_seconds(kit: Any, model: Any, cfg: Any, settings: Any, run_loop: Callable[[Any], Any]) -> Dict[str, float]:
    """The host's part of ToMe's own work in one more forward, per kind of work: the same pieces timed with no synchronisation,
    so the clock sees Python and kernel launches only (the device runs them behind). Timed with a
    synchronisation (`tome_parts`), a piece costs its host time or its device time, whichever is longer."""
    import tomesd

    with kit.method(model, cfg, settings), tomesd.observe(model, timing=True) as observed:
        run_loop(model)
        kit.sync()
    return {work: seconds for work, seconds in observed.seconds.items() if seconds}
