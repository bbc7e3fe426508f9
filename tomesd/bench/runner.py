"""Measuring ToMe on a UNet: interleaved timings, ToMe's own share, merged tokens, peak memory."""
from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from .kits import make_kit, timed


@dataclass
class Settings:
    backend: str = "torch"
    config: str = "sd15"
    res: int = 512
    batch: int = 2
    ratios: Tuple[float, ...] = (0.25, 0.5, 0.75)
    max_downsample: Optional[int] = None
    dtype: str = "float32"
    device: str = "cpu"
    repeats: int = 3
    warmup: int = 1
    compare: bool = False
    seed: int = 0


@dataclass
class Row:
    method: str  # baseline | tome | reference
    ratio: Optional[float]
    times_s: List[float] = field(default_factory=list)
    time_s: float = math.nan
    speedup: float = math.nan
    peak_mem_bytes: Optional[int] = None
    mem_reduction: Optional[float] = None
    tome_time_s: float = 0.0
    tome_fraction: float = 0.0
    output_change: float = 0.0
    tokens: Dict[str, List[int]] = field(default_factory=dict)  # level -> [before, after]


def configurations(settings: Settings) -> List[Tuple[str, Optional[float]]]:
    configs: List[Tuple[str, Optional[float]]] = [("baseline", None)]
    configs += [("tome", ratio) for ratio in settings.ratios]
    if settings.compare:
        configs += [("reference", ratio) for ratio in settings.ratios]
    return configs


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
def token_counter(model: Any, backend: str) -> Iterator[List[int]]:
    """Tokens entering each self-attention call (at to_q, so after any merge), in call order."""
    from ..adapters.frameworks import module_ops
    from ..adapters.hooks import transformer_blocks

    seen: List[int] = []
    handles = [
        block.attn1.to_q.register_forward_pre_hook(lambda module, args: seen.append(int(args[0].shape[1])))
        for block in transformer_blocks(module_ops(backend), model)
    ]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def tokens_per_level(latent: int, before: List[int], after: List[int]) -> Dict[str, List[int]]:
    """Self-attention tokens summed per downsample level: {level: [without ToMe, with ToMe]}."""
    from tome_core import downsample_level

    levels: Dict[str, List[int]] = {}
    for n_before, n_after in zip(before, after):
        entry = levels.setdefault(str(downsample_level((latent, latent), n_before)), [0, 0])
        entry[0] += n_before
        entry[1] += n_after
    return levels


def run_unet(settings: Settings, progress: Callable[[int], None] = lambda n: None) -> List[Row]:
    kit = make_kit(settings.backend, settings.device, settings.dtype)
    model = kit.build(settings.config, settings.seed)
    inputs = kit.inputs(settings.config, settings.batch, settings.res, settings.seed + 1)
    configs = configurations(settings)
    rows = {cfg: Row(method=cfg[0], ratio=cfg[1]) for cfg in configs}
    forward = lambda: kit.forward(model, inputs)  # noqa: E731

    def under(cfg: Tuple[str, Optional[float]]):
        return kit.method(model, cfg[0], cfg[1] or 0.0, settings.max_downsample, settings.seed)

    for cfg in configs:
        for _ in range(settings.warmup):
            with under(cfg):
                forward()
            progress(1)
    # Interleaved, alternating order: drifts of the machine hit every configuration alike.
    for rep in range(settings.repeats):
        for cfg in configs if rep % 2 == 0 else configs[::-1]:
            with under(cfg):
                rows[cfg].times_s.append(timed(kit, forward))
            progress(1)

    machinery = kit.machinery()
    baseline_out, baseline_seen = None, None
    for cfg in configs:  # baseline first: the others are compared with it
        row = rows[cfg]
        timer = MachineryTimer(kit)
        with under(cfg), timer.installed(machinery.get(cfg[0], [])), token_counter(model, kit.name) as seen:
            out = kit.to_numpy(forward())
        progress(1)
        if cfg[0] == "baseline":
            baseline_out, baseline_seen = out, list(seen)
        row.time_s = statistics.median(row.times_s)
        row.tome_time_s = timer.total
        row.tokens = tokens_per_level(settings.res // 8, baseline_seen, seen)
        row.output_change = float(((out - baseline_out) ** 2).sum() ** 0.5 / ((baseline_out ** 2).sum() ** 0.5))
        if kit.on_gpu():
            with under(cfg):
                kit.sync()
                kit.reset_peak()
                forward()
                kit.sync()
                row.peak_mem_bytes = kit.peak_bytes()
    base = rows[("baseline", None)]
    for row in rows.values():
        row.speedup = base.time_s / row.time_s
        row.tome_fraction = row.tome_time_s / max(row.time_s, 1e-12)
    return list(rows.values())


def measure_cpu_memory(settings: Settings, rows: List[Row], progress: Callable[[int], None] = lambda n: None) -> None:
    """Peak RSS of one forward per configuration, each in a fresh process (RSS never shrinks back)."""
    for row in rows:
        spec = json.dumps({"settings": asdict(settings), "method": row.method, "ratio": row.ratio})
        out = subprocess.run(
            [sys.executable, "-m", "tomesd.bench.memory", spec], capture_output=True, text=True, env=dict(os.environ)
        )
        if out.returncode != 0:
            raise RuntimeError(f"memory probe failed for {row.method} {row.ratio}:\n{out.stderr[-2000:]}")
        row.peak_mem_bytes = json.loads(out.stdout.strip().splitlines()[-1])["peak_rss_bytes"]
        progress(1)


def fill_memory_reductions(rows: List[Row]) -> None:
    base = next(row for row in rows if row.method == "baseline")
    for row in rows:
        if row.peak_mem_bytes and base.peak_mem_bytes:
            row.mem_reduction = 1 - row.peak_mem_bytes / base.peak_mem_bytes
