"""Token Merging for Stable Diffusion: the algorithm, free of any framework import.

"ToMe for SD" in these docstrings is the original release (0.1.3), whose results the algorithm
reproduces. Tensors reach their framework through the backend registered for it (see backend.py).
"""
from .backend import Backend, backend_for_name, get_backend, register_backend, registered_backends
from . import rng
from .token_merge import MERGE_MODES, TokenMerge
from .partitions import (
    coordinate_cells, coordinate_partition, coordinate_partitions, grid_partition, grid_partitions, num_cells,
)
from .matching import (
    Matching, bipartite_soft_matching_random2d, compute_coordinate_merges, compute_merge,
    compute_merges, compute_shared_merge, compute_shared_merges, do_nothing,
)
from .images import image_cells, own_image
from .bands import band_coordinate_merges, band_range, banded_coordinate_merges, banded_grid_merges, join_bands
from .downsample import KVDownsample, compute_downsample
from .rng import DEFAULT_SEED
from .plan import BlockPlan, block_grid, level_of, plan_grid_block, plan_level_block
from .schedule import DOWNSAMPLE_METHODS, MODES, SITES, ToMeArgs

__all__ = [
    "Backend",
    "BlockPlan",
    "DEFAULT_SEED",
    "DOWNSAMPLE_METHODS",
    "KVDownsample",
    "Matching",
    "MODES",
    "MERGE_MODES",
    "SITES",
    "ToMeArgs",
    "TokenMerge",
    "bipartite_soft_matching_random2d",
    "backend_for_name",
    "band_range",
    "band_coordinate_merges",
    "banded_grid_merges",
    "banded_coordinate_merges",
    "join_bands",
    "block_grid",
    "compute_downsample",
    "compute_coordinate_merges",
    "compute_merge",
    "compute_merges",
    "compute_shared_merge",
    "compute_shared_merges",
    "coordinate_cells",
    "coordinate_partition",
    "coordinate_partitions",
    "do_nothing",
    "level_of",
    "get_backend",
    "grid_partition",
    "grid_partitions",
    "image_cells",
    "num_cells",
    "own_image",
    "plan_grid_block",
    "plan_level_block",
    "register_backend",
    "registered_backends",
    "rng",
]
