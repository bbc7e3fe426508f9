"""A key-padding mask over a joined [image, text] sequence whose image part is all True (BlockKind.mask
"image_ones_first": HunyuanVideo's and HunyuanImage's roots build it as [B, 1, 1, image + text]; HiDream's as [B,
image + padding (+ text)], ones over the image), fitted to the merged image: with N image tokens merged into M, its
last M + text entries are exactly the merged sequence's (every image entry is True, so which N - M of them go does
not matter). "image_ones_last" is the same over [text, image] (Krea 2's root builds [B, 1, 1, text + image]): its
first text + M entries. "pairs_image_ones_last": Chroma's blocks square such a mask over [text, image] into (query,
key) pairs [B, 1, S, S] before their attention, so its image rows are alike and its image columns alike: its first
text + M rows and columns. A slice of the host's tensor: no copy, no host read."""
from __future__ import annotations

from typing import Any

from ..layouts.signatures import InputSpec
from .sites import SiteHook


class MaskSlice(SiteHook):
    """Around the block's self-attention, after its merge site (install order): the mask argument sliced to the
    merged keys. `flag`: the site whose merge the attention's tokens went through; `image_first`: the image's keys
    lead the mask's (else they end it); `axes`: how many trailing axes of the mask follow the tokens (1: keys; 2:
    queries and keys)."""

    def __init__(self, patch: Any, index: int, flag: str, spec: InputSpec, image_first: bool = True,
                 axes: int = 1) -> None:
        super().__init__(patch, index)
        self.flag, self.spec, self.image_first, self.axes = flag, spec, image_first, axes

    def pre(self, module: Any, args: tuple, kwargs: dict) -> Any:
        mask = self.spec.get(args, kwargs)
        merge = None if mask is None else self.patch.site_merge(self.index, self.flag)
        if merge is None:
            return None
        shape = self.patch.xp.shape(mask)
        if len(shape) < self.axes or min(shape[-self.axes:]) < merge.num_tokens:
            raise ValueError(
                f"ToMe slices {type(module).__name__}'s attention_mask to the merged image keys, which needs a mask "
                f"over {merge.num_tokens} image keys and any others along its last {self.axes} axes; it has shape "
                f"{tuple(shape)}. Call apply_patch with merge_attn=False")
        gone = merge.num_tokens - merge.num_merged
        kept = tuple(slice(gone, None) if self.image_first else slice(None, size - gone)
                     for size in shape[-self.axes:])
        return self.spec.replace(args, kwargs, mask[(Ellipsis,) + kept])
