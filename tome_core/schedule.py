"""Which blocks merge, and with what grid and r: tomesd's per-block rule."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

from .rng import DEFAULT_SEED


@dataclass(frozen=True)
class ToMeArgs:
    """The user's settings, validated once, before anything is patched."""

    ratio: float = 0.5
    max_downsample: Optional[int] = None  # None: the finest level that has attention
    sx: int = 2
    sy: int = 2
    use_rand: bool = True
    merge_attn: bool = True
    merge_crossattn: bool = False
    merge_mlp: bool = False
    seed: Optional[int] = None

    def __post_init__(self) -> None:
        if isinstance(self.ratio, bool) or not isinstance(self.ratio, (int, float)) or not 0 <= self.ratio <= 1:
            raise ValueError(f"ratio must be a number in [0, 1] (the fraction of tokens to merge away), got {self.ratio!r}")
        if self.max_downsample is not None and (not _is_int(self.max_downsample) or self.max_downsample < 1):
            raise ValueError(
                f"max_downsample must be a positive int (1, 2, 4 or 8 for SD) or None, got {self.max_downsample!r}"
            )
        for name in ("sx", "sy"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name} must be a positive int (the dst stride in tokens), got {value!r}")
        for name in ("use_rand", "merge_attn", "merge_crossattn", "merge_mlp"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise TypeError(f"seed must be an int or None, got {self.seed!r}")

    @property
    def rand_seed(self) -> int:
        """The seed of the random dst pattern: the user's, else the fixed DEFAULT_SEED."""
        return DEFAULT_SEED if self.seed is None else self.seed


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def downsample_level(latent_hw: Tuple[int, int], num_tokens: int) -> int:
    """tomesd's estimate of how many times a block's grid is downsampled from the latent."""
    h, w = latent_hw
    return int(math.ceil(math.sqrt((h * w) // num_tokens)))


def block_grid(latent_hw: Tuple[int, int], num_tokens: int) -> Optional[Tuple[int, int, int]]:
    """(level, h, w) of a block's token grid, or None when no level explains `num_tokens`.

    A UNet's strided convolutions give ceil(side / level) tokens per side. tomesd's estimate is
    used whenever its grid holds exactly `num_tokens` (so results equal tomesd's); otherwise the
    power-of-two level whose grid does. Latent sides that do not divide by the level can make the
    estimate wrong (17x24 at level 8: 3x3 tokens, estimated level 7), and such a block must not
    be given a grid it does not have.
    """
    h, w = latent_hw
    if num_tokens <= 0:
        return None
    estimate = downsample_level(latent_hw, num_tokens)
    for level in [estimate] + [1 << k for k in range(16)]:
        if level < 1:
            continue
        gh, gw = -(-h // level), -(-w // level)
        if gh * gw == num_tokens:
            return level, gh, gw
    return None


@dataclass(frozen=True)
class BlockPlan:
    w: int
    h: int
    r: int
    use_rand: bool


def plan_block(
    args: ToMeArgs, latent_hw: Tuple[int, int], batch: int, num_tokens: int, finest_level: int
) -> Optional[BlockPlan]:
    """The merge a block with `num_tokens` tokens gets, or None when it does not merge.

    `finest_level` is the level of the first attention block of the call; it stands in for
    `max_downsample` when that is None, so SD1/2 (attention at level 1) behave as tomesd's default.
    A block whose token count fits no grid of the latent is left alone.
    """
    grid = block_grid(latent_hw, num_tokens)
    if grid is None:
        return None
    level, h, w = grid
    limit = finest_level if args.max_downsample is None else args.max_downsample
    if level > limit:
        return None
    return BlockPlan(
        w=w,
        h=h,
        r=int(num_tokens * args.ratio),
        # An odd batch cannot hold matching cond/uncond halves; random dst then causes artifacts.
        use_rand=args.use_rand and batch % 2 == 0,
    )
