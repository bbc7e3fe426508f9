"""PRX: a latent [B, C, H, W] patchified row by row whose blocks take per-token rotary rows (layout "patchgrid"); its
attention's mask is the text's, so it fits merged image tokens."""
from __future__ import annotations

from typing import Tuple

from ...layouts.entries import BlockKind, RootKind, Sublayer


BLOCK_KINDS: Tuple[BlockKind, ...] = (
    # PRX: the block's attention takes the image's queries and [text, image] keys (text by its own projection),
    # rotates the image's by rows [B, 1, image, D/2, 2, 2], and builds its mask as [text mask, ones(image)] from
    # the queries it is given: the mask is the text's, so it fits merged image tokens. Its MLP is inline.
    BlockKind(
        "PRXBlock",
        sublayers=(Sublayer("attention", "merge_attn", tokens=("hidden_states",), rotary="image_rotary_emb",
                            rotary_axis=2),),
        downsample=(),
        no_downsample="PRX's processor projects the image's keys and values together with its queries "
                      "(img_qkv_proj), so no seam takes image keys alone; use mode='merge'",
        mask="text",
    ),
)


ROOT_KINDS: Tuple[RootKind, ...] = (
    # PRX: a latent [B, C, H, W] patchified row by row (img2seq) whose blocks take per-token rotary rows: the patch
    # grid matched on coordinates, as ComfyUI's Flux.
    RootKind("PRX", ("PRXTransformer2DModel",), "patchgrid", supported="the PRX transformer (torch)"),
)
