"""Image denoisers ToMe refuses by name, each with its cause (docs/limits.md): their token layouts are ones the runtime
does not merge yet. (Families refused beside one that merges stay in that family's module.)"""
from __future__ import annotations

from typing import Tuple

from ...layouts.entries import NOT_YET, RUN_WITHOUT, BlockKind, RootKind


BLOCK_KINDS: Tuple[BlockKind, ...] = ()


ROOT_KINDS: Tuple[RootKind, ...] = (
    RootKind(family="Ideogram 4", classes=("Ideogram4Transformer2DModel",), layout="levels",
             refused=f"a packed sequence whose text and image tokens are told apart by a per-token indicator tensor "
                     f"under a segment mask, {NOT_YET}; {RUN_WITHOUT}"),
    RootKind(family="ERNIE-Image", classes=("ErnieImageTransformer2DModel",), layout="levels",
             refused=f"a transformer whose blocks take tokens sequence-first [S, B, C], the image before the text, "
                     f"under a mask over both, {NOT_YET}; {RUN_WITHOUT}"),
)
