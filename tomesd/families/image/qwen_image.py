"""Qwen-Image (and Edit, Edit Plus, Layered; its ControlNet) on diffusers, a packed latent whose grid is its
`img_shapes` argument (layout "packed"), reference images' tokens after the target's passing whole; on ComfyUI, a
Wan-format latent patchified inside (layout "spacetime", one frame). NucleusMoE-Image shares its latent and grid.
Qwen-Image 2.1 is refused by name."""
from __future__ import annotations

from typing import Tuple

from ...layouts.entries import BlockKind, Downsample, RootKind, Sublayer


BLOCK_KINDS: Tuple[BlockKind, ...] = (
    # Qwen-Image (diffusers): a double-stream block whose image stream is its own input. Its `attn` projects image
    # and text apart, rotates them by (image rows [S, D/2] complex, text rows), joins [text, image] for diffusers'
    # dispatch and returns (image, text): the image merges around it and its rows (item 0) follow; `img_mlp` sees
    # the image alone. The text's modules are never hooked. The image's rows have no batch axis and are applied as
    # complex numbers (no way the dispatch seam rotates per sample), so one matching serves the batch. (ComfyUI's
    # class of this name: below.)
    BlockKind(
        "QwenImageTransformerBlock",
        sublayers=(Sublayer("attn", "merge_attn", tokens=("hidden_states",), outputs=(0,), rotary="image_rotary_emb",
                            rotary_item=0),
                   Sublayer("img_mlp", "merge_mlp", tokens=("hidden_states",))),
        downsample=(Downsample("attn", "dispatch"),),  # rotated keys [text, image] at the dispatch: image last
        module="diffusers.",
    ),
    # Qwen-Image in ComfyUI: a double-stream block whose image stream is its own input (hidden_states). Its `attn`
    # projects the image and the text apart, joins them as [text, image], rotates both by the rows
    # `image_rotary_emb` [B, 1, text + image, ...] (text rows first, as Flux's `pe`) and splits the output at the
    # text's length, returning (image, text): the image merges around it, its rows follow. `img_mlp` sees the
    # image alone; the text's modules are never hooked.
    BlockKind(
        "QwenImageTransformerBlock",
        sublayers=(Sublayer("attn", "merge_attn", tokens=("hidden_states",), outputs=(0,),
                            rotary="image_rotary_emb", rotary_axis=2),
                   Sublayer("img_mlp", "merge_mlp", tokens=("hidden_states",))),
        downsample=(),
        no_downsample=(
            "Qwen-Image here (ComfyUI's layout) rotates the joined text and image keys inside its attention module "
            "and calls attention as a plain function, so no seam takes the rotated image keys alone; use "
            "mode='merge'"),
        module="comfy.",  # diffusers' class of this name takes rows (image, text) [S, D]: above
    ),
    # NucleusMoE-Image: the image's queries attend to keys and values [image, text] (the text's projected in the same
    # attention, or cached), the image's rotated by complex rows [image, D/2] (item 0 of (image rows, text rows); no
    # batch axis: one matching serves the batch). Its MLP is not a site: the mixture-of-experts layers take the
    # modulated and the unmodulated tokens as two inputs. Its pipeline always passes a text mask, which the root joins
    # as [image (all True), text] over those keys: sliced to the merged image's keys (runtime/key_masks.py: MaskSlice).
    BlockKind(
        "NucleusMoEImageTransformerBlock",
        sublayers=(Sublayer("attn", "merge_attn", tokens=("hidden_states",), rotary="image_rotary_emb", rotary_item=0,
                            image_keys_first=True),),
        downsample=(),
        no_downsample="NucleusMoE-Image's processor joins [image, text] keys after rotating the image's, with no seam "
                      "for image keys alone at the dispatch's end; use mode='merge'",
        mask="image_ones_first",
        module="diffusers.",
    ),
)


ROOT_KINDS: Tuple[RootKind, ...] = (
    # diffusers' Qwen-Image: a packed latent [B, N, C] whose grid is its `img_shapes` argument, per sample (frames,
    # rows, cols) of each image. Qwen-Image-Edit (and Edit Plus; Layered) join reference images' tokens after the
    # target's, each with its own entry after the target's: they pass whole (TokenMerge.with_passing_tail). Its
    # ControlNet runs the same blocks on the same latent and grid (its condition is added to the latent's tokens).
    RootKind("Qwen-Image", ("QwenImageTransformer2DModel", "QwenImageControlNetModel"), "packed",
             grid_args=("img_shapes",),
             supported="the Qwen-Image transformer or ControlNet (torch; Qwen-Image-Edit's reference tokens pass "
                       "whole)"),
    # ComfyUI's Qwen-Image: a Wan-format latent [B, C, 1, H, W] patchified inside (2x2, padded) in (row, col) order,
    # so Wan's space-time grid of one frame (its patch_size attribute, an int, reads as (1, p, p)). Reference
    # latents (Qwen-Image-Edit) join after the image's tokens: the node refuses them at the call. (diffusers' class
    # of this name takes a packed latent [B, N, C]: `module` keeps this entry to ComfyUI's.)
    RootKind("Qwen-Image (ComfyUI)", ("QwenImageTransformer2DModel",), "spacetime", frame_axis=2, module="comfy.",
             supported="ComfyUI's Qwen-Image (comfy.ldm.qwen_image.model.QwenImageTransformer2DModel; without "
                       "reference latents)"),
    RootKind("Qwen-Image 2.1", ("QwenImage21Transformer2DModel",), "packed",
             refused="a transformer whose sequence puts condition images before the target, under an image-slot mask "
                     "and a key/value cache of them, a layout ToMe does not merge yet (QwenImageTransformer2DModel "
                     "merges)"),
    # NucleusMoE-Image: Qwen-Image's packed latent and img_shapes; its blocks see the image alone (the text enters as
    # keys and values). Its pipeline passes a text mask, joined as [image (all True), text] (even unpadded): sliced to
    # the merged image's keys (the block kind's mask "image_ones_first").
    RootKind(family="NucleusMoE-Image", classes=("NucleusMoEImageTransformer2DModel",), layout="packed",
             grid_args=("img_shapes",), supported="the NucleusMoE-Image transformer (torch)"),
)
