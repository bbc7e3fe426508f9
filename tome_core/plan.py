"""Which blocks reduce with what r: the level rule of ToMe for SD on a UNet's token grids (a block's grid from its
token count), and the plan of a block on one patch grid (diffusion transformers), under a ToMeArgs."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

from .schedule import SITES, ToMeArgs


def level_of(latent_hw: Tuple[int, int], num_tokens: int) -> int:
    """ToMe for SD's estimate of how many times a block's grid is downsampled from the latent."""
    h, w = latent_hw
    return int(math.ceil(math.sqrt((h * w) // num_tokens)))


def block_grid(latent_hw: Tuple[int, int], num_tokens: int) -> Optional[Tuple[int, int, int]]:
    """(level, h, w) of a block's token grid, or None when no level explains `num_tokens`.

    A UNet's strided convolutions give ceil(side / level) tokens per side. ToMe for SD's estimate is
    used whenever its grid holds exactly `num_tokens` (so results equal ToMe for SD's); otherwise the
    power-of-two level whose grid does. Latent sides that do not divide by the level can make the
    estimate wrong (17x24 at level 8: 3x3 tokens, estimated level 7), and such a block must not
    be given a grid it does not have.
    """
    h, w = latent_hw
    if num_tokens <= 0:
        return None
    estimate = level_of(latent_hw, num_tokens)
    for level in [estimate] + [1 << k for k in range(16)]:
        if level < 1:
            continue
        gh, gw = -(-h // level), -(-w // level)
        if gh * gw == num_tokens:
            return level, gh, gw
    return None


@dataclass(frozen=True)
class BlockPlan:
    level: int
    w: int
    h: int
    r: int  # tokens merged away (the largest site's with per-site ratios)
    use_rand: bool
    site_r: Tuple[Tuple[str, int], ...] = ()  # per-site ratios: (merge flag, r) of each site; (): r everywhere


def _site_r(args: "ToMeArgs", num_tokens: int, ratio: Optional[float] = None) -> Tuple[int, Tuple[Tuple[str, int], ...]]:
    # Plain fields only, no properties or methods of ToMeArgs: this runs per call, and paddle's SOT translator
    # cannot simulate them inside a to_static'd forward.
    if not isinstance(args.ratio, tuple):
        return int(num_tokens * (args.ratio if ratio is None else ratio)), ()
    sites = dict(args.ratio)
    site_r = tuple((flag, int(num_tokens * sites[site])) for site, flag in SITES.items() if site in sites)
    return max(r for _, r in site_r), site_r


def plan_level_block(
    args: ToMeArgs, latent_hw: Tuple[int, int], batch: int, num_tokens: int, finest_level: int,
    ratio: Optional[float] = None,
) -> Optional[BlockPlan]:
    """What a block with `num_tokens` tokens gets, or None when it is left alone.

    `finest_level` is the level of the first attention block of the call; it stands in for
    `max_downsample` when that is None, so SD1/2 (attention at level 1) behave as ToMe for SD's default.
    The same rule picks the blocks in every mode. A block whose token count fits no grid of the
    latent is left alone.
    """
    grid = block_grid(latent_hw, num_tokens)
    if grid is None:
        return None
    level, h, w = grid
    limit = finest_level if args.max_downsample is None else args.max_downsample
    if level > limit:
        return None
    if args.mode == "downsample":
        return BlockPlan(level=level, w=w, h=h, r=0, use_rand=False)
    r, site_r = _site_r(args, num_tokens, ratio)
    return BlockPlan(
        level=level,
        w=w,
        h=h,
        r=r,
        # The reference implementation turned random dst off for odd batches: its draws came from a generator
        # that advanced between calls, so guidance halves run as two calls got different patterns. These draws
        # are keyed by (seed, timestep, block): two calls of one step draw alike, and a batch split over calls
        # merges as one call.
        use_rand=args.use_rand,
        site_r=site_r,
    )


def plan_grid_block(args: ToMeArgs, grid_hw: Tuple[int, int], batch: int, num_tokens: int, index: int,
                     ratio: Optional[float] = None) -> Optional[BlockPlan]:
    """What block `index` of a diffusion transformer gets, or None when it is left alone.

    Every block sees the same patch grid (latent sides over the patch size), so the blocks are picked by
    index (`args.blocks`; None: all). A block whose image tokens do not fill that grid is left alone.
    """
    h, w = grid_hw
    if num_tokens != h * w or (args.blocks is not None and index not in args.blocks):
        return None
    if args.mode == "downsample":
        return BlockPlan(level=1, w=w, h=h, r=0, use_rand=False)
    r, site_r = _site_r(args, num_tokens, ratio)
    return BlockPlan(level=1, w=w, h=h, r=r, use_rand=args.use_rand, site_r=site_r)
