"""Token Merging for Stable Diffusion: the algorithm, free of any framework import."""
from .backend import Backend, get_backend, register_backend
from .matching import TokenMerge, bipartite_soft_matching_random2d, compute_merge, do_nothing, grid_partition
from .schedule import BlockPlan, ToMeArgs, downsample_level, plan_block

__all__ = [
    "Backend",
    "BlockPlan",
    "ToMeArgs",
    "TokenMerge",
    "bipartite_soft_matching_random2d",
    "compute_merge",
    "do_nothing",
    "downsample_level",
    "get_backend",
    "grid_partition",
    "plan_block",
    "register_backend",
]
