"""What ToMe knows about each kind of denoiser (a root model), as data.

A root kind says which token layout its blocks see (layouts.py: a UNet's levels, a diffusion transformer's
patch grid, Flux's ids, a video transformer's space-time grid), where its frames are, and which input gives
the grid. Adding a family whose layout exists is one entry here (and its blocks' entries in kinds.py); the
supported-model list and the refusals of unknown roots are generated from this table.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple

from .frameworks import class_names
from .roots_diffusers_0_42 import DIFFUSERS_0_42_ROOTS


@dataclass(frozen=True)
class RootKind:
    family: str  # what users call it
    classes: Tuple[str, ...]  # class names in the root's ancestry
    # "levels" | "patches" | "patchgrid" | "ids" | "spacetime" (layouts.py) | "packed" (layouts_packed.py) | "unified"
    # (layouts_unified.py)
    layout: str
    suffix: bool = False  # also match classes whose names end with one of `classes`
    video: bool = False  # "levels": a 5-D latent whose frames ride in the spatial blocks' batch
    frame_axis: Optional[int] = None  # "spacetime": the latent's frame axis
    ids: Optional[str] = None  # "ids": the input with each image token's (0, row, col)
    # "packed": the root forward's arguments that give a packed latent's token grid, plain ints or lists (never
    # tensors): three, (frames, rows, cols); or one, a list per sample of (frames, rows, cols) per image, the
    # target's first (any after it are reference images, which pass whole).
    grid_args: Tuple[str, ...] = ()
    # Pipelines that join reference-image tokens after the target's in one sequence, the target's latents
    # returned first by their prepare_latents (references.py): ToMe merges the target's only.
    joined_references: Tuple[str, ...] = ()
    # Where the root's class is defined (a module prefix; "": anywhere): ComfyUI's own classes may share a name with
    # diffusers' (QwenImageTransformer2DModel) and take another latent.
    module: str = ""
    # Attribute paths of the root's modules whose blocks see no image tokens though their class is an image block's
    # (Flux.3's text-mode and reference-mode blocks): ToMe leaves every block inside them alone.
    skip_blocks: Tuple[str, ...] = ()
    supported: str = ""  # how the supported-model list names it ("": not listed)
    refused: str = ""  # why ToMe cannot patch it ("": it can)

    def matches(self, names: set, modules: set = frozenset()) -> bool:
        if self.module and not any(m.startswith(self.module) for m in modules):
            return False
        return any(n in self.classes or (self.suffix and n.endswith(self.classes)) for n in names)


ROOT_KINDS: Tuple[RootKind, ...] = (
    # diffusers 0.42's later denoisers (roots_diffusers_0_42.py), ahead of the "Transformer2DModel" suffix entry below.
    *(RootKind(**entry) for entry in DIFFUSERS_0_42_ROOTS),
    # Denoisers whose input is not an image (or video) latent: their blocks hold tokens of embeddings.
    RootKind("Prior", ("PriorTransformer",), "levels", refused="a prior over embeddings, not over an image latent"),
    # Flux's packed latent has no spatial axes: its `img_ids` rows are (0, row, col).
    RootKind("Flux", ("FluxTransformer2DModel", "FluxControlNetModel"), "ids", suffix=True, ids="img_ids",
             joined_references=("FluxKontextPipeline", "FluxKontextInpaintPipeline"),
             supported="a Flux transformer or ControlNet (torch)"),
    # Chroma: Flux's layout (packed latent, img_ids rows (0, row, col)) under its own class, whose name would
    # otherwise end with "Transformer2DModel" and read as a patchified latent. ChromaPipeline's text mask is sliced
    # by its block kinds ("pairs_image_ones_last").
    RootKind("Chroma", ("ChromaTransformer2DModel",), "ids", ids="img_ids",
             supported="the Chroma transformer (torch)"),
    # Flux.2: a packed latent whose img_ids rows are (t=0, row, col, l=0); Flux2Pipeline, Flux2KleinPipeline and
    # Flux2KleinInpaintPipeline join reference (or condition) image tokens after the target's, as Flux Kontext does.
    RootKind("Flux.2", ("Flux2Transformer2DModel",), "ids", ids="img_ids",
             joined_references=("Flux2Pipeline", "Flux2KleinPipeline", "Flux2KleinInpaintPipeline"),
             supported="the Flux.2 transformer (torch)"),
    # Flux's layout under other classes (diffusers): Flux-derived double- and single-stream blocks over a packed
    # latent whose img_ids rows are (modality, row, col). Bria FIBO's pipelines pass a text padding mask whenever
    # the prompts are padded (with guidance, nearly always): sliced by its block kinds ("image_ones_last"); its edit
    # pipeline, and LongCat-Image's (whose ids start at (512, 512), or at the prompt's length when editing), join
    # the reference image's tokens after the target's, their latents returned first by prepare_latents.
    RootKind("Bria", ("BriaTransformer2DModel",), "ids", ids="img_ids", supported="the Bria transformer (torch)"),
    RootKind("Bria FIBO", ("BriaFiboTransformer2DModel",), "ids", ids="img_ids",
             joined_references=("BriaFiboEditPipeline",),
             supported="the Bria FIBO transformer (torch)"),
    RootKind("LongCat-Image", ("LongCatImageTransformer2DModel",), "ids", ids="img_ids",
             joined_references=("LongCatImageEditPipeline",), supported="the LongCat-Image transformer (torch)"),
    RootKind("Ovis-Image", ("OvisImageTransformer2DModel",), "ids", ids="img_ids",
             supported="the Ovis-Image transformer (torch)"),
    # Patchified latents [B, C, H, W] whose blocks see [text, image] joined (AuraFlow's single blocks) or whose
    # rotary rows [image, D] are applied inside processors that do not dispatch (CogView4, HunyuanDiT): the
    # image is the last N tokens, matched once for the batch where rotary rows cannot follow each sample.
    RootKind("AuraFlow", ("AuraFlowTransformer2DModel",), "patchgrid", supported="the AuraFlow transformer (torch)"),
    RootKind("CogView4", ("CogView4Transformer2DModel",), "patchgrid", supported="the CogView4 transformer (torch)"),
    RootKind("HunyuanDiT", ("HunyuanDiT2DModel",), "patchgrid", supported="the HunyuanDiT transformer (torch)"),
    # GLM-Image: CogView4's layout (rows [image, D] applied inside its processor, one matching for the batch).
    RootKind("GLM-Image", ("GlmImageTransformer2DModel",), "patchgrid", supported="the GLM-Image transformer (torch)"),
    # CogView3-Plus: no rotary rows (its positions are added once, at the patch embedding), so each sample is
    # matched on its own as on SD3; its own entry names it in the supported list (the suffix rule below would
    # read it alike).
    RootKind("CogView3-Plus", ("CogView3PlusTransformer2DModel",), "patches",
             supported="the CogView3-Plus transformer (torch)"),
    # Video transformers: every frame's tokens in one sequence, frames outermost. Wan [B, C, F, H, W],
    # CogVideoX [B, F, C, H, W].
    RootKind("Wan", ("WanTransformer3DModel",), "spacetime", frame_axis=2,
             supported="the Wan video transformer (torch)"),
    RootKind("CogVideoX", ("CogVideoXTransformer3DModel",), "spacetime", frame_axis=1,
             supported="the CogVideoX video transformer (torch)"),
    RootKind("ChronoEdit", ("ChronoEditTransformer3DModel",), "spacetime", frame_axis=2,
             supported="the ChronoEdit video transformer (torch)"),
    RootKind("SkyReels-V2", ("SkyReelsV2Transformer3DModel",), "spacetime", frame_axis=2,
             supported="the SkyReels-V2 video transformer (torch)"),
    # Wan VACE: Wan's blocks merge; its VACE blocks (another class) carry the control video's tokens whole.
    RootKind("Wan VACE", ("WanVACETransformer3DModel",), "spacetime", frame_axis=2,
             supported="the Wan VACE video transformer (torch; its control tokens never merge)"),
    # Wan 2.2 Animate: Wan's blocks. Its pose latents are added to the target's tokens before the blocks and its
    # face features enter through face adapters between blocks (keys of their own cross-attention, on every
    # token), so no condition token joins the blocks' sequence: only the target's merge.
    RootKind("Wan Animate", ("WanAnimateTransformer3DModel",), "spacetime", frame_axis=2,
             supported="the Wan Animate video transformer (torch; its pose and face conditions never merge)"),
    # Cosmos (Predict 2 / 2.5): [B, C, F, H, W], Wan's token order; rotary rows [image, D] without a batch axis.
    RootKind("Cosmos", ("CosmosTransformer3DModel",), "spacetime", frame_axis=2,
             supported="the Cosmos video transformer (torch)"),
    # ConsisID: CogVideoX's blocks and latent [B, F, C, H, W]; its face features join between blocks, on every token.
    RootKind("ConsisID", ("ConsisIDTransformer3DModel",), "spacetime", frame_axis=1,
             supported="the ConsisID video transformer (torch)"),
    # Mochi: [B, C, F, H, W] patchified frame by frame (patch 2, one frame each) in Wan's token order.
    RootKind("Mochi", ("MochiTransformer3DModel",), "spacetime", frame_axis=2,
             supported="the Mochi video transformer (torch; merge mode)"),
    # HunyuanVideo 1.5: [B, C, F, H, W] patchified by a Conv3d in Wan's token order; the text passes whole.
    RootKind("HunyuanVideo 1.5", ("HunyuanVideo15Transformer3DModel",), "spacetime", frame_axis=2,
             supported="the HunyuanVideo 1.5 video transformer (torch; merge mode)"),
    # HunyuanVideo: [B, C, F, H, W] on Wan's grid; blocks joining [image, text], image first, under the root's mask
    # over both (kinds_image_first.py). Its token_replace image-to-video model's first frame, the condition image,
    # passes whole (layouts_image_first.py).
    RootKind("HunyuanVideo", ("HunyuanVideoTransformer3DModel",), "hunyuan_video", frame_axis=2,
             supported="the HunyuanVideo video transformer (torch; merge mode; image-to-video's condition frame "
                       "never merges)"),
    # HunyuanVideo Framepack: HunyuanVideo's blocks; the history's tokens (4x, 2x, clean latents) join before the
    # target's in the blocks' input and pass whole (layouts_image_first.py); its image embeddings join the text.
    RootKind("HunyuanVideo Framepack", ("HunyuanVideoFramepackTransformer3DModel",), "framepack", frame_axis=2,
             supported="the HunyuanVideo Framepack video transformer (torch; merge mode; its history tokens never "
                       "merge)"),
    RootKind("EasyAnimate", ("EasyAnimateTransformer3DModel",), "spacetime", frame_axis=2,
             supported="the EasyAnimate video transformer (torch)"),
    RootKind("Sana-Video", ("SanaVideoTransformer3DModel",), "spacetime", frame_axis=2,
             supported="the Sana-Video transformer (torch)"),
    # ComfyUI's own model code (Black Forest Labs' Flux layout, as in Forge and InvokeAI; Stability's MMDiT;
    # Wan's): each patchifies (and pads) its latent inside, Flux with per-token rotary rows.
    RootKind("Flux (ComfyUI)", ("Flux",), "patchgrid",
             supported="ComfyUI's Flux and Flux.2 (comfy.ldm.flux.model.Flux)"),
    # ComfyUI's Chroma: Flux's DoubleStreamBlock / SingleStreamBlock under its own root class (modulations from
    # the root's approximator), the latent patchified inside as Flux's.
    RootKind("Chroma (ComfyUI)", ("Chroma",), "patchgrid",
             supported="ComfyUI's Chroma (comfy.ldm.chroma.model.Chroma; without an attention mask)"),
    RootKind("SD3 (ComfyUI)", ("MMDiT",), "patches", supported="ComfyUI's SD3 / SD3.5 MMDiT"),
    RootKind("Wan (ComfyUI)", ("WanModel",), "spacetime", frame_axis=2, supported="ComfyUI's Wan (comfy.ldm.wan.model.WanModel)"),
    # ComfyUI's Qwen-Image: a Wan-format latent [B, C, 1, H, W] patchified inside (2x2, padded) in (row, col) order,
    # so Wan's space-time grid of one frame (its patch_size attribute, an int, reads as (1, p, p)). Reference
    # latents (Qwen-Image-Edit) join after the image's tokens: the node refuses them at the call. (diffusers' class
    # of this name takes a packed latent [B, N, C]: `module` keeps this entry to ComfyUI's.)
    RootKind("Qwen-Image (ComfyUI)", ("QwenImageTransformer2DModel",), "spacetime", frame_axis=2, module="comfy.",
             supported="ComfyUI's Qwen-Image (comfy.ldm.qwen_image.model.QwenImageTransformer2DModel; without "
                       "reference latents)"),
    # ComfyUI's NextDiT (Lumina 2, Z-Image): [caption, image, pad] in its main layers, [image, pad] in its noise
    # refiner (layouts_comfy_nextdit.py); its context refiner's blocks see the caption alone and are left out.
    RootKind("Lumina 2 / Z-Image (ComfyUI)", ("NextDiT",), "comfy_nextdit", module="comfy.",
             skip_blocks=("context_refiner",),
             supported="ComfyUI's Lumina 2 and Z-Image (comfy.ldm.lumina.model.NextDiT)"),
    # ComfyUI's LTX-Video: Wan's space-time grid, the patch from its patchifier; guide frames pass whole
    # (layouts_comfy_ltxv.py).
    RootKind("LTX-Video (ComfyUI)", ("LTXVModel",), "comfy_ltxv", frame_axis=2, module="comfy.",
             supported="ComfyUI's LTX-Video (comfy.ldm.lightricks.model.LTXVModel; merge mode; its guide frames "
                       "never merge)"),
    # ComfyUI's Cosmos Predict2: blocks on the grid [B, T, H, W, D], flattened in Wan's order around each attention;
    # the patch from its patch_temporal / patch_spatial (layouts_comfy_cosmos.py).
    RootKind("Cosmos Predict2 (ComfyUI)", ("MiniTrainDIT",), "comfy_cosmos", frame_axis=2, module="comfy.",
             supported="ComfyUI's Cosmos Predict2 (comfy.ldm.cosmos.predict2.MiniTrainDIT; merge mode)"),
    # ComfyUI's HunyuanVideo class (HunyuanVideo and its image-to-video models, HunyuanVideo 1.5, HunyuanImage 2.1):
    # Flux's block classes, the double blocks built flipped (image first; kinds_comfy_image_first.py), the single
    # blocks over [image, text]; the image first in every block's input, the text after it passing whole
    # (layouts_comfy_image_first.py). Condition tokens that would join the image's are refused at the call.
    RootKind("HunyuanVideo (ComfyUI)", ("HunyuanVideo",), "comfy_hunyuan_video", module="comfy.",
             supported="ComfyUI's HunyuanVideo, HunyuanVideo 1.5 and HunyuanImage 2.1 (comfy.ldm.hunyuan_video.model."
                       "HunyuanVideo; merge mode; without guiding_frame_index, ref_latent or an attention mask)"),
    # ComfyUI's HiDream-I1: diffusers' layout (image tokens first in every block's input, the text after them) with
    # its own block classes (kinds_comfy_image_first.py) and its patch size as an attribute; HiDream-E1's condition
    # image, joined along the width, is refused at the call (layouts_comfy_image_first.py).
    RootKind("HiDream (ComfyUI)", ("HiDreamImageTransformer2DModel",), "comfy_hidream", module="comfy.",
             supported="ComfyUI's HiDream-I1 (comfy.ldm.hidream.model.HiDreamImageTransformer2DModel; merge mode; "
                       "not HiDream-E1's edit)"),
    # diffusers' Qwen-Image: a packed latent [B, N, C] whose grid is its `img_shapes` argument, per sample (frames,
    # rows, cols) of each image. Qwen-Image-Edit (and Edit Plus; Layered) join reference images' tokens after the
    # target's, each with its own entry after the target's: they pass whole (TokenMerge.with_passing_tail). Its
    # ControlNet runs the same blocks on the same latent and grid (its condition is added to the latent's tokens).
    RootKind("Qwen-Image", ("QwenImageTransformer2DModel", "QwenImageControlNetModel"), "packed",
             grid_args=("img_shapes",),
             supported="the Qwen-Image transformer or ControlNet (torch; Qwen-Image-Edit's reference tokens pass "
                       "whole)"),
    # LTX-Video (0.9.x): a packed latent [B, N, C] in (frame, row, col) order whose grid is its num_frames, height
    # and width arguments (in tokens). LTXConditionPipeline passes video_coords instead, with condition tokens
    # joined to the sequence: refused at its first call (layouts_packed.py).
    RootKind("LTX-Video", ("LTXVideoTransformer3DModel",), "packed", grid_args=("num_frames", "height", "width"),
             supported="the LTX-Video transformer (torch; called with num_frames, height and width)"),
    # LTX-2: LTX-Video's packed video latent and grid arguments, beside an audio latent of its own. Only the video
    # stream's sub-layers merge (kinds_ltx2.py); the audio's tokens, and the video tokens the audio attends to, stay.
    RootKind("LTX-2", ("LTX2VideoTransformer3DModel",), "packed", grid_args=("num_frames", "height", "width"),
             supported="the LTX-2 audio-video transformer (torch; called with num_frames, height and width; its audio "
                       "stream never merges)"),
    RootKind("Qwen-Image 2.1", ("QwenImage21Transformer2DModel",), "packed",
             refused="a transformer whose sequence puts condition images before the target, under an image-slot mask "
                     "and a key/value cache of them, a layout ToMe does not merge yet (QwenImageTransformer2DModel "
                     "merges)"),
    # Unified sequences (layouts_unified.py): the main layers run on one sequence joining each sample's image and
    # text with padding and a key-padding mask. Z-Image: per-sample latents (a list) whose image comes first;
    # Lumina 2: each sample's image after its own text. Image tokens merge; text and padding pass whole.
    RootKind("Z-Image", ("ZImageTransformer2DModel",), "unified", module="diffusers.",
             supported="the Z-Image transformer (torch; not its omni mode)"),
    # Z-Image's ControlNet shares the transformer's refiners (from_transformer) and runs its control layers on a
    # unified sequence of its own; the transformer takes its residuals whole between its main layers.
    RootKind("Z-Image ControlNet", ("ZImageControlNetModel",), "unified", module="diffusers.",
             refused="a ControlNet whose control layers (ZImageControlTransformerBlock) run on a unified sequence of "
                     "their own, which ToMe does not merge yet; apply_patch(pipe.transformer) merges the transformer "
                     "alone, whose main layers take the ControlNet's residuals whole"),
    RootKind("Lumina 2", ("Lumina2Transformer2DModel",), "unified", module="diffusers.",
             supported="the Lumina 2 transformer (torch)"),
    # OmniGen: [condition tokens (text with input images' tokens), time token, image] under a mask [B, 1, S, S]:
    # the image is the last N tokens of a patchified latent, rows [S, D] with no batch axis (one matching).
    RootKind("OmniGen", ("OmniGenTransformer2DModel",), "patchgrid", module="diffusers.",
             supported="the OmniGen transformer (torch; its condition tokens never merge)"),
    # PRX: a latent [B, C, H, W] patchified row by row (img2seq) whose blocks take per-token rotary rows: the patch
    # grid matched on coordinates, as ComfyUI's Flux.
    RootKind("PRX", ("PRXTransformer2DModel",), "patchgrid", supported="the PRX transformer (torch)"),
    # HunyuanImage 2.1: HunyuanVideo's blocks under its own classes over a latent [B, C, H, W] patchified by a tuple
    # (rows, cols); before the suffix rule below, which would read it as a patchified latent of an int patch.
    RootKind("HunyuanImage 2.1", ("HunyuanImageTransformer2DModel",), "patch_axes",
             supported="the HunyuanImage 2.1 transformer (torch; merge mode)"),
    # HiDream-I1: a latent [B, C, H, W] patchified inside (a non-square one padded to max_seq tokens under a mask);
    # every block's input starts with the image (kinds_image_first.py), as layout "image_first" reads it.
    RootKind("HiDream-I1", ("HiDreamImageTransformer2DModel",), "image_first", module="diffusers.",
             supported="the HiDream-I1 transformer (torch; merge mode)"),  # (ComfyUI's class of this name: above)
    # Denoisers that patchify their latent once: SD3Transformer2DModel, PixArtTransformer2DModel,
    # DiTTransformer2DModel, ppdiffusers' Transformer2DModel (PixArt, DiT), SD3ControlNetModel,
    # SanaTransformer2DModel.
    RootKind("diffusion transformer", ("Transformer2DModel", "SD3ControlNetModel"), "patches", suffix=True,
             supported="an SD3 / SD3.5, PixArt, DiT or Sana transformer (torch or paddle)"),
    # Video UNets: the latent is [B, C, F, H, W] ([B, F, C, H, W] for SVD), H and W last; the spatial blocks
    # see one frame per batch row, so tomesd's level rule merges within each frame.
    RootKind("video UNet", ("UNetMotionModel", "UNet3DConditionModel", "UNetSpatioTemporalConditionModel",
                            "I2VGenXLUNet"), "levels", video=True,
             supported="a video UNet (AnimateDiff's UNetMotionModel, UNet3DConditionModel, SVD's "
                       "UNetSpatioTemporalConditionModel, I2VGenXLUNet)"),
    # Latte: a video transformer whose spatial blocks see one frame per batch row (h x w tokens) and whose temporal
    # blocks (the same class, in `temporal_transformer_blocks`) see one grid cell's frames. The level rule merges the
    # spatial blocks within each frame; a temporal block's token count (the frames) fits no grid level at or
    # below the spatial blocks' (the patch size), so it is left alone (max_downsample could reach it: leave it out).
    RootKind("Latte", ("LatteTransformer3DModel",), "levels", video=True,
             supported="the Latte video transformer (torch)"),
)

# Any other root with known blocks: a UNet (diffusers, ppdiffusers, LDM) or a ControlNet, by tomesd's levels.
UNET = RootKind("UNet", ("UNet2DConditionModel", "ControlNetModel"), "levels",
                supported="a UNet2DConditionModel or ControlNetModel")

SUPPORTED = (
    "a diffusers/ppdiffusers pipeline, "
    + ", ".join([UNET.supported] + [kind.supported for kind in ROOT_KINDS if kind.supported])
    + ", or an LDM / Stable Diffusion model with .model.diffusion_model"
)


def root_kind(model: Any) -> RootKind:
    names, modules = class_names(model), {cls.__module__ for cls in type(model).__mro__}
    return next((kind for kind in ROOT_KINDS if kind.matches(names, modules)), UNET)


def refusal(model: Any) -> Optional[str]:
    """Why ToMe cannot patch `model` as a root, or None."""
    kind = root_kind(model)
    if not kind.refused:
        return None
    name = next(n for n in class_names(model) if n in kind.classes or n.endswith(kind.classes))
    return f"ToMe cannot patch {name}: it is {kind.refused}; expected {SUPPORTED}"
