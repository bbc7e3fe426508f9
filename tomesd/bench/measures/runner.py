"""Measuring ToMe on a UNet: interleaved timings, ToMe's own share, merged tokens, peak memory.

Longer than most modules: one measuring loop (_measure) and the configurations and rows it reads and fills; the
host-work count and the memory reductions finish those rows."""
from __future__ import annotations

import contextlib
import json
import math
import statistics
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from ..kits.configs import ARCHS
from ..kits.kit_base import timed
from ..kits.pick import make_kit
from .own_time import MachineryTimer, host_seconds, own_work
from .tokens import counts, token_counter, tokens_per_level


@dataclass
class Settings:
    backend: str = "torch"
    config: str = "sd15"
    depth: Optional[int] = None  # transformers: blocks built (None: the architecture's full depth)
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
    compile: bool = False  # torch.compile one model object per configuration
    compile_backend: str = "inductor"
    compile_mode: Optional[str] = None  # inductor's mode: "reduce-overhead" replays CUDA graphs
    compile_regional: bool = False  # each repeated block compiled on its own (compile_repeated_blocks)
    modes: Tuple[str, ...] = ("merge",)
    reuse_steps: Tuple[int, ...] = (1,)  # merge rows per ratio, one per value
    downsample_factor: int = 2
    downsample_method: str = "nearest"
    steps: int = 1  # UNet calls per timed run, over distinct timesteps (a denoising loop)
    caches: Tuple[str, ...] = ()  # diffusers' step caches run beside ToMe (caches.CACHES), with --steps
    frames: int = 16  # video architectures: frames per clip
    width: int = 0  # image width in pixels; 0: res (square)


@dataclass(frozen=True)
class Config:
    """One configuration: the baseline, one of our modes, or the reference at a ratio."""

    method: str  # baseline | tome | reference
    ratio: Optional[float] = None
    mode: str = "merge"
    reuse_steps: int = 1
    cache: Optional[str] = None  # a diffusers step cache under the configuration (caches.CACHES)
    # apply_patch's arguments given whole (a quality setting's, as `frontier` times them), as JSON: hashable
    kwargs: Optional[str] = None

    def patch_kwargs(self, settings: "Settings") -> Dict[str, Any]:
        """tomesd.apply_patch's arguments for this configuration (method "tome")."""
        if self.kwargs is not None:
            return json.loads(self.kwargs)
        if self.mode in ("downsample", "downsample-restore"):
            restored = dict(reuse_steps=self.reuse_steps, restore_tokens=True) if self.mode == "downsample-restore" \
                else {}
            return dict(mode="downsample", max_downsample=settings.max_downsample,
                        downsample_factor=settings.downsample_factor, downsample_method=settings.downsample_method,
                        **restored)
        weighed = dict(proportional_attention=True) if self.mode in ("merge-prop", "merge-restore") else {}
        if self.mode == "merge-restore":
            weighed["restore_tokens"] = True
        return dict(ratio=self.ratio, max_downsample=settings.max_downsample, seed=settings.seed,
                    reuse_steps=self.reuse_steps, merge_mlp=self.mode == "merge-mlp", **weighed)


@dataclass
class Row:
    method: str  # baseline | tome | reference
    ratio: Optional[float]
    mode: str = "merge"
    reuse_steps: int = 1
    cache: Optional[str] = None
    times_s: List[float] = field(default_factory=list)
    time_s: float = math.nan
    speedup: float = math.nan
    peak_mem_bytes: Optional[int] = None
    mem_reduction: Optional[float] = None
    tome_time_s: Optional[float] = 0.0  # None with --compile: ToMe's functions run inside the compiled graph
    tome_fraction: Optional[float] = 0.0
    tome_parts: Dict[str, float] = field(default_factory=dict)  # ToMe's own seconds per kind of work (observe.WORK)
    # On a GPU: the same pieces' seconds on the host alone (Python and kernel launches, nothing waited for),
    # from one more forward with no synchronisation around them; None elsewhere.
    tome_host_s: Optional[float] = None
    tome_host_parts: Optional[Dict[str, float]] = None
    # On a GPU: the whole forward's host time (median of three, from the call to its return with nothing waited
    # for): where ToMe's host work is hidden, a forward's wall time is about max(its device time, this).
    host_time_s: Optional[float] = None
    output_change: float = 0.0  # relative to the baseline's output, at the loop's last call
    loop_change: Optional[float] = None  # with --steps N > 1: the same, averaged over the loop's calls
    tokens: Dict[str, List[int]] = field(default_factory=dict)  # level -> [before, after]
    compile_s: Optional[float] = None  # with --compile: the first call (compilation included)
    compiled_vs_eager: Optional[float] = None  # with --compile: relative difference of the compiled output
    flops: Optional[int] = None  # one forward's floating-point operations (flops.fill_flops), None if not counted
    flop_speedup: Optional[float] = None  # the baseline's flops over this row's (flops.py: a yardstick, not a bound)
    restore_bytes: Optional[int] = None  # merge-/downsample-restore: the residuals kept after the loop, all sites and calls
    restore_sites: Optional[int] = None  # ... in this many tensors (one per site, output and call of a step)
    # One eager forward's host work (host_cost.py): kernel launches (aten ops, views left out) and Python calls, the
    # blocks it reduced, and what it adds to the baseline's per reduced block (None: compiled, or not counted)
    launches: Optional[int] = None
    python_calls: Optional[int] = None
    reduced_blocks: Optional[int] = None
    added_launches_per_block: Optional[float] = None
    added_python_calls_per_block: Optional[float] = None


def configurations(settings: Settings) -> List[Config]:
    configs = [Config("baseline")]
    # merge-mlp: ToMe with the feed-forward merged too; merge-prop: with proportional attention; merge-restore:
    # that and restored tokens (with each --reuse-steps value above 1).
    for mode in ("merge", "merge-mlp", "merge-prop", "merge-restore"):
        if mode in settings.modes:
            configs += [Config("tome", ratio, mode, k) for ratio in settings.ratios for k in settings.reuse_steps
                        if k > 1 or mode != "merge-restore"]
    if "downsample" in settings.modes:
        configs.append(Config("tome", None, "downsample"))
    if "downsample-restore" in settings.modes:  # restored tokens in downsample mode, each --reuse-steps above 1
        configs += [Config("tome", None, "downsample-restore", k) for k in settings.reuse_steps if k > 1]
    if settings.compare:
        configs += [Config("reference", ratio) for ratio in settings.ratios]
    # Each cache alone, and stacked under each of our settings, all interleaved in one run.
    plain = [c for c in configs if c.method in ("baseline", "tome")]
    configs += [replace(c, cache=cache) for cache in settings.caches for c in plain]
    return configs


def run_unet(settings: Settings, progress: Callable[[int], None] = lambda n: None,
             notes: Optional[List[str]] = None, configs: Optional[List[Config]] = None) -> List[Row]:
    """One row per configuration (`configs`, the baseline first; default: the settings'), in their order. With
    settings.compile, each configuration is its own compiled copy of the model (weights shared); a reference
    that cannot be compiled is left out, with a note."""
    kit = make_kit(settings.backend, settings.device, settings.dtype)
    model = kit.build(settings.config, settings.seed, settings.depth)
    inputs = kit.inputs(settings.config, settings.batch, settings.res, settings.seed + 1, settings.frames,
                        settings.width or None)
    if settings.steps > 1:  # a denoising loop: one input per step, each its own timestep
        inputs = [inputs[:1] + (t,) + inputs[2:] for t in kit.timesteps(settings.steps)]
    else:
        inputs = [inputs]
    configs = configurations(settings) if configs is None else configs
    notes = [] if notes is None else notes
    if not settings.compile:
        return _measure(settings, kit, model, inputs, configs, progress)
    with kit.compile_settings(len(configs)):
        return _measure(settings, kit, model, inputs, configs, progress, notes)


def _measure(settings: Settings, kit: Any, model: Any, loop: List[Tuple[Any, ...]], configs: List[Config],
             progress: Callable[[int], None], notes: Optional[List[str]] = None) -> List[Row]:
    """`loop`: the inputs of the UNet calls timed as one run (one call, or a denoising loop)."""
    rows = {cfg: Row(method=cfg.method, ratio=cfg.ratio, mode=cfg.mode, reuse_steps=cfg.reuse_steps, cache=cfg.cache)
            for cfg in configs}
    inputs = loop[0]
    vae = ARCHS[settings.config].vae_factor  # pixels per latent cell: the latent whose levels tokens are counted on
    latent_hw = (settings.res // vae, (settings.width or settings.res) // vae)

    def run_loop(model: Any, outs: Optional[List[Any]] = None) -> Any:
        for step_inputs in loop:
            out = kit.forward(model, step_inputs)
            if outs is not None:
                outs.append(kit.to_numpy(out))
        return out

    eager: Dict[Config, Any] = {}  # with --compile: each configuration's patched copy, and its compiled form
    compiled: Dict[Config, Any] = {}
    if settings.compile:
        for cfg in list(configs):
            if cfg not in rows:  # a reference already left out
                continue
            eager[cfg] = kit.patched_copy(model, cfg, settings)
            compiled[cfg] = kit.compile(eager[cfg], settings.compile_backend, settings.compile_mode,
                                        settings.compile_regional)
            try:
                rows[cfg].compile_s = timed(kit, lambda: kit.forward(compiled[cfg], inputs))
            except Exception as exc:  # noqa: BLE001 - dynamo raises many kinds
                if cfg.method != "reference":
                    raise
                reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                notes.append(f"{kit.reference_name} left out: its patch does not compile into one graph "
                             f"(torch.compile fullgraph=True at r={cfg.ratio:g}: {type(exc).__name__}: {reason[:200]})")
                for other in [c for c in configs if c.method == "reference"]:
                    configs.remove(other)
                    rows.pop(other, None)
                    eager.pop(other, None)
                    compiled.pop(other, None)
            progress(1)

    # Eager, a configuration keeping nothing across calls runs on a copy patched once (weights shared), as a user
    # patches a model once and calls it at every step: its first call (a warm-up) plans its blocks and parks those
    # it never reduces. The others are patched around each forward of the shared model.
    kept: Dict[Config, Any] = {}
    if not settings.compile and kit.name == "torch":
        for cfg in configs:
            if cfg.cache is None and cfg.method in ("tome", "reference") and cfg.reuse_steps == 1 \
                    and cfg.mode in ("merge", "merge-mlp", "merge-prop", "downsample"):
                kept[cfg] = kit.patched_copy(model, cfg, settings)

    @contextlib.contextmanager
    def prepared(cfg: Config) -> Iterator[Callable[[], Any]]:
        """The forward of one configuration: its patched copy, the shared model under its patch, or its compiled
        copy."""
        if settings.compile:
            yield lambda: run_loop(compiled[cfg])
        elif cfg in kept:
            yield lambda: run_loop(kept[cfg])
        else:
            with kit.method(model, cfg, settings):
                yield lambda: run_loop(model)

    for cfg in configs:
        for _ in range(settings.warmup):
            with prepared(cfg) as forward:
                forward()
            progress(1)
    # Interleaved, alternating order: drifts of the machine hit every configuration alike.
    for rep in range(settings.repeats):
        for cfg in configs if rep % 2 == 0 else configs[::-1]:
            with prepared(cfg) as forward:
                rows[cfg].times_s.append(timed(kit, forward))
            progress(1)
    if kit.on_gpu():
        for cfg in configs:
            with prepared(cfg) as forward:
                kit.sync()
                kit.reset_peak()
                forward()
                kit.sync()
                rows[cfg].peak_mem_bytes = kit.peak_bytes()
                host = []
                for _ in range(3):
                    started = time.perf_counter()
                    forward()
                    host.append(time.perf_counter() - started)
                    kit.sync()
                rows[cfg].host_time_s = statistics.median(host) / len(loop)

    # One more forward each, eager, counting tokens (and timing ToMe's own functions, unless compiled:
    # inside a compiled graph they are not separate calls).
    machinery = kit.machinery()
    baseline_out, baseline_seen, baseline_outs = None, None, []
    for cfg in configs:  # baseline first: the others are compared with it
        row = rows[cfg]
        timer = MachineryTimer(kit)
        if settings.compile:
            target, method = eager[cfg], contextlib.nullcontext()
            compiled_out = kit.to_numpy(kit.forward(compiled[cfg], inputs))
        else:
            target = model
            method = kit.method(model, cfg, settings)
        with method, timer.installed([] if settings.compile else machinery.get(cfg.method, [])), \
                token_counter(target, kit.name) as seen, own_work(target, cfg, settings, kit) as observed:
            outs: List[Any] = []
            started = time.perf_counter()
            run_loop(target, outs)
            kit.sync()
            counted_s = time.perf_counter() - started  # the forward ToMe's own share is taken of
            out = outs[-1]
            if cfg.mode in ("merge-restore", "downsample-restore"):
                row.restore_bytes, row.restore_sites = held_residuals(target)
        if observed is not None:
            timer.total += observed.total_seconds
            row.tome_parts = {work: seconds for work, seconds in observed.seconds.items() if seconds}
            if kit.on_gpu():
                row.tome_host_parts = host_seconds(kit, model, cfg, settings, run_loop)
                row.tome_host_s = sum(row.tome_host_parts.values())
        progress(1)
        if cfg.method == "baseline" and cfg.cache is None:
            baseline_out, baseline_seen, baseline_outs = out, counts(seen), outs
        row.time_s = statistics.median(row.times_s) / len(loop)  # per UNet call
        row.tome_time_s = None if settings.compile else timer.total
        # ToMe's share of the same forward its time was counted in (the timed forwards ran elsewhere).
        row.tome_fraction = None if row.tome_time_s is None else row.tome_time_s / max(counted_s, 1e-12)
        row.tokens = {level: [n // len(loop) for n in pair]  # per UNet call
                      for level, pair in tokens_per_level(latent_hw, baseline_seen, counts(seen)).items()}
        row.output_change = _relative(out, baseline_out)
        if len(loop) > 1:
            row.loop_change = statistics.fmean(_relative(o, b) for o, b in zip(outs, baseline_outs))
        if settings.compile:  # the compiled graph computes what the patched model computes
            row.compiled_vs_eager = _relative(compiled_out, out)
    if not settings.compile and kit.name == "torch":
        _count_host_work(rows, configs, prepared, kit, model, kept, inputs)
    for cfg, copy in kept.items():  # the copies' patches go with the run (the reference's patch is its own)
        if cfg.method == "tome":
            import tomesd

            tomesd.remove_patch(copy)
    base = rows[Config("baseline")]
    for row in rows.values():
        row.speedup = base.time_s / row.time_s
    return list(rows.values())


def _count_host_work(rows: Dict[Config, Row], configs: List[Config], prepared: Any, kit: Any, model: Any,
                     kept: Dict[Config, Any], inputs: Tuple[Any, ...]) -> None:
    """Each configuration's launches and Python calls in one forward (host_cost.py), and what it adds to the
    baseline's per block it reduces (the reference's blocks: ours at its ratio, which merge the same levels)."""
    from .host_cost import host_work, reduced_blocks

    for cfg in configs:
        if cfg.cache is not None:  # a step cache's calls differ from step to step: one forward says little
            continue
        with prepared(cfg):
            target = kept.get(cfg, model)
            forward = lambda: kit.forward(target, inputs)  # noqa: E731
            work = host_work(forward)
            row = rows[cfg]
            row.launches, row.python_calls = work.launches, work.python_calls
            if cfg.method == "tome":
                row.reduced_blocks = reduced_blocks(target, forward)
    base = rows[Config("baseline")]
    if base.launches is None:
        return
    ours = {(r.ratio, r.cache): r.reduced_blocks for r in rows.values() if r.method == "tome" and r.mode == "merge"}
    for cfg, row in rows.items():
        blocks = row.reduced_blocks if cfg.method == "tome" else ours.get((cfg.ratio, cfg.cache))
        if cfg.method == "baseline" or not blocks or row.launches is None:
            continue
        if cfg.method == "reference":
            row.reduced_blocks = blocks
        row.added_launches_per_block = round((row.launches - base.launches) / blocks, 1)
        row.added_python_calls_per_block = round((row.python_calls - base.python_calls) / blocks, 1)


def held_residuals(model: Any) -> Tuple[int, int]:
    """(bytes, tensors) of the restore_tokens residuals the patches on `model` keep (restore.py), this thread's."""
    from ...hosts.targets import installed_patches
    from ...runtime.restore import residual_bytes

    caches = [p.clock.kept if p.clock is not None else p.matcher.steps.cache for p in installed_patches(model)]
    return sum(residual_bytes(p.xp, c) for p, c in zip(installed_patches(model), caches)), \
        sum(len(c.residuals) for c in caches)


def _relative(out: Any, ref: Any) -> float:
    return float(((out - ref) ** 2).sum() ** 0.5 / ((ref ** 2).sum() ** 0.5))


def config_of(row: Row) -> Config:
    return Config(row.method, row.ratio, row.mode, row.reuse_steps, row.cache)


def fill_memory_reductions(rows: List[Row]) -> None:
    base = next(row for row in rows if row.method == "baseline")
    for row in rows:
        if row.peak_mem_bytes and base.peak_mem_bytes:
            row.mem_reduction = 1 - row.peak_mem_bytes / base.peak_mem_bytes
