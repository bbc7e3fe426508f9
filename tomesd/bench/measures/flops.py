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

    from ..kits.configs import ARCHS
    from .runner import Config
    from ..kits.torch_kit import TorchKit

    arch = ARCHS[settings.config]
    # A host whose forward reads tensors on the host (arch.host_reads) is counted on the bench's device instead:
    # one real forward per row, its CPU attention kernel counted as the products it computes.
    device = settings.device if arch.host_reads else "meta"
    kit = TorchKit(device, settings.dtype)
    with torch.device(kit.device):
        model = kit.build(settings.config, settings.seed, settings.depth)
    inputs = kit.inputs(settings.config, settings.batch, settings.res, settings.seed + 1, settings.frames,
                        settings.width or None)
    flux = arch.extra in ("flux", "flux2")
    for row in rows:
        if not countable(row) or (flux and row.mode == "downsample"):
            continue  # Flux's downsampling reads its image grid from img_ids on the host: not on meta
        with kit.method(model, Config(row.method, row.ratio, row.mode, row.reuse_steps), settings):
            with FlopCounterMode(display=False, custom_mapping=_cpu_attention(torch, device)) as counter:
                kit.forward(model, inputs)
        row.flops = int(counter.get_total_flops())
    base = rows[0].flops
    for row in rows:
        if row.flops:
            row.flop_speedup = base / row.flops


def _cpu_attention(torch: Any, device: str) -> dict:
    """torch's fused CPU attention, which the counter does not know, counted as the attention it computes (the
    formula the counter gives the GPU's fused kernels). On the meta device attention decomposes and is counted
    anyway; this serves the hosts counted on the CPU."""
    from torch.utils.flop_counter import sdpa_flop_count

    if device == "meta":
        return {}

    def flops(query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
        return sdpa_flop_count(query, key, value)  # shapes: the counter passes each tensor's shape

    return {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: flops}


def where_counted(settings: Any) -> str:
    """Where fill_flops counts this architecture, for the printed note."""
    from ..kits.configs import ARCHS

    reads = ARCHS[settings.config].host_reads
    return (f"on {settings.device}, one real forward per row ({reads}: not on the meta device)") if reads \
        else "on the meta device"
