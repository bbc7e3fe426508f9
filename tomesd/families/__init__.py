"""The registry of the families ToMe knows. Each module under image/ and video/ is one family or a close group, and
declares, as data (tomesd/layouts/entries.py):
- BLOCK_KINDS: its transformer blocks' kinds, for every host that runs it (diffusers, ComfyUI, ppdiffusers, LDM);
- ROOT_KINDS: its denoisers (root models): the token layout their blocks see, or why ToMe refuses them;
- LAYOUTS (optional): the layouts it adds, by the name its root kinds give (variants of tomesd/layouts/);
- TEMPORAL_CONTAINERS (optional): modules whose blocks attend over frames and are left alone;
- FALLBACK (one family: the UNets): the root kind of a root no family claims.

The registry imports every module of those folders and checks the whole: a block kind or a layout declared twice,
or a root kind naming a layout nobody declares, fails at import. Adding a family is adding a module; nothing here
names one. A root's kind is its most specific match: a class of its own ancestry named exactly before one matched by a
name's suffix, a kind kept to a module before one that is not, the nearest class of its ancestry first.
"""
from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..backends.frameworks import class_names
from ..layouts.entries import BlockKind, RootKind
from ..layouts.grids import Layout
from ..layouts.strategies import BUILT_IN, BY_PATCH, build_layout

__all__ = ["BLOCK_KINDS", "FAMILY_MODULES", "KNOWN_BLOCKS", "ROOT_KINDS", "SUPPORTED", "UNET", "block_kind",
           "foreign_to_unets", "in_temporal_container", "layout_of", "refusal", "root_kind"]

_FOLDERS = ("image", "video")


def _family_modules() -> Tuple[ModuleType, ...]:
    found = []
    for folder in _FOLDERS:
        package = importlib.import_module(f"{__name__}.{folder}")
        for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda info: info.name):
            found.append(importlib.import_module(f"{package.__name__}.{info.name}"))
    return tuple(found)


FAMILY_MODULES = _family_modules()


def _gather() -> Tuple[Dict[str, BlockKind], Tuple[RootKind, ...], Dict[str, Callable[..., Layout]], Tuple[str, ...],
                       RootKind]:
    blocks: Dict[str, BlockKind] = {}
    roots: List[RootKind] = []
    layouts: Dict[str, Callable[..., Layout]] = {}
    temporal: List[str] = []
    fallbacks: List[RootKind] = []
    owner: Dict[str, str] = {}
    for module in FAMILY_MODULES:
        name = module.__name__
        for kind in getattr(module, "BLOCK_KINDS", ()):
            # Keyed by class name, "name (module...)" for a kind kept to a module, and what it must hold (when).
            key = kind.class_name + (f" ({kind.module}*)" if kind.module else "") + (f" {kind.when}" if kind.when else "")
            if key in blocks:
                raise ValueError(f"block kind {key} is declared by {owner[key]} and {name}")
            blocks[key], owner[key] = kind, name
        roots.extend(getattr(module, "ROOT_KINDS", ()))
        for layout, strategy in getattr(module, "LAYOUTS", {}).items():
            if layout in layouts or layout in BUILT_IN or layout in BY_PATCH:
                raise ValueError(f"layout {layout!r} of {name} is declared twice")
            layouts[layout] = strategy
        temporal.extend(getattr(module, "TEMPORAL_CONTAINERS", ()))
        if hasattr(module, "FALLBACK"):
            fallbacks.append(module.FALLBACK)
    if len(fallbacks) != 1:
        raise ValueError(f"one family gives the root kind of unclaimed roots (FALLBACK); found {len(fallbacks)}")
    for kind in roots + fallbacks:
        if not (kind.refused or kind.layout in layouts or kind.layout in BUILT_IN or kind.layout in BY_PATCH):
            raise ValueError(f"root kind {kind.family} names layout {kind.layout!r}, which no module declares")
        if kind.layout == "unified" and not kind.refused and kind.sequence is None:  # read at every call's blocks
            raise ValueError(f"root kind {kind.family} has layout 'unified' but no sequence (where each container's "
                             f"blocks see the image: layouts.entries.UnifiedSequence)")
    return blocks, tuple(roots), layouts, tuple(temporal), fallbacks[0]


BLOCK_KINDS, ROOT_KINDS, LAYOUTS, TEMPORAL_CONTAINERS, UNET = _gather()

SUPPORTED = (
    "a diffusers/ppdiffusers pipeline, "
    + ", ".join([UNET.supported] + [kind.supported for kind in ROOT_KINDS if kind.supported])
    + ", or an LDM / Stable Diffusion model with .model.diffusion_model"
)

# Of kinds sharing a class name, one kept to a module is tried first, and of those one that asks the block to hold
# attribute values (BlockKind.when) before one that does not.
_BY_CLASS: Dict[str, Tuple[BlockKind, ...]] = {}
for _kind in BLOCK_KINDS.values():
    _BY_CLASS[_kind.class_name] = tuple(sorted(_BY_CLASS.get(_kind.class_name, ()) + (_kind,),
                                               key=lambda k: (-len(k.module), -len(k.when))))

KNOWN_BLOCKS = ", ".join(_BY_CLASS)

# Root kinds by each class name they list, those kept to a module first; and those also matched by a name's suffix.
_ROOTS_BY_CLASS: Dict[str, Tuple[RootKind, ...]] = {}
for _root in ROOT_KINDS:
    for _name in _root.classes:
        _ROOTS_BY_CLASS[_name] = tuple(sorted(_ROOTS_BY_CLASS.get(_name, ()) + (_root,), key=lambda k: -len(k.module)))
_BY_SUFFIX = tuple(sorted(((name, kind) for kind in ROOT_KINDS if kind.suffix for name in kind.classes),
                          key=lambda entry: -len(entry[0])))


def block_kind(module: Any) -> Optional[BlockKind]:
    for cls in type(module).__mro__:
        for kind in _BY_CLASS.get(cls.__name__, ()):
            if cls.__module__.startswith(kind.module) and kind.fits(module):
                return kind
    return None


def root_kind(model: Any) -> RootKind:
    ancestry = type(model).__mro__
    modules = {cls.__module__ for cls in ancestry}
    for cls in ancestry:
        for kind in _ROOTS_BY_CLASS.get(cls.__name__, ()):
            if kind.matches({cls.__name__}, modules):
                return kind
    for cls in ancestry:
        for suffix, kind in _BY_SUFFIX:
            if cls.__name__.endswith(suffix) and kind.matches({cls.__name__}, modules):
                return kind
    return UNET


def refusal(model: Any) -> Optional[str]:
    """Why ToMe cannot patch `model` as a root, or None."""
    kind = root_kind(model)
    if not kind.refused:
        return None
    name = next(n for n in class_names(model) if n in kind.classes or n.endswith(kind.classes))
    return f"ToMe cannot patch {name}: it is {kind.refused}; expected {SUPPORTED}"


def layout_of(root: Any, kind: RootKind, xp: Any) -> Layout:
    """The layout of `root` by its root kind's name for it; one whose patch size cannot be read is read as a UNet."""
    return build_layout(root, kind, xp, LAYOUTS, SUPPORTED)


def foreign_to_unets(blocks: Any) -> List[str]:
    """The kinds among `blocks` that a UNet does not have (a UNet's are BasicTransformerBlocks): under a root in no
    family, read as a UNet, blocks of these kinds would merge tokens by the wrong rule."""
    return sorted({block_kind(block).class_name for block in blocks} - {"BasicTransformerBlock"})


def in_temporal_container(module: Any) -> bool:
    return any(name in TEMPORAL_CONTAINERS for name in class_names(module))
