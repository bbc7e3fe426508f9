"""JoyImage Edit: a Wan-style latent, or for an edit [B, items, C, F, H, W] whose last item is the target (layout
"items": the target's tokens merge, the reference images' after them pass whole); JoyImage Edit Plus is refused by
name."""
from __future__ import annotations

from typing import Any, Tuple

from ...layouts.coordinates import SpaceTime
from ...layouts.entries import NOT_YET, RUN_WITHOUT, BlockKind, RootKind, Sublayer
from ...layouts.grids import spacetime_patch


BLOCK_KINDS: Tuple[BlockKind, ...] = (
    # JoyImage Edit: image and text enter the block apart; `attn` projects each, rotates the image's queries and keys
    # by (cos, sin) [image, D] (item 0 of its rows (image rows, text rows); no batch axis, applied by its own function:
    # one matching serves the batch), joins [image, text] for the dispatch and returns (image, text); `img_mlp` sees
    # the image alone. No mask. The text's modules are never hooked.
    BlockKind(
        "JoyImageTransformerBlock",
        sublayers=(Sublayer("attn", "merge_attn", tokens=("hidden_states",), outputs=(0,), rotary="image_rotary_emb",
                            rotary_item=0, image_keys_first=True),
                   Sublayer("img_mlp", "merge_mlp", tokens=("hidden_states",))),
        downsample=(),
        no_downsample="JoyImage's processor projects the image's keys with fused q/k/v weights (img_attn_qkv) and "
                      "joins [image, text] before the dispatch, so no seam takes image keys alone; use mode='merge'",
        module="diffusers.",
    ),
)


ROOT_KINDS: Tuple[RootKind, ...] = (
    # JoyImage Edit: a Wan-style latent [B, C, F, H, W] (text-to-image) or [B, items, C, F, H, W] (edits: reference
    # images first, the target last, which the model moves first): double-stream blocks, the image alone in
    # `hidden_states`. The target's tokens merge; the references' follow them in the sequence and pass whole.
    RootKind(family="JoyImage Edit", classes=("JoyImageEditTransformer3DModel",), layout="items", frame_axis=2,
             supported="the JoyImage Edit transformer (torch; its reference images' tokens pass whole)"),
    # Refused: each a layout the runtime lacks (docs/limits.md).
    RootKind(family="JoyImage Edit Plus", classes=("JoyImageEditPlusTransformer3DModel",), layout="levels",
             refused=f"a transformer over padded patch lists whose mask marks padded patches, {NOT_YET} "
                     f"(JoyImageEditTransformer3DModel merges); {RUN_WITHOUT}"),
)


class Items(SpaceTime):
    def __init__(self, root: Any, kind: RootKind, xp: Any) -> None:
        patch = spacetime_patch(root)
        super().__init__(root, kind, xp, kind.frame_axis, patch or (1, 1, 1))
        self.known_patch = patch is not None

    def validate(self, patch: Any) -> None:
        if not self.known_patch:
            raise ValueError(f"ToMe reads {self.model}'s token grid from its config's patch_size (frames, rows, "
                             f"cols), which it cannot read on this model")

    def read(self, call: Any, module: Any, args: tuple, kwargs: dict, shape: Tuple[int, ...], name: str) -> None:
        if len(shape) != 6:  # one item: Wan's latent [B, C, F, H, W]
            super().read(call, module, args, kwargs, shape, name)
            return
        batch, items, channels, frames, height, width = shape
        call.grid = self._grid((batch, channels, frames, height, width))  # one item's grid: the target's
        f, h, w = call.grid
        call.tail = (items - 1) * f * h * w  # the reference images' tokens, after the target's


LAYOUTS = {"items": Items}
