"""A key-padding mask over a joined [image, text] sequence whose image part is all True (BlockKind.mask
"image_ones_first": HunyuanVideo's and HunyuanImage's roots build it as [B, 1, 1, image + text]; HiDream's as [B,
image + padding (+ text)], ones over the image), fitted to the merged image: with N image tokens merged into M, its
last M + text entries are exactly the merged sequence's (every image entry is True, so which N - M of them go does
not matter). "image_ones_last" is the same over [text, image] (Krea 2's root builds [B, 1, 1, text + image]): its
first text + M entries. A slice of the host's tensor: no copy, no host read."""
from __future__ import annotations

from typing import Any

from .signatures import InputSpec
from .sites import SiteHook


class MaskSlice(SiteHook):
    """Around the block's self-attention, after its merge site (install order): the mask argument sliced to the
    merged keys. `flag`: the site whose merge the attention's tokens went through; `image_first`: the image's keys
    lead the mask's (else they end it)."""

    def __init__(self, patch: Any, index: int, flag: str, spec: InputSpec, image_first: bool = True) -> None:
        super().__init__(patch, index)
        self.flag, self.spec, self.image_first = flag, spec, image_first

    def pre(self, module: Any, args: tuple, kwargs: dict) -> Any:
        mask = self.spec.get(args, kwargs)
        merge = None if mask is None else self.patch.site_merge(self.index, self.flag)
        if merge is None:
            return None
        keys = self.patch.xp.shape(mask)[-1]
        if keys < merge.num_tokens:
            raise ValueError(
                f"ToMe slices {type(module).__name__}'s attention_mask to the merged image keys, which needs a mask "
                f"over {merge.num_tokens} image keys and any others; it has {keys} entries. Call apply_patch with "
                f"merge_attn=False")
        gone = merge.num_tokens - merge.num_merged
        return self.spec.replace(args, kwargs, mask[..., gone:] if self.image_first else mask[..., :keys - gone])
