"""The compute each configuration leaves: one forward's floating-point operations, counted by torch's
`FlopCounterMode` on the `meta` device (no weights allocated, nothing computed, seconds even at full
size; there attention is counted as the products it decomposes into, which the counter does not see in
the CPU's fused kernel). The baseline's count over a configuration's is the speed-up if time followed the
matrix products alone. It is a yardstick for timings, not a bound: ToMe's own gathers, scatters and sorts
count nothing (so measured speed-ups fall short of it where compute dominates), and neither does the
softmax over every pair of tokens, which merging shrinks quadratically (so on a CPU, where that softmax
is slow, UNets measure above it)."""
from __future__ import annotations

from typing import Any, List


def countable(row: Any) -> bool:
    """Rows whose forward runs on the meta device: not a step cache (it keeps state across calls), not
    reuse over a bare model's loop (telling steps apart reads the timestep on the host), not a reference."""
    return row.method in ("baseline", "tome") and row.cache is None and row.reuse_steps == 1


def fill_flops(settings: Any, rows: List[Any]) -> None:
    """Sets each countable row's `flops` and `flop_speedup` (the baseline's count over its own). Torch only:
    the count is the architecture's and the setting's, the same on either framework."""
    if settings.backend != "torch" or not rows or rows[0].method != "baseline":
        return
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from .configs import ARCHS
    from .runner import Config
    from .torch_kit import TorchKit

    kit = TorchKit("meta", settings.dtype)
    with torch.device("meta"):
        model = kit.build(settings.config, settings.seed, settings.depth)
    inputs = kit.inputs(settings.config, settings.batch, settings.res, settings.seed + 1, settings.frames,
                        settings.width or None)
    flux = ARCHS[settings.config].extra in ("flux", "flux2")
    for row in rows:
        if not countable(row) or (flux and row.mode == "downsample"):
            continue  # Flux's downsampling reads its image grid from img_ids on the host: not on meta
        with kit.method(model, Config(row.method, row.ratio, row.mode, row.reuse_steps), settings):
            with FlopCounterMode(display=False) as counter:
                kit.forward(model, inputs)
        row.flops = int(counter.get_total_flops())
    base = rows[0].flops
    for row in rows:
        if row.flops:
            row.flop_speedup = base / row.flops
