"""Which blocks merge, and with what grid and r: ToMe for SD's per-block rule."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from .rng import DEFAULT_SEED


MODES = ("merge", "downsample")
# Where tokens merge, as per-site ratios name them, and the flag that turns each on.
SITES = {"attn": "merge_attn", "crossattn": "merge_crossattn", "mlp": "merge_mlp"}
DOWNSAMPLE_METHODS = ("nearest", "avg")
# What each mode means by default. A field left None takes its mode's default; a field given for a
# mode that has no use for it is refused (see ToMeArgs.__post_init__).
_MERGE_DEFAULTS = dict(ratio=0.5, sx=2, sy=2, use_rand=True, merge_attn=True, merge_crossattn=False,
                       merge_mlp=False, share_across_blocks=False, st=1, bands=1)
_DOWNSAMPLE_DEFAULTS = dict(downsample_factor=2, downsample_method="nearest")
# Either mode. In downsample mode reuse_steps only sets restore_tokens' window: nothing else is reused there.
_COMMON_DEFAULTS = dict(proportional_attention=False, reuse_steps=1, restore_tokens=False, kept_sizes=16)


@dataclass(frozen=True)
class ToMeArgs:
    """The user's settings, validated once, before anything is patched: every bad value raises a
    ValueError that names the argument.

    The first nine fields are ToMe for SD's, in ToMe for SD's order. `mode="merge"` is exact ToMe (with
    `reuse_steps` / `share_across_blocks` reusing its matching); `mode="downsample"` gives
    self-attention keys and values from the block's token grid downsampled by
    `downsample_factor` per side (ToDo), queries untouched.
    """

    ratio: Optional[float] = None
    max_downsample: Optional[int] = None  # None: the finest level that has attention
    sx: Optional[int] = None
    sy: Optional[int] = None
    use_rand: Optional[bool] = None
    merge_attn: Optional[bool] = None
    merge_crossattn: Optional[bool] = None
    merge_mlp: Optional[bool] = None
    seed: Optional[int] = None
    mode: str = "merge"
    downsample_factor: Optional[int] = None
    downsample_method: Optional[str] = None
    reuse_steps: Optional[int] = None
    share_across_blocks: Optional[bool] = None
    # Diffusion transformers (one token grid for every block): the indices of the blocks that
    # reduce; None: every block. UNets choose by max_downsample instead.
    blocks: Optional[Tuple[int, ...]] = None
    # Video transformers (one sequence over frames x height x width): the dst stride along time. 1: a dst
    # in every frame's cells; 2: one dst per two frames' cell, so a frame's tokens may merge into a
    # neighbour's. Models whose blocks see one frame refuse any other value.
    st: Optional[int] = None
    # A ratio that changes over the denoising run (ToMe for SD issue #28): ((start, ratio), ...) by the run's
    # progress in [0, 1), the first piece starting at 0; replaces `ratio`. See ratio_at.
    ratio_schedule: Optional[Tuple[Tuple[float, float], ...]] = None
    # Diffusion transformers: merge within `bands` contiguous bands of the token sequence, each band matched on
    # its own (bands.py), as each rank of a `bands`-way context-parallel run merges its own. 1: one matching over
    # the whole grid. Under context parallelism the ranks' bands apply whatever this says.
    bands: Optional[int] = None
    # Proportional attention (ToMe for ViTs): a merged key weighs as the tokens it holds (log(size) on its attention
    # scores), text and unmerged keys as 1; in downsample mode a pooled key as the tokens of its cell. False: ToMe
    # for SD's attention, where a merged key counts as one.
    proportional_attention: Optional[bool] = None
    # Restored tokens (with reuse_steps=k > 1): the first step of each window of k runs unmerged and keeps, per
    # merging site, each token's output minus its merged row's mean; the window's merged steps add it back to the
    # tokens they unmerge, so a merged-away token is its row's output plus its own difference, not a copy. In
    # downsample mode each downsampled attention keeps, at that step, its output with every key minus its output
    # with the downsampled keys, and the window's later steps add it to what they compute.
    restore_tokens: Optional[bool] = None
    # What a patch keeps across calls per input size and device (index constants, plans): for at most this many
    # recent ones, so a process serving many sizes for weeks holds a bounded amount (16: a UI's usual buckets). A
    # size that comes back rebuilds its constants.
    kept_sizes: Optional[int] = None

    def __post_init__(self) -> None:
        if self.ratio_schedule is not None:
            self._check_schedule()
        if self.mode == "merge" and hasattr(self.ratio, "items"):
            self._site_ratios()
        if self.blocks is not None:
            if isinstance(self.blocks, (str, bytes)) or not hasattr(self.blocks, "__iter__"):
                raise ValueError(f"blocks must be a list of block indices or None, got {self.blocks!r}")
            picked = tuple(self.blocks)
            if not picked or not all(_is_int(i) and i >= 0 for i in picked):
                raise ValueError(f"blocks must be a non-empty list of block indices (ints >= 0), got {self.blocks!r}")
            object.__setattr__(self, "blocks", tuple(sorted(set(picked))))
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        own, other = (
            (_MERGE_DEFAULTS, _DOWNSAMPLE_DEFAULTS) if self.mode == "merge" else (_DOWNSAMPLE_DEFAULTS, _MERGE_DEFAULTS)
        )
        given = [name for name in other if getattr(self, name) is not None]
        if self.mode == "downsample" and self.seed is not None:
            given.append("seed")
        if given:
            raise ValueError(
                f"{', '.join(given)} {'has' if len(given) == 1 else 'have'} no meaning with mode={self.mode!r}: "
                + ("downsampling has no ratio, dst grid, random pattern or matching to reuse; it always "
                   "downsamples self-attention's keys and values (reuse_steps and restore_tokens go together "
                   "there)" if self.mode == "downsample"
                   else "downsample_factor and downsample_method belong to mode='downsample'")
            )
        for name, default in {**own, **_COMMON_DEFAULTS}.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, default)
        if not _is_int(self.kept_sizes) or self.kept_sizes < 1:
            raise ValueError(f"kept_sizes must be a positive int (the input sizes and devices whose constants a patch "
                             f"keeps across calls), got {self.kept_sizes!r}")
        if not isinstance(self.proportional_attention, bool):
            raise ValueError(f"proportional_attention must be True or False, got {self.proportional_attention!r}")
        if self.max_downsample is not None and (not _is_int(self.max_downsample) or self.max_downsample < 1):
            raise ValueError(
                f"max_downsample must be a positive int (1, 2, 4 or 8 for SD) or None, got {self.max_downsample!r}"
            )
        self._check_restore()
        if self.mode == "downsample":
            self._check_downsample()
        else:
            self._check_merge()

    def _site_ratios(self) -> None:
        """ratio={"attn": 0.5, "mlp": 0.3}: each named site merges at its own ratio, the others not at all. Kept
        as a sorted tuple of (site, ratio) pairs; the site flags follow, and a flag given against it is refused."""
        sites = dict(self.ratio)
        unknown = sorted(set(sites) - set(SITES))
        if not sites or unknown:
            raise ValueError(f"ratio as a mapping names sites among {sorted(SITES)} (e.g. {{'attn': 0.5, 'mlp': 0.3}}), "
                             f"got {self.ratio!r}")
        for site, value in sites.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
                raise ValueError(f"ratio[{site!r}] must be a number in [0, 1] (the fraction of tokens to merge away), "
                                 f"got {value!r}")
        for site, flag in SITES.items():
            given = getattr(self, flag)
            if given is not None and given != (site in sites):
                raise ValueError(f"{flag}={given} contradicts ratio={self.ratio!r}: with per-site ratios, the sites "
                                 f"named merge and the others do not; leave {flag} out")
            object.__setattr__(self, flag, site in sites)
        object.__setattr__(self, "ratio", tuple(sorted(sites.items())))

    def _check_schedule(self) -> None:
        if self.mode != "merge":
            raise ValueError(f"ratio_schedule has no meaning with mode={self.mode!r}: it schedules merge mode's ratio")
        if self.ratio is not None:
            raise ValueError("give ratio or ratio_schedule, not both: the schedule gives the ratio at each step")
        try:
            pieces = tuple((float(start), float(value)) for start, value in self.ratio_schedule)
        except (TypeError, ValueError):
            raise ValueError(f"ratio_schedule must be a list of (progress, ratio) pairs such as "
                             f"[(0.0, 0.25), (0.3, 0.5), (0.8, 0.25)], got {self.ratio_schedule!r}") from None
        starts = [start for start, _ in pieces]
        if not pieces or starts[0] != 0.0 or starts != sorted(set(starts)) or starts[-1] >= 1:
            raise ValueError(f"ratio_schedule's progress points must start at 0.0 and rise within [0, 1), got "
                             f"{self.ratio_schedule!r}")
        if not all(0 <= value <= 1 for _, value in pieces):
            raise ValueError(f"ratio_schedule's ratios must be numbers in [0, 1], got {self.ratio_schedule!r}")
        if self.reuse_steps not in (None, 1):
            raise ValueError("reuse_steps cannot go with ratio_schedule: a reused matching keeps the ratio of the "
                             "step that made it")
        object.__setattr__(self, "ratio_schedule", pieces)
        object.__setattr__(self, "ratio", pieces[0][1])  # checked below as any ratio; replaced at each step

    def ratio_at(self, progress: float) -> float:
        """The scheduled ratio at `progress` (steps done over steps in the run, in [0, 1)): the last piece
        starting at or before it."""
        value = self.ratio_schedule[0][1]
        for start, ratio in self.ratio_schedule:
            if start <= progress:
                value = ratio
        return value

    def site_ratio(self, flag: str) -> float:
        """The ratio of the site a merge flag turns on (the one ratio unless per-site ratios are given)."""
        if isinstance(self.ratio, tuple):
            return dict(self.ratio).get({v: k for k, v in SITES.items()}[flag], 0.0)
        return self.ratio

    @property
    def per_site(self) -> bool:
        return isinstance(self.ratio, tuple)

    def _check_merge(self) -> None:
        if self.per_site:
            pass
        elif isinstance(self.ratio, bool) or not isinstance(self.ratio, (int, float)) or not 0 <= self.ratio <= 1:
            raise ValueError(f"ratio must be a number in [0, 1] (the fraction of tokens to merge away), got {self.ratio!r}")
        for name in ("sx", "sy", "st"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name} must be a positive int (the dst stride in tokens), got {value!r}")
        for name in ("use_rand", "merge_attn", "merge_crossattn", "merge_mlp", "share_across_blocks"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        if not _is_int(self.bands) or self.bands < 1:
            raise ValueError(f"bands must be a positive int (1: one matching over the whole token grid; P: as each "
                             f"rank of a P-way context-parallel run merges), got {self.bands!r}")
        if (self.reuse_steps > 1 or self.share_across_blocks) and not (
            self.merge_attn or self.merge_crossattn or self.merge_mlp
        ):
            raise ValueError("reuse_steps / share_across_blocks reuse a merge, but nothing merges (merge_attn, "
                             "merge_crossattn and merge_mlp are all False)")

    def _check_restore(self) -> None:
        if not _is_int(self.reuse_steps) or self.reuse_steps < 1:
            raise ValueError(
                f"reuse_steps must be a positive int (1: match at every denoising step), got {self.reuse_steps!r}"
            )
        if not isinstance(self.restore_tokens, bool):
            raise ValueError(f"restore_tokens must be True or False, got {self.restore_tokens!r}")
        if self.restore_tokens and self.reuse_steps < 2:
            restored = "merged-away tokens" if self.mode == "merge" else "what downsampling changed"
            raise ValueError(f"restore_tokens restores {restored} from the unreduced step that starts each window "
                             f"of reuse_steps steps: give reuse_steps=2 or more (e.g. reuse_steps=3), got "
                             f"reuse_steps={self.reuse_steps}")
        if self.mode == "downsample" and self.reuse_steps > 1 and not self.restore_tokens:
            raise ValueError(f"reuse_steps={self.reuse_steps} has no meaning with mode='downsample' alone: "
                             f"downsampling has no matching to reuse. Give restore_tokens=True with it (each "
                             f"window's first step runs every key and keeps what downsampling changes), or leave "
                             f"reuse_steps out")

    def _check_downsample(self) -> None:
        if not _is_int(self.downsample_factor) or self.downsample_factor < 1:
            raise ValueError(
                f"downsample_factor must be a positive int (per side; 2 keeps 1/4 of the keys), got {self.downsample_factor!r}"
            )
        if self.downsample_method not in DOWNSAMPLE_METHODS:
            raise ValueError(f"downsample_method must be one of {DOWNSAMPLE_METHODS}, got {self.downsample_method!r}")

    @property
    def rand_seed(self) -> int:
        """The seed of the random dst pattern: the user's, else the fixed DEFAULT_SEED."""
        return DEFAULT_SEED if self.seed is None else self.seed

    @property
    def steps_reused(self) -> int:
        """Denoising steps one matching (in downsample mode, one restore window) serves (1: none reused)."""
        return self.reuse_steps if self.mode == "merge" or self.restore_tokens else 1

    @property
    def reuses(self) -> bool:
        """Whether a merge outlives the block that computed it (across steps or blocks)."""
        return self.mode == "merge" and (self.reuse_steps > 1 or self.share_across_blocks)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
