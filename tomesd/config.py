"""ToMe's settings as one object: `apply_patch(model, config=ToMeConfig(ratio=0.5))`.

One dataclass per mode, so a config names only the settings its mode uses:

- `ToMeConfig`: mode="merge", exact ToMe (tomesd's arguments and defaults, plus per-site ratios,
  seed, reuse_steps, share_across_blocks, blocks, st and ratio_schedule);
- `ToDoConfig`: mode="downsample", token downsampling of self-attention's keys and values.

Both are frozen and built by keyword only. A field left None takes its mode's default, as the same
argument of `apply_patch` does (the defaults are in each class's `DEFAULTS` and in the validated
settings, `config.args`). Construction validates: each config builds its `tome_core.ToMeArgs` by
keyword in `__post_init__` and keeps it, so a bad value raises ToMeArgs' own ValueError naming the
argument, and `apply_patch` uses exactly that object. An argument the mode has no use for is not a
field: it raises TypeError as any unknown keyword does.
`dataclasses.replace(config, sx=4)` gives a new config, validated anew. `blocks` and `ratio_schedule` are kept
as ToMeArgs normalises them (tuples: `blocks=[3, 1]` reads back `(1, 3)`), a per-site `ratio` mapping as the
config's own dict (such a config does not hash).
"""
from __future__ import annotations

import dataclasses
import types
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, Optional, Sequence, Tuple, Union

from tome_core import ToMeArgs
from tome_core.schedule import _COMMON_DEFAULTS, _DOWNSAMPLE_DEFAULTS, _MERGE_DEFAULTS


class _Config:
    """What both configs share: validation through ToMeArgs, kept as `args`."""

    mode: ClassVar[str]
    DEFAULTS: ClassVar[Mapping[str, Any]]

    def __post_init__(self) -> None:
        settings = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        args = ToMeArgs(mode=self.mode, **settings)  # raises ToMeArgs' ValueError naming the argument
        object.__setattr__(self, "_args", args)
        # Sequences kept in ToMeArgs' normalised forms (tuples, which validate again to the same settings); a
        # per-site ratio mapping as the config's own copy. `args` was fixed above either way.
        if args.blocks is not None:
            object.__setattr__(self, "blocks", args.blocks)
        if getattr(self, "ratio_schedule", None) is not None:
            object.__setattr__(self, "ratio_schedule", args.ratio_schedule)
        if isinstance(getattr(self, "ratio", None), Mapping):
            object.__setattr__(self, "ratio", dict(self.ratio))

    @property
    def args(self) -> ToMeArgs:
        """The validated settings, each default filled in (`ToMeConfig().args.sx == 2`)."""
        return self._args


@dataclass(frozen=True, kw_only=True)
class ToMeConfig(_Config):
    """mode="merge": exact ToMe. None takes the default in `ToMeConfig.DEFAULTS`: ratio 0.5, sx = sy = 2,
    use_rand True, merge_attn True, merge_crossattn False, merge_mlp False, reuse_steps 1,
    share_across_blocks False, st 1, bands 1, restore_tokens False,
    proportional_attention False, kept_sizes 16; max_downsample None (the finest level that has attention), seed
    None (tome_core.DEFAULT_SEED), blocks None (every block), ratio_schedule None (a constant ratio).
    See `tomesd.apply_patch` for what each setting does.
    """

    mode: ClassVar[str] = "merge"
    DEFAULTS: ClassVar[Mapping[str, Any]] = types.MappingProxyType({**_MERGE_DEFAULTS, **_COMMON_DEFAULTS})

    ratio: Optional[Union[float, Mapping[str, float]]] = None
    max_downsample: Optional[int] = None
    sx: Optional[int] = None
    sy: Optional[int] = None
    use_rand: Optional[bool] = None
    merge_attn: Optional[bool] = None
    merge_crossattn: Optional[bool] = None
    merge_mlp: Optional[bool] = None
    seed: Optional[int] = None
    reuse_steps: Optional[int] = None
    share_across_blocks: Optional[bool] = None
    blocks: Optional[Sequence[int]] = None
    st: Optional[int] = None
    ratio_schedule: Optional[Sequence[Tuple[float, float]]] = None
    bands: Optional[int] = None
    restore_tokens: Optional[bool] = None
    proportional_attention: Optional[bool] = None
    kept_sizes: Optional[int] = None


@dataclass(frozen=True, kw_only=True)
class ToDoConfig(_Config):
    """mode="downsample": self-attention's keys and values from the block's token grid downsampled by
    downsample_factor per side. None takes the default in `ToDoConfig.DEFAULTS`: downsample_factor 2,
    downsample_method "nearest", proportional_attention False, reuse_steps 1, restore_tokens False, kept_sizes 16; max_downsample
    None (the finest level that has attention), blocks None (every block).
    """

    mode: ClassVar[str] = "downsample"
    DEFAULTS: ClassVar[Mapping[str, Any]] = types.MappingProxyType({**_DOWNSAMPLE_DEFAULTS, **_COMMON_DEFAULTS})

    downsample_factor: Optional[int] = None
    downsample_method: Optional[str] = None
    max_downsample: Optional[int] = None
    blocks: Optional[Sequence[int]] = None
    proportional_attention: Optional[bool] = None
    reuse_steps: Optional[int] = None
    restore_tokens: Optional[bool] = None
    kept_sizes: Optional[int] = None


CONFIGS = (ToMeConfig, ToDoConfig)
