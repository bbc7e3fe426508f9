"""A root's layout, built by the name its root kind gives (RootKind.layout): the layouts of this package, and those
a family module adds (its LAYOUTS, gathered by tomesd/families/)."""
from __future__ import annotations

from typing import Any, Callable, Dict

from .coordinates import Ids, PatchGrid, SpaceTime
from .entries import RootKind
from .grids import Layout, Levels, Patches, int_patch, spacetime_patch
from .packed import Packed
from .unified import Unified

# Layouts built from (root, kind, xp) alone, by RootKind.layout.
BUILT_IN: Dict[str, Callable[..., Layout]] = {"ids": Ids, "packed": Packed, "unified": Unified}
# Layouts built from the root's patch size, or read as a UNet's levels where it cannot be read.
BY_PATCH = ("levels", "spacetime", "patches", "patchgrid")


def build_layout(root: Any, kind: RootKind, xp: Any, added: Dict[str, Callable[..., Layout]],
                 supported: str = "") -> Layout:
    """The layout of `root`; a transformer whose patch size cannot be read falls back to the level rule."""
    strategy = added.get(kind.layout) or BUILT_IN.get(kind.layout)
    if strategy is not None:
        return strategy(root, kind, xp)
    if kind.layout == "spacetime":
        patch = spacetime_patch(root)
        if patch is not None:
            return SpaceTime(root, kind, xp, kind.frame_axis, patch)
    if kind.layout in ("patches", "patchgrid"):
        patch = int_patch(root)
        if patch is not None:
            return (Patches if kind.layout == "patches" else PatchGrid)(root, kind, xp, patch)
    return Levels(root, kind, xp, supported)
