"""Video denoisers ToMe refuses by name, each with its cause (docs/limits.md): their token layouts are ones the runtime
does not merge yet. (Families refused beside one that merges stay in that family's module.)"""
from __future__ import annotations

from typing import Tuple

from ...layouts.entries import NOT_YET, RUN_WITHOUT, BlockKind, RootKind


BLOCK_KINDS: Tuple[BlockKind, ...] = ()


ROOT_KINDS: Tuple[RootKind, ...] = (
    RootKind(family="Kandinsky 5", classes=("Kandinsky5Transformer3DModel", "Kandinsky6Transformer3DModel",
                                            "Kandinsky6SRTransformer3DModel"), layout="levels",
             refused=f"a transformer whose visual tokens run in a fractal (block-sparse) order, its text in blocks "
                     f"of the same kind, {NOT_YET}; {RUN_WITHOUT}"),
    RootKind(family="Allegro", classes=("AllegroTransformer3DModel",), layout="levels",
             refused=f"a video transformer whose rotary tables are nested per axis, {NOT_YET}; {RUN_WITHOUT}"),
    RootKind(family="MiniMax H3", classes=("MiniMaxH3Transformer3DModel",), layout="levels",
             refused=f"a packed multi-modal sequence whose rows are modulated by per-row (timestep, modality) tags, "
                     f"{NOT_YET}; {RUN_WITHOUT}"),
)
