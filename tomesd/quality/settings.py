"""The settings each yardstick prices, as data (Setting: a name, tomesd.apply_patch's arguments, a diffusers step
cache), one list per --arch, the baseline first; with_cache adds each picked cache alone and under each setting."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence


@dataclass(frozen=True)
class Setting:
    name: str
    kwargs: Optional[Dict[str, Any]]  # tomesd.apply_patch's arguments; None: unpatched
    cache: Optional[str] = None  # a diffusers step cache under the setting (bench.kits.caches.CACHES)

    def __hash__(self) -> int:
        return hash(self.name)


# Restored tokens (restore_tokens), on every yardstick: with and without proportional attention, windows of 2 and 3.
_RESTORED = [
    Setting("ToMe r=0.5 reuse 3 restore", dict(ratio=0.5, reuse_steps=3, restore_tokens=True)),
    Setting("ToMe r=0.5 reuse 3 prop restore", dict(ratio=0.5, reuse_steps=3, proportional_attention=True,
                                                    restore_tokens=True)),
    Setting("ToMe r=0.5 reuse 2 prop restore", dict(ratio=0.5, reuse_steps=2, proportional_attention=True,
                                                    restore_tokens=True)),
]

# Restored tokens in downsample mode: each window's first step runs every key, its later steps add back what the
# downsampled keys changed (on Wan and SD3, toward issue 40's downsample and Wan goals).
_DOWNSAMPLE_RESTORED = [
    Setting("downsample f=2 avg reuse 3 restore", dict(mode="downsample", downsample_method="avg", reuse_steps=3,
                                                       restore_tokens=True)),
    Setting("downsample f=2 nearest reuse 3 restore", dict(mode="downsample", reuse_steps=3, restore_tokens=True)),
    *[Setting(f"downsample f={f} avg prop reuse {k} restore",
              dict(mode="downsample", downsample_factor=f, downsample_method="avg", proportional_attention=True,
                   reuse_steps=k, restore_tokens=True))
      for f, k in ((2, 3), (2, 2), (2, 4), (4, 2), (4, 3))],
]

DEFAULT_SETTINGS = [
    Setting("baseline", None),
    Setting("ToMe r=0.25", dict(ratio=0.25)),
    Setting("ToMe r=0.5", dict(ratio=0.5)),
    Setting("ToMe r=0.75", dict(ratio=0.75)),
    Setting("ToMe r=0.5 max_downsample=2", dict(ratio=0.5, max_downsample=2)),
    # Proportional attention: a merged key weighs as the tokens it holds.
    Setting("ToMe r=0.5 prop", dict(ratio=0.5, proportional_attention=True)),
    Setting("ToMe r=0.75 prop", dict(ratio=0.75, proportional_attention=True)),
    Setting("ToMe r=0.5 max_downsample=4 prop", dict(ratio=0.5, max_downsample=4, proportional_attention=True)),
    *_RESTORED,
    Setting("ToMe r=0.5 reuse 2", dict(ratio=0.5, reuse_steps=2)),
    Setting("ToMe r=0.5 reuse 3", dict(ratio=0.5, reuse_steps=3)),
    Setting("ToMe r=0.75 reuse 3", dict(ratio=0.75, reuse_steps=3)),
    Setting("ToMe r=0.5 share_across_blocks", dict(ratio=0.5, share_across_blocks=True)),
    Setting("downsample f=2 nearest", dict(mode="downsample")),
    Setting("downsample f=2 avg", dict(mode="downsample", downsample_method="avg")),
    Setting("downsample f=3 nearest", dict(mode="downsample", downsample_factor=3)),
    Setting("downsample f=2 nearest max_downsample=2", dict(mode="downsample", max_downsample=2)),
    # Every attention level (32x32, 16x16 and the 8x8 mid block): where this model leans on attention.
    Setting("ToMe r=0.5 max_downsample=4", dict(ratio=0.5, max_downsample=4)),
    Setting("ToMe r=0.5 max_downsample=4 reuse 3", dict(ratio=0.5, max_downsample=4, reuse_steps=3)),
    Setting("downsample f=2 nearest max_downsample=4", dict(mode="downsample", max_downsample=4)),
    # The feed-forward merged too, at more levels: the UNet settings whose FLOPs ratio reaches 1.4x, what pays on a
    # GPU (SD1.5 512²: only r=0.75 at every level with merge_mlp; docs/frontier.md).
    Setting("ToMe r=0.75 merge_mlp prop", dict(ratio=0.75, merge_mlp=True, proportional_attention=True)),
    Setting("ToMe r=0.5 max_downsample=4 merge_mlp prop", dict(ratio=0.5, max_downsample=4, merge_mlp=True,
                                                             proportional_attention=True)),
    Setting("ToMe r=0.75 max_downsample=4 merge_mlp", dict(ratio=0.75, max_downsample=4, merge_mlp=True)),
    Setting("ToMe r=0.75 max_downsample=4 merge_mlp prop", dict(ratio=0.75, max_downsample=4, merge_mlp=True,
                                                              proportional_attention=True)),
    # Ratios over the run's progress (tomesd #28), patched through a pipeline whose scheduler counts the steps.
    Setting("ToMe r=0.25 then 0.75 (schedule)", dict(ratio_schedule=[(0.0, 0.25), (0.5, 0.75)])),
    Setting("ToMe r=0.75 then 0.25 (schedule)", dict(ratio_schedule=[(0.0, 0.75), (0.5, 0.25)])),
]

# The SDXL-shaped UNet: no attention at 32x32; the default (max_downsample=2) merges the 16x16 level's 10 blocks,
# max_downsample=4 adds the 8x8 level's 24 (SDXL: 60 of 70 blocks at its 32² level).
SDXL_SETTINGS = [
    Setting("baseline", None),
    Setting("ToMe r=0.5", dict(ratio=0.5)),
    Setting("ToMe r=0.75", dict(ratio=0.75)),
    Setting("ToMe r=0.5 prop", dict(ratio=0.5, proportional_attention=True)),
    Setting("ToMe r=0.5 max_downsample=4", dict(ratio=0.5, max_downsample=4)),
    Setting("ToMe r=0.5 max_downsample=4 prop", dict(ratio=0.5, max_downsample=4, proportional_attention=True)),
    Setting("ToMe r=0.5 max_downsample=4 merge_mlp", dict(ratio=0.5, max_downsample=4, merge_mlp=True)),
    # The README's SDXL setting by FLOPs (1.54x on SDXL 1024²).
    Setting("ToMe r=0.5 max_downsample=4 merge_mlp prop", dict(ratio=0.5, max_downsample=4, merge_mlp=True,
                                                             proportional_attention=True)),
    Setting("ToMe r=0.25 max_downsample=4 merge_mlp prop", dict(ratio=0.25, max_downsample=4, merge_mlp=True,
                                                              proportional_attention=True)),
    Setting("ToMe r=0.75 max_downsample=4 prop", dict(ratio=0.75, max_downsample=4, proportional_attention=True)),
    Setting("ToMe r=0.75 max_downsample=4 merge_mlp prop", dict(ratio=0.75, max_downsample=4, merge_mlp=True,
                                                              proportional_attention=True)),
    Setting("ToMe r=0.5 max_downsample=4 reuse 3 prop restore", dict(ratio=0.5, max_downsample=4, reuse_steps=3,
                                                                    proportional_attention=True, restore_tokens=True)),
    Setting("ToMe r=0.5 max_downsample=4 merge_mlp reuse 3 prop restore",
            dict(ratio=0.5, max_downsample=4, merge_mlp=True, reuse_steps=3, proportional_attention=True,
                 restore_tokens=True)),
    # More merged, fewer unmerged steps: the candidates for >= 1.4x FLOPs closer than the setting above
    *[Setting(f"ToMe r={r} max_downsample=4 merge_mlp reuse {k} prop restore",
              dict(ratio=r, max_downsample=4, merge_mlp=True, reuse_steps=k, proportional_attention=True,
                   restore_tokens=True)) for r, k in ((0.75, 3), (0.6, 4), (0.75, 4))],
    Setting("ToMe r=0.5 max_downsample=4 share_across_blocks", dict(ratio=0.5, max_downsample=4,
                                                                    share_across_blocks=True)),
    Setting("downsample f=2 nearest", dict(mode="downsample")),
    Setting("downsample f=2 avg", dict(mode="downsample", downsample_method="avg")),
    Setting("downsample f=2 nearest max_downsample=4", dict(mode="downsample", max_downsample=4)),
    Setting("downsample f=2 avg max_downsample=4", dict(mode="downsample", downsample_method="avg", max_downsample=4)),
]

# The SD3-shaped model: one 32x32 patch grid in every one of its 4 joint blocks (the last context_pre_only).
SD3_SETTINGS = [
    Setting("baseline", None),
    Setting("ToMe r=0.25", dict(ratio=0.25)),
    Setting("ToMe r=0.5", dict(ratio=0.5)),
    Setting("ToMe r=0.75", dict(ratio=0.75)),
    Setting("ToMe r=0.5 reuse 2", dict(ratio=0.5, reuse_steps=2)),
    Setting("ToMe r=0.5 reuse 3", dict(ratio=0.5, reuse_steps=3)),
    Setting("ToMe r=0.5 share_across_blocks", dict(ratio=0.5, share_across_blocks=True)),
    Setting("ToMe r=0.5 merge_mlp", dict(ratio=0.5, merge_mlp=True)),
    # Lower ratios with the feed-forward merged too: the candidates for "as close as r=0.5, and faster".
    Setting("ToMe r=0.4 merge_mlp", dict(ratio=0.4, merge_mlp=True)),
    Setting("ToMe r=0.3 merge_mlp", dict(ratio=0.3, merge_mlp=True)),
    Setting("ToMe r=0.75 blocks 1-3", dict(ratio=0.75, blocks=[1, 2, 3])),
    Setting("ToMe r=0.5 prop", dict(ratio=0.5, proportional_attention=True)),
    Setting("ToMe r=0.75 prop", dict(ratio=0.75, proportional_attention=True)),
    Setting("ToMe r=0.5 merge_mlp prop", dict(ratio=0.5, merge_mlp=True, proportional_attention=True)),
    Setting("ToMe r=0.4 merge_mlp prop", dict(ratio=0.4, merge_mlp=True, proportional_attention=True)),
    Setting("ToMe r=0.5 reuse 3 prop", dict(ratio=0.5, reuse_steps=3, proportional_attention=True)),
    # Restored tokens: each window's first step unmerged, its residuals added back at the others.
    *_RESTORED,
    Setting("ToMe r=0.75 reuse 3 prop restore", dict(ratio=0.75, reuse_steps=3, proportional_attention=True,
                                                     restore_tokens=True)),
    Setting("ToMe r=0.5 merge_mlp reuse 3 prop restore", dict(ratio=0.5, merge_mlp=True, reuse_steps=3,
                                                              proportional_attention=True, restore_tokens=True)),
    # Candidates for ">= 30 dB at >= 1.8x": more merged, the feed-forward too, longer windows (fewer unmerged steps).
    Setting("ToMe r=0.75 merge_mlp prop", dict(ratio=0.75, merge_mlp=True, proportional_attention=True)),
    *[Setting(f"ToMe r={r} merge_mlp reuse {k} prop restore", dict(ratio=r, merge_mlp=True, reuse_steps=k,
                                                                   proportional_attention=True, restore_tokens=True))
      for r, k in ((0.75, 3), (0.75, 4), (0.6, 4))],
    Setting("downsample f=2 nearest", dict(mode="downsample")),
    Setting("downsample f=2 avg", dict(mode="downsample", downsample_method="avg")),
    Setting("downsample f=3 nearest", dict(mode="downsample", downsample_factor=3)),
    Setting("downsample f=4 nearest", dict(mode="downsample", downsample_factor=4)),
    Setting("downsample f=4 avg", dict(mode="downsample", downsample_factor=4, downsample_method="avg")),
    Setting("downsample f=2 nearest prop", dict(mode="downsample", proportional_attention=True)),
    Setting("downsample f=2 avg prop", dict(mode="downsample", downsample_method="avg", proportional_attention=True)),
    *_DOWNSAMPLE_RESTORED,
    # The band rule: what each rank of a 2- or 4-way context-parallel run merges (bands of 16 or 8 patch rows).
    Setting("ToMe r=0.5 bands=2", dict(ratio=0.5, bands=2)),
    Setting("ToMe r=0.5 bands=4", dict(ratio=0.5, bands=4)),
]
# The motion UNet: its spatial blocks merge within each frame (32x32, 16x16 and the 8x8 mid block, as on
# the image UNet); temporal blocks are never touched.
VIDEO_SETTINGS = [
    Setting("baseline", None),
    Setting("ToMe r=0.25", dict(ratio=0.25)),
    Setting("ToMe r=0.5", dict(ratio=0.5)),
    Setting("ToMe r=0.75", dict(ratio=0.75)),
    Setting("ToMe r=0.5 reuse 3", dict(ratio=0.5, reuse_steps=3)),
    Setting("ToMe r=0.5 max_downsample=4", dict(ratio=0.5, max_downsample=4)),
    Setting("ToMe r=0.5 prop", dict(ratio=0.5, proportional_attention=True)),
    Setting("ToMe r=0.5 max_downsample=4 prop", dict(ratio=0.5, max_downsample=4, proportional_attention=True)),
    *_RESTORED,
    Setting("downsample f=2 nearest", dict(mode="downsample")),
    Setting("downsample f=2 nearest max_downsample=4", dict(mode="downsample", max_downsample=4)),
]
# Wan: one space-time grid of 8 frames x 16 x 16 patches in every block; `st=2` keeps one dst per 2 x 2 x 2
# cell, so a token may merge into the neighbouring frame's (what cross-frame merging costs, beside st=1).
WAN_SETTINGS = [
    Setting("baseline", None),
    Setting("ToMe r=0.25", dict(ratio=0.25)),
    Setting("ToMe r=0.25 st=2", dict(ratio=0.25, st=2)),
    Setting("ToMe r=0.5", dict(ratio=0.5)),
    Setting("ToMe r=0.5 st=2", dict(ratio=0.5, st=2)),
    Setting("ToMe r=0.75", dict(ratio=0.75)),
    Setting("ToMe r=0.75 st=2", dict(ratio=0.75, st=2)),
    Setting("ToMe r=0.5 merge_mlp", dict(ratio=0.5, merge_mlp=True)),
    Setting("ToMe r=0.5 st=2 merge_mlp", dict(ratio=0.5, st=2, merge_mlp=True)),
    Setting("ToMe r=0.5 reuse 3", dict(ratio=0.5, reuse_steps=3)),
    Setting("ToMe r=0.5 prop", dict(ratio=0.5, proportional_attention=True)),
    Setting("ToMe r=0.5 st=2 prop", dict(ratio=0.5, st=2, proportional_attention=True)),
    Setting("ToMe r=0.25 prop", dict(ratio=0.25, proportional_attention=True)),
    Setting("ToMe r=0.5 merge_mlp prop", dict(ratio=0.5, merge_mlp=True, proportional_attention=True)),
    *_RESTORED,
    Setting("ToMe r=0.75 reuse 3 restore", dict(ratio=0.75, reuse_steps=3, restore_tokens=True)),
    # The band rule: what each rank of a 2- or 4-way context-parallel run merges (4 or 2 frames of 16 x 16).
    Setting("ToMe r=0.5 bands=2", dict(ratio=0.5, bands=2)),
    Setting("ToMe r=0.5 bands=4", dict(ratio=0.5, bands=4)),
    Setting("downsample f=2 nearest", dict(mode="downsample")),
    Setting("downsample f=2 avg", dict(mode="downsample", downsample_method="avg")),
    Setting("downsample f=3 avg", dict(mode="downsample", downsample_factor=3, downsample_method="avg")),
    Setting("downsample f=4 avg", dict(mode="downsample", downsample_factor=4, downsample_method="avg")),
    Setting("downsample f=2 avg prop", dict(mode="downsample", downsample_method="avg", proportional_attention=True)),
    *_DOWNSAMPLE_RESTORED,
]
SETTINGS = {"sd1": DEFAULT_SETTINGS, "sdxl": SDXL_SETTINGS, "sd3": SD3_SETTINGS, "video": VIDEO_SETTINGS,
            "wan": WAN_SETTINGS}


def with_cache(settings: List[Setting], picked: Sequence[str]) -> List[Setting]:
    """`settings` (the baseline first), then each cache alone and stacked under each other setting."""
    stacked = list(settings)
    for cache in picked:
        stacked += [Setting(f"{cache} alone", None, cache)] + [
            Setting(f"{s.name} + {cache}", s.kwargs, cache) for s in settings[1:]]
    return stacked
