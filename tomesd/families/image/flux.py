"""Flux and the families built on its blocks: Flux.1 (and Kontext, ControlNets), Flux.2, Flux.3; Chroma, Bria, Bria
FIBO, LongCat-Image and Ovis-Image (Flux's blocks and processors under their own names); and Black Forest Labs' own
layout as ComfyUI (and Forge, InvokeAI) runs Flux, Flux.2 and Chroma. A packed latent whose grid is its `img_ids`
rows (layout "ids"; ComfyUI's: "patchgrid"); double-stream blocks whose joint attention sees [text, image] and
single-stream blocks over them joined. Flux.3's single blocks see a reference image's tokens after the target's:
layout "ids_cond" (CondIds, here).

ComfyUI's blocks are model code as its authors wrote it (Black Forest Labs' layout), not as diffusers re-wrote it:
their attention is a function over fused projections, so they merge by spans (entries.Span) more than by sub-layers."""
from __future__ import annotations

from typing import Any, Tuple

from ...layouts.coordinates import Ids, PatchGrid
from ...layouts.entries import (NOT_YET, RUN_WITHOUT, BlockKind, Downsample, RootKind, Span, Sublayer,
                               comfy_rotates_inside)


def _flux_double(name: str, mask: str = "") -> BlockKind:
    """A Flux-derived double-stream block: its `attn` joint attention over [text, image], given the image as
    hidden_states and the per-token rows [text + image, D], returns (image, text); its processor rotates with
    diffusers' apply_rotary_emb and calls the dispatch (so mode='downsample' and per-sample rows work there)."""
    return BlockKind(
        name,
        sublayers=(Sublayer("attn", "merge_attn", tokens=("hidden_states",), outputs=(0,), rotary="image_rotary_emb",
                            rotates="cos_sin"),
                   Sublayer("ff", "merge_mlp")),
        downsample=(Downsample("attn", "dispatch"),), mask=mask,
    )


def _flux_single(name: str, mask: str = "") -> BlockKind:
    """A Flux-derived single-stream block over [text, image] joined: norm -> (attn, proj_mlp) -> proj_out, as
    FluxSingleTransformerBlock (the MLP's gate and activation in between act on each token alone)."""
    return BlockKind(
        name,
        sublayers=(),
        downsample=(Downsample("attn", "dispatch"),),
        spans=(Span("norm", 0, ("proj_out",), "merge_attn", attention="attn", rotary_at="attn", rotates="cos_sin",
                    attention_call="attn"),), mask=mask,
    )


def _parallel(name: str) -> BlockKind:
    """A "parallel" block whose attention and feed-forward both take one modulated sequence ending with the image
    (Flux.3's): the attention rotates queries and keys by (cos, sin) rows over that sequence with diffusers'
    apply_rotary_emb on [B, S, heads, D] and calls the dispatch (per-sample rows there; keys shrinkable there)."""
    return BlockKind(
        name,
        sublayers=(Sublayer("attn", "merge_attn", tokens=("hidden_states",), rotary="image_rotary_emb",
                            rotates="cos_sin"),
                   Sublayer("ff", "merge_mlp")),
        downsample=(Downsample("attn", "dispatch"),),
        module="diffusers.",
    )


BLOCK_KINDS: Tuple[BlockKind, ...] = (
    # Flux double-stream blocks: as SD3's, and the rotary rows (cos, sin) [text + image, D] that the
    # processor applies to queries and keys follow the merged image tokens. Outputs (image, text) or,
    # with an IP-Adapter, (image, text, image-length IP output).
    BlockKind(
        "FluxTransformerBlock",
        sublayers=(Sublayer("attn", "merge_attn", tokens=("hidden_states",), outputs=(0, 2),
                            rotary="image_rotary_emb", rotates="cos_sin", rows_optional=True),
                   Sublayer("ff", "merge_mlp")),
        downsample=(Downsample("attn", "dispatch"),),
    ),
    # Flux single-stream blocks join [text, image] inside; norm's output merges (image part), the
    # attention and the MLP run on the merged sequence, proj_out's output unmerges.
    BlockKind(
        "FluxSingleTransformerBlock",
        sublayers=(),
        downsample=(Downsample("attn", "dispatch"),),
        spans=(Span("norm", 0, ("proj_out",), "merge_attn", attention="attn", rotary_at="attn", rotates="cos_sin",
                    attention_call="attn", rows_optional=True),),
    ),
    # Flux.2 double-stream blocks: as Flux's (joint attention over [text, image], rows [text + image, D]).
    BlockKind(
        "Flux2TransformerBlock",
        sublayers=(Sublayer("attn", "merge_attn", tokens=("hidden_states",), outputs=(0,),
                            rotary="image_rotary_emb", rotates="cos_sin", rows_optional=True),
                   Sublayer("ff", "merge_mlp")),
        downsample=(Downsample("attn", "dispatch"),),
    ),
    # Flux.2 single-stream blocks see [text, image] joined; a "parallel" block: one attention module projects
    # q, k, v and the MLP's input together and projects both out together, so norm's output merges (the
    # modulation after it is per sample) and the attention module's output unmerges, inside its forward chain:
    # a step cache on `attn` keeps full tokens as it is. (attention="": no cache seat inside the span, which
    # would unmerge that output a second time; attention_call names the module whose keys are weighed.)
    BlockKind(
        "Flux2SingleTransformerBlock",
        sublayers=(),
        downsample=(Downsample("attn", "dispatch"),),
        spans=(Span("norm", None, ("attn",), "merge_attn", attention="", rotary_at="attn", rotates="cos_sin",
                    attention_call="attn", rows_optional=True),),
    ),
    # Flux.3: per-mode blocks (the image's see its tokens alone; the text's and the reference image's are this class
    # too, left alone by the root kind's skip_blocks), then single blocks over [text, image] joined inside the block;
    # both give `attn` and `ff` one modulated sequence.
    _parallel("Flux3ModeTransformerBlock"), _parallel("Flux3SingleTransformerBlock"),
    # Chroma: Flux's blocks under other class names (its norms are pruned: modulation comes from the root).
    # ChromaPipeline's text mask, [text mask, ones for the image], is squared by each block into (query, key)
    # pairs [B, 1, S, S] for its attention: sliced there, both axes, to the first text + M (layouts/entries.py).
    BlockKind(
        "ChromaTransformerBlock",
        sublayers=(Sublayer("attn", "merge_attn", tokens=("hidden_states",), outputs=(0, 2),
                            rotary="image_rotary_emb", rotates="cos_sin"),
                   Sublayer("ff", "merge_mlp")),
        downsample=(Downsample("attn", "dispatch"),),
        mask="pairs_image_ones_last",
    ),
    BlockKind(
        "ChromaSingleTransformerBlock",
        sublayers=(),
        downsample=(Downsample("attn", "dispatch"),),
        spans=(Span("norm", 0, ("proj_out",), "merge_attn", attention="attn", rotary_at="attn", rotates="cos_sin",
                    attention_call="attn"),),
        mask="pairs_image_ones_last",
    ),
    # Bria, Bria FIBO, LongCat-Image, Ovis-Image (diffusers): Flux's blocks and processors under their own names.
    # Bria FIBO's single blocks get [text, image] joined by the root; its pipeline's text mask reaches every `attn`
    # as [B, 1, 1, text + image], ones over the image (sliced: "image_ones_last"); Ovis-Image's MLPs are gated.
    _flux_double("BriaTransformerBlock"), _flux_single("BriaSingleTransformerBlock"),
    _flux_double("BriaFiboTransformerBlock", "image_ones_last"),
    _flux_single("BriaFiboSingleTransformerBlock", "image_ones_last"),
    _flux_double("LongCatImageTransformerBlock"), _flux_single("LongCatImageSingleTransformerBlock"),
    _flux_double("OvisImageTransformerBlock"), _flux_single("OvisImageSingleTransformerBlock"),
    # Black Forest Labs' layout (ComfyUI, Forge, InvokeAI): Flux's blocks build q, k, v themselves and call
    # attention as a function, with the rotary rows `pe` [B, 1, text + image, ...] as the block's own input.
    # The image stream merges after its norm (the modulation after it is per sample), the attention's output
    # projection and the MLP unmerge; `pe` follows the merged tokens as the block is entered.
    BlockKind(
        "DoubleStreamBlock",
        sublayers=(),
        downsample=(),
        tokens=("img",),
        spans=(Span("img_norm1", None, ("img_attn.proj",), "merge_attn", attention="img_attn", rotary_at="",
                    rotary="pe", rotary_axis=2),
               Span("img_norm2", None, ("img_mlp",), "merge_mlp", attention="img_attn")),
        no_downsample=comfy_rotates_inside("Flux"),
    ),
    # Its single blocks see [text, image] joined: the image part of pre_norm's output merges, linear1 (q, k,
    # v and the MLP's input) and attention run on the merged sequence, linear2's output unmerges.
    BlockKind(
        "SingleStreamBlock",
        sublayers=(),
        downsample=(),
        spans=(Span("pre_norm", None, ("linear2",), "merge_attn", attention="linear1", rotary_at="",
                    rotary="pe", rotary_axis=2),),
        no_downsample=comfy_rotates_inside("Flux"),
    ),
)


ROOT_KINDS: Tuple[RootKind, ...] = (
    # Flux's packed latent has no spatial axes: its `img_ids` rows are (0, row, col).
    RootKind("Flux", ("FluxTransformer2DModel", "FluxControlNetModel"), "ids", suffix=True, ids="img_ids",
             joined_references=("FluxKontextPipeline", "FluxKontextInpaintPipeline"),
             supported="a Flux transformer or ControlNet (torch)"),
    # Flux.2: a packed latent whose img_ids rows are (t=0, row, col, l=0); Flux2Pipeline, Flux2KleinPipeline and
    # Flux2KleinInpaintPipeline join reference (or condition) image tokens after the target's, as Flux Kontext does.
    RootKind("Flux.2", ("Flux2Transformer2DModel",), "ids", ids="img_ids",
             joined_references=("Flux2Pipeline", "Flux2KleinPipeline", "Flux2KleinInpaintPipeline"),
             supported="the Flux.2 transformer (torch)"),
    # Flux.3: a packed latent whose img_ids rows are (t, row, col, l), Flux.2's. Its text and its reference image run
    # through per-mode blocks of the image's class first (skipped: they hold no image token), then single blocks join
    # [text, image, reference]: the reference's tokens pass whole there (CondIds, below).
    RootKind(family="Flux.3", classes=("Flux3Transformer2DModel",), layout="ids_cond", ids="img_ids",
             skip_blocks=("txt_mode_blocks", "mode_blocks.image_cond"),
             supported="the Flux.3 transformer (torch; its reference image's tokens pass whole)"),
    # Chroma: Flux's layout (packed latent, img_ids rows (0, row, col)) under its own class, whose name would
    # otherwise end with "Transformer2DModel" and read as a patchified latent. ChromaPipeline's text mask is sliced
    # by its block kinds ("pairs_image_ones_last").
    RootKind("Chroma", ("ChromaTransformer2DModel",), "ids", ids="img_ids",
             supported="the Chroma transformer (torch)"),
    # Flux's layout under other classes (diffusers): Flux-derived double- and single-stream blocks over a packed
    # latent whose img_ids rows are (modality, row, col). Bria FIBO's pipelines pass a text padding mask whenever
    # the prompts are padded (with guidance, nearly always): sliced by its block kinds ("image_ones_last"); its edit
    # pipeline, and LongCat-Image's (whose ids start at (512, 512), or at the prompt's length when editing), join
    # the reference image's tokens after the target's, their latents returned first by prepare_latents.
    RootKind("Bria", ("BriaTransformer2DModel",), "ids", ids="img_ids", supported="the Bria transformer (torch)"),
    RootKind("Bria FIBO", ("BriaFiboTransformer2DModel",), "ids", ids="img_ids",
             joined_references=("BriaFiboEditPipeline",),
             supported="the Bria FIBO transformer (torch)"),
    RootKind(family="Bria FIBO 2", classes=("BriaFibo2Transformer2DModel",), layout="levels",
             refused=f"a unified sequence [gist, image, context images] with per-token noisy/clean modulation, "
                     f"{NOT_YET} (BriaFiboTransformer2DModel merges); {RUN_WITHOUT}"),
    RootKind("LongCat-Image", ("LongCatImageTransformer2DModel",), "ids", ids="img_ids",
             joined_references=("LongCatImageEditPipeline",), supported="the LongCat-Image transformer (torch)"),
    RootKind("Ovis-Image", ("OvisImageTransformer2DModel",), "ids", ids="img_ids",
             supported="the Ovis-Image transformer (torch)"),
    # ComfyUI's own model code (Black Forest Labs' Flux layout, as in Forge and InvokeAI; Stability's MMDiT;
    # Wan's): each patchifies (and pads) its latent inside, Flux with per-token rotary rows.
    RootKind("Flux (ComfyUI)", ("Flux",), "patchgrid",
             supported="ComfyUI's Flux and Flux.2 (comfy.ldm.flux.model.Flux)"),
    # Forge's own Flux (its backend.nn.flux, under a name that ends as diffusers' does): the same layout, the latent
    # patchified by a fixed 2 inside its forward (no patch_size to read: layout "forge_patchgrid", below).
    RootKind("Flux (Forge)", ("IntegratedFluxTransformer2DModel",), "forge_patchgrid", module="backend.nn.flux",
             supported="Forge's Flux (backend.nn.flux)"),
    # ComfyUI's Chroma: Flux's DoubleStreamBlock / SingleStreamBlock under its own root class (modulations from
    # the root's approximator), the latent patchified inside as Flux's.
    RootKind("Chroma (ComfyUI)", ("Chroma",), "patchgrid",
             supported="ComfyUI's Chroma (comfy.ldm.chroma.model.Chroma; without an attention mask)"),
)


class CondIds(Ids):
    """Flux.3: Flux's ids. An image-to-image call's reference tokens (image_cond_hidden_states) follow the target's in
    its single blocks' input, [image, reference], but not in its image's per-mode blocks, which take the image alone:
    each block's tail is what its input holds beyond the image, passed whole."""

    def image_tokens(self, call: Any, x: Any, index: int = 0) -> Any:
        # Read by the runtime right after this, for this block's merge (runtime.settle: with_tail).
        call.tail = max(0, self.xp.shape(x)[1] - self.xp.shape(call.grid)[0])
        return super().image_tokens(call, x)


def _forge_patchgrid(root: Any, kind: RootKind, xp: Any) -> PatchGrid:
    return PatchGrid(root, kind, xp, 2)


LAYOUTS = {"ids_cond": CondIds, "forge_patchgrid": _forge_patchgrid}
