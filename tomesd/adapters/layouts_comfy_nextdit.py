"""The "comfy_nextdit" layout: ComfyUI's NextDiT (Lumina 2 and Z-Image, comfy.ldm.lumina.model), a unified sequence
as diffusers' (layouts_unified.py) but joined another way. NextDiT patchifies a latent [B, C, H, W] (padded to whole
patches) into N image tokens and, where the model has `pad_tokens_multiple` (Z-Image: 32), appends pad tokens up to
a multiple of it; the caption (padded likewise) is refined apart by the context refiner, whose blocks see the text
alone and are left out by the root kind (RootKind.skip_blocks). The noise refiner's blocks see [image, pad]; the
main layers see [caption, image, pad], the caption as long for every sample (ComfyUI joins them unmasked). So the
image starts at 0 in the noise refiner and, in the main layers, N + pad tokens before the end: a place the shapes
give, read on the host from shapes only. The image's tokens are matched on its (rows, cols) grid; the caption before
them and the pad tokens after pass whole (TokenMerge.with_passing_head / with_passing_tail), each its own row.
"""
from __future__ import annotations

from typing import Any, Tuple

from .layouts import STRATEGIES, _cells
from .layouts_unified import FAMILIES, Unified, UnifiedFamily
from .references import with_head, with_tail
from .roots import RootKind

FAMILY = "Lumina 2 / Z-Image (ComfyUI)"
# Where the image sits in the blocks of each container: first ([image, pad]) or before its pad tokens at the end
# ([caption, image, pad]); the context refiner's blocks are not among the patch's blocks (skip_blocks).
FAMILIES[FAMILY] = UnifiedFamily("latent", {"noise_refiner": "first", "layers": "before_pad"})


class ComfyNextDiT(Unified):
    """Unified's matching on the image's grid, the image placed by shapes: at 0, or before its pad tokens."""

    def __init__(self, root: Any, kind: RootKind, xp: Any) -> None:
        super().__init__(root, kind, xp)
        multiple = getattr(root, "pad_tokens_multiple", None)
        self.multiple = multiple if isinstance(multiple, int) and multiple > 0 else 1

    def read(self, call: Any, module: Any, args: tuple, kwargs: dict, shape: Tuple[int, ...], name: str) -> None:
        if len(shape) != 4 or self.patch is None:
            raise ValueError(f"ToMe needs {self.model}'s '{name}' input to be a latent [B, C, H, W] and its patch_size "
                             f"an int, got {list(shape)} and {self.patch!r}")
        call.grid = (1, _cells(shape[2], self.patch), _cells(shape[3], self.patch))  # padded to whole patches

    def _span(self, x: Any, call: Any, index: int) -> Tuple[int, int, int]:
        """(tokens before the image, the image's, tokens after it) in block `index`'s input `x`."""
        f, h, w = call.grid
        n, s = f * h * w, self.xp.shape(x)[1]
        pad = -n % self.multiple
        head = 0 if self.sections[index] == "first" else s - n - pad
        if head < 0 or s - head - n != pad:
            raise ValueError(f"a block of {self.model} holds {s} tokens, where ToMe expects its image's {n} and {pad} "
                             f"pad tokens (pad_tokens_multiple {self.multiple}): its sequence was joined, split or cut "
                             f"another way than ComfyUI's NextDiT joins it; run it without ToMe")
        return head, n, pad

    def image_tokens(self, call: Any, x: Any, index: int = 0) -> Any:
        if not self.sections[index]:
            return x
        if call.coords is None:
            call.coords = self._coords(call, x)
        head, n, _ = self._span(x, call, index)
        return x[:, head:head + n]

    def placed(self, call: Any, x: Any, index: int, matching: Any) -> Any:
        if matching is None or not self.sections[index]:
            return None
        head, _, pad = self._span(x, call, index)
        return with_head(with_tail(matching, pad), head)


STRATEGIES["comfy_nextdit"] = ComfyNextDiT
