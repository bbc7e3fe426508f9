"""How a torch model is split across processes, read from the model itself: diffusers' context parallelism
(`enable_parallelism(config=ContextParallelConfig(...))`) records its config on the model, and its hooks hand
each rank one contiguous band of every split input (EquipartitionSharder: `chunk(P)[rank]` over the flattened
ring x Ulysses mesh). The band rule (tome_core/bands.py) merges within that band.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional


class ContextSplit(NamedTuple):
    index: int  # this rank's band
    count: int  # the bands: ring degree x Ulysses degree
    uneven: str  # the config's option that lets bands differ in size ("ulysses_anything" / "ring_anything"), or ""


def context_split(root: Any) -> Optional[ContextSplit]:
    """This process's share of `root`'s token sequence under diffusers' context parallelism, or None."""
    config = getattr(getattr(root, "_parallel_config", None), "context_parallel_config", None)
    mesh = getattr(config, "_flattened_mesh", None)
    if mesh is None:
        return None
    import torch.distributed as dist

    # The rank as diffusers' sharder takes it (DeviceMesh.get_rank is not traceable by dynamo; this is).
    index = dist.get_rank(mesh.get_group())
    uneven = next((name for name in ("ulysses_anything", "ring_anything") if getattr(config, name, False)), "")
    return ContextSplit(index, mesh.size(), uneven)
