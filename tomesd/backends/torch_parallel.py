"""How a torch model is split across processes, read from the model and its tensors.

- Context parallelism (`enable_parallelism(config=ContextParallelConfig(...))`) records its config on the
  model, and its hooks hand each rank one contiguous band of every split input (EquipartitionSharder:
  `chunk(P)[rank]` over the flattened ring x Ulysses mesh). The band rule (tome_core/bands.py) merges within it.
- Tensor parallelism (`TensorParallelConfig`, torch's `parallelize_module`) makes a sharded layer's output a
  DTensor inside the layer's own forward, where ToMe's hooks sit: a partial sum (row-wise) or a shard of the
  channels (column-wise), never a shard of the tokens. Merging and unmerging act along the tokens, so they
  apply to each rank's local tensor as they are (`on_local_tokens`).
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

try:
    from torch.distributed.tensor import DTensor, Shard
except ImportError:  # a torch built without distributed support has no DTensor to meet
    DTensor = Shard = None


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


def on_local_tokens(fn: Callable[[Any], Any], x: Any) -> Any:
    """`fn` (a merge or unmerge along the token axis, 1, of [B, N, C]) applied to `x`; a DTensor not sharded along
    its tokens is rebuilt from `fn` of its local tensor, with its placements (a gather or a scatter-add along
    the tokens commutes with a pending sum and with a split of the channels)."""
    if DTensor is None or not isinstance(x, DTensor):
        return fn(x)
    if any(isinstance(p, Shard) and p.dim % x.ndim == 1 for p in x.placements):
        raise ValueError(f"ToMe cannot merge tokens of a DTensor sharded along its tokens ({x.placements}): "
                         f"shard the channels (tensor parallelism) or split the sequence by context parallelism")
    return DTensor.from_local(fn(x.to_local()), x.device_mesh, x.placements, run_check=False)
