"""Root kinds of diffusers 0.42's later image and video denoisers, as data (roots.py builds a RootKind of each
entry, before its catch-all "diffusion transformer" suffix entry, which would read most of these names as a
patchified SD3-style latent). Kept apart from roots.py so that families added at once stay separate entries.

Merging, on layouts_joined.py's variants of the layouts ToMe has: JoyImage Edit ("items": its multi-item latent's
target first, the reference images after it passing whole), Krea 2 ("joint_ids": rotary ids over [text, image]),
Flux.3 ("ids_cond"), Helios ("history"); Motif-Video on layouts_image_first.py's "motif_video" (HunyuanVideo's); and
on layouts as they are: NucleusMoE-Image ("packed"), AnyFlow ("spacetime"). Refused by name at apply time: layouts
the runtime does not merge yet, each with its cause.
"""
from __future__ import annotations

from typing import Any, Dict, Tuple

_NOT_YET = "a layout ToMe does not merge yet"
_RUN = "run it without ToMe"

DIFFUSERS_0_42_ROOTS: Tuple[Dict[str, Any], ...] = (
    # JoyImage Edit: a Wan-style latent [B, C, F, H, W] (text-to-image) or [B, items, C, F, H, W] (edits: reference
    # images first, the target last, which the model moves first): double-stream blocks, the image alone in
    # `hidden_states`. The target's tokens merge; the references' follow them in the sequence and pass whole.
    dict(family="JoyImage Edit", classes=("JoyImageEditTransformer3DModel",), layout="items", frame_axis=2,
         supported="the JoyImage Edit transformer (torch; its reference images' tokens pass whole)"),
    # Krea 2: the root joins [text, image] before its blocks and gives `position_ids` rows (t, h, w) for both; the
    # image's rows are the last (rows, cols) of a packed latent [B, N, C]. Its pipeline passes a text padding mask
    # for padded prompts, joined over [text, image]: sliced to the merged keys (the block kind's "image_ones_last").
    dict(family="Krea 2", classes=("Krea2Transformer2DModel",), layout="joint_ids", ids="position_ids",
         supported="the Krea 2 transformer (torch)"),
    # Flux.3: a packed latent whose img_ids rows are (t, row, col, l), Flux.2's. Its text and its reference image run
    # through per-mode blocks of the image's class first (skipped: they hold no image token), then single blocks join
    # [text, image, reference]: the reference's tokens pass whole there (layouts_joined.CondIds).
    dict(family="Flux.3", classes=("Flux3Transformer2DModel",), layout="ids_cond", ids="img_ids",
         skip_blocks=("txt_mode_blocks", "mode_blocks.image_cond"),
         supported="the Flux.3 transformer (torch; its reference image's tokens pass whole)"),
    # AnyFlow (bidirectional): Wan's layout on a latent [B, F, C, H, W] (permuted to Wan's inside), Wan's blocks under
    # its own class (kinds_diffusers_0_42.py); its timestep and modulations may be per frame, outside ToMe's sites.
    dict(family="AnyFlow", classes=("AnyFlowTransformer3DModel",), layout="spacetime", frame_axis=1,
         supported="the AnyFlow video transformer (torch)"),
    # Helios: Wan's layout and blocks under its own classes; its history latents' tokens (long, mid, short) are joined
    # before the target's: the target's are the last N and merge, the history's pass whole (layouts_joined.History).
    # Built with is_amplify_history=True, refused at apply time.
    dict(family="Helios", classes=("HeliosTransformer3DModel",), layout="history", frame_axis=2,
         supported="the Helios video transformer (torch; its history tokens pass whole)"),
    # NucleusMoE-Image: Qwen-Image's packed latent and img_shapes; its blocks see the image alone (the text enters as
    # keys and values). Its pipeline passes a text mask, joined as [image (all True), text] (even unpadded): sliced to
    # the merged image's keys (the block kind's mask "image_ones_first").
    dict(family="NucleusMoE-Image", classes=("NucleusMoEImageTransformer2DModel",), layout="packed",
         grid_args=("img_shapes",), supported="the NucleusMoE-Image transformer (torch)"),
    # Motif-Video: HunyuanVideo's latent [B, C, F, H, W] on Wan's grid and its blocks under other names
    # (kinds_image_first.py): [image, text] joined, image first, under the root's mask over both, all True over the
    # image. Its image-to-video pipeline's image embedding joins the text (passing whole).
    dict(family="Motif-Video", classes=("MotifVideoTransformer3DModel",), layout="motif_video", frame_axis=2,
         supported="the Motif-Video transformer (torch; merge mode)"),
    # Refused: each a layout the runtime lacks (docs/limits.md).
    dict(family="JoyImage Edit Plus", classes=("JoyImageEditPlusTransformer3DModel",), layout="levels",
         refused=f"a transformer over padded patch lists whose mask marks padded patches, {_NOT_YET} "
                 f"(JoyImageEditTransformer3DModel merges); {_RUN}"),
    dict(family="Bria FIBO 2", classes=("BriaFibo2Transformer2DModel",), layout="levels",
         refused=f"a unified sequence [gist, image, context images] with per-token noisy/clean modulation, {_NOT_YET} "
                 f"(BriaFiboTransformer2DModel merges); {_RUN}"),
    dict(family="Wan Animate 2", classes=("WanAnimate2Transformer3DModel",), layout="levels",
         refused=f"a transformer over per-sample token lists whose self-attention packs each frame's tokens against a "
                 f"reference key/value cache under a flex block mask, {_NOT_YET} (WanAnimateTransformer3DModel "
                 f"merges); {_RUN}"),
    dict(family="Ideogram 4", classes=("Ideogram4Transformer2DModel",), layout="levels",
         refused=f"a packed sequence whose text and image tokens are told apart by a per-token indicator tensor under "
                 f"a segment mask, {_NOT_YET}; {_RUN}"),
    dict(family="DreamLite", classes=("DreamLiteTransformer2DModel", "DreamLiteUNetModel"), layout="levels",
         refused=f"a UNet whose finest levels, where ToMe's level rule merges, have no self-attention "
                 f"(BasicTransformerBlockDreamLite without attn1), {_NOT_YET}; {_RUN}"),
    dict(family="Kandinsky 5", classes=("Kandinsky5Transformer3DModel", "Kandinsky6Transformer3DModel",
                                        "Kandinsky6SRTransformer3DModel"), layout="levels",
         refused=f"a transformer whose visual tokens run in a fractal (block-sparse) order, its text in blocks of the "
                 f"same kind, {_NOT_YET}; {_RUN}"),
    dict(family="AnyFlow FAR", classes=("AnyFlowFARTransformer3DModel",), layout="levels",
         refused=f"a causal video transformer whose attention runs under a key/value cache of earlier frames and a "
                 f"flex block mask, {_NOT_YET} (AnyFlowTransformer3DModel, its bidirectional model, merges); {_RUN}"),
    dict(family="ERNIE-Image", classes=("ErnieImageTransformer2DModel",), layout="levels",
         refused=f"a transformer whose blocks take tokens sequence-first [S, B, C], the image before the text, under a "
                 f"mask over both, {_NOT_YET}; {_RUN}"),
    dict(family="Allegro", classes=("AllegroTransformer3DModel",), layout="levels",
         refused=f"a video transformer whose rotary tables are nested per axis, {_NOT_YET}; {_RUN}"),
    dict(family="MiniMax H3", classes=("MiniMaxH3Transformer3DModel",), layout="levels",
         refused=f"a packed multi-modal sequence whose rows are modulated by per-row (timestep, modality) tags, "
                 f"{_NOT_YET}; {_RUN}"),
    dict(family="SANA-WM", classes=("SanaWMTransformer3DModel", "SanaWMLTX2RefinerTransformer3DModel"),
         layout="levels",
         refused=f"a world-model transformer (gated delta-net attention; its refiner: audio and video streams under a "
                 f"key/value cache), {_NOT_YET}; {_RUN}"),
)
