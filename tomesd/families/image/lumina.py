"""Lumina 2 and Z-Image: main layers over one unified sequence joining each sample's image, text and padding (layout
"unified": where each container's blocks see the image is RootKind.sequence), on diffusers; ComfyUI's NextDiT runs
both (layout "comfy_nextdit": the image placed by shapes, [image, pad] or [caption, image, pad]). Z-Image's ControlNet
is refused by name.

The "comfy_nextdit" layout: ComfyUI's NextDiT (Lumina 2 and Z-Image, comfy.ldm.lumina.model), a unified sequence
as diffusers' (layouts/unified.py) but joined another way. NextDiT patchifies a latent [B, C, H, W] (padded to whole
patches) into N image tokens and, where the model has `pad_tokens_multiple` (Z-Image: 32), appends pad tokens up to
a multiple of it; the caption (padded likewise) is refined apart by the context refiner, whose blocks see the text
alone and are left out by the root kind (RootKind.skip_blocks). The noise refiner's blocks see [image, pad]; the
main layers see [caption, image, pad], the caption as long for every sample (ComfyUI joins them unmasked). So the
image starts at 0 in the noise refiner and, in the main layers, N + pad tokens before the end: a place the shapes
give, read on the host from shapes only. The image's tokens are matched on its (rows, cols) grid; the caption before
them and the pad tokens after pass whole (TokenMerge.with_passing_head / with_passing_tail), each its own row."""
from __future__ import annotations

from typing import Any, Tuple

from ...layouts.entries import BlockKind, RootKind, Sublayer, UnifiedSequence
from ...layouts.grids import cells_of
from ...layouts.sequences import with_head, with_tail
from ...layouts.unified import Unified
_NO_DOWNSAMPLE = ("its sequence joins the image with text and padding under a key-padding mask, and no seam takes "
                  "the image's keys alone; use mode='merge'")
_NO_WEIGHTS = ("its attention is given a key-padding mask, which the weighing of merged keys cannot join; use "
               "proportional_attention=False")

NEXTDIT_MODULE = "comfy.ldm.lumina."


BLOCK_KINDS: Tuple[BlockKind, ...] = (
    # Z-Image: self-attention over the whole sequence (given positionally), its queries and keys rotated by complex
    # rows [B, S, D/2] (a batch axis: they follow each sample) inside the processor, a [B, S] mask when samples'
    # lengths differ; the feed-forward sees every token. The AdaLN scales and gates are per sample (per token in
    # omni mode, which the layout refuses) and applied outside these sub-layers.
    BlockKind(
        "ZImageTransformerBlock",
        sublayers=(Sublayer("attention", "merge_attn", tokens=("hidden_states",), rotary="freqs_cis", rotary_axis=1),
                   Sublayer("feed_forward", "merge_mlp", tokens=("x",))),
        downsample=(),
        no_downsample=_NO_DOWNSAMPLE,
        no_weights=_NO_WEIGHTS,
        mask="tokens",
        module="diffusers.",
    ),
    # Lumina 2: self-attention given the normed tokens as hidden_states and again as encoder_hidden_states (both
    # merge), rows [B, S, D/2] complex, a [B, S] mask when the prompts' lengths differ; the feed-forward.
    BlockKind(
        "Lumina2TransformerBlock",
        sublayers=(Sublayer("attn", "merge_attn", tokens=("hidden_states",), rotary="image_rotary_emb",
                            rotary_axis=1, also=("encoder_hidden_states",)),
                   Sublayer("feed_forward", "merge_mlp", tokens=("x",))),
        downsample=(),
        no_downsample=_NO_DOWNSAMPLE,
        no_weights=_NO_WEIGHTS,
        mask="tokens",
        module="diffusers.",
    ),
    # NextDiT's JointTransformerBlock(x, x_mask, freqs_cis, adaln_input): its attention takes the normed, per-sample
    # modulated tokens, the mask and the rotary rows [B, S, 1, D/2, 2, 2] (a batch axis: they follow each sample)
    # by position, projects q, k, v with one fused `qkv` and rotates them inside; the feed-forward sees every token.
    # In the main layers and the noise refiner the mask `x_mask` is None (ComfyUI 0.3.75 masks the context refiner
    # only, which is left out).
    BlockKind(
        "JointTransformerBlock",
        sublayers=(Sublayer("attention", "merge_attn", tokens=("x",), rotary="freqs_cis", rotary_axis=1),
                   Sublayer("feed_forward", "merge_mlp", tokens=("x",))),
        downsample=(),
        tokens=("x",),
        no_downsample=(
            "NextDiT here (ComfyUI's Lumina 2 / Z-Image) projects queries, keys and values with one fused layer (qkv) "
            "and rotates them inside its attention, so no seam takes the image's keys alone; use mode='merge'"),
        module=NEXTDIT_MODULE,
    ),
)


ROOT_KINDS: Tuple[RootKind, ...] = (
    # Unified sequences (layouts/unified.py): the main layers run on one sequence joining each sample's image and
    # text with padding and a key-padding mask. Z-Image: per-sample latents (a list) whose image comes first;
    # Lumina 2: each sample's image after its own text. Image tokens merge; text and padding pass whole.
    RootKind("Z-Image", ("ZImageTransformer2DModel",), "unified", module="diffusers.",
             sequence=UnifiedSequence("list", {"layers": "first", "noise_refiner": "first", "context_refiner": "",
                                               "siglip_refiner": ""}),
             supported="the Z-Image transformer (torch; not its omni mode)"),
    # Z-Image's ControlNet shares the transformer's refiners (from_transformer) and runs its control layers on a
    # unified sequence of its own; the transformer takes its residuals whole between its main layers.
    RootKind("Z-Image ControlNet", ("ZImageControlNetModel",), "unified", module="diffusers.",
             refused="a ControlNet whose control layers (ZImageControlTransformerBlock) run on a unified sequence of "
                     "their own, which ToMe does not merge yet; apply_patch(pipe.transformer) merges the transformer "
                     "alone, whose main layers take the ControlNet's residuals whole"),
    RootKind("Lumina 2", ("Lumina2Transformer2DModel",), "unified", module="diffusers.",
             sequence=UnifiedSequence("latent", {"layers": "after_text", "noise_refiner": "first",
                                                 "context_refiner": ""}, text_mask="encoder_attention_mask"),
             supported="the Lumina 2 transformer (torch)"),
    # ComfyUI's NextDiT (Lumina 2, Z-Image): [caption, image, pad] in its main layers, [image, pad] in its noise
    # refiner (ComfyNextDiT, below); its context refiner's blocks see the caption alone and are left out.
    RootKind("Lumina 2 / Z-Image (ComfyUI)", ("NextDiT",), "comfy_nextdit", module="comfy.",
             skip_blocks=("context_refiner",),
             # the image first ([image, pad]) in the noise refiner, before its pad tokens at the end ([caption,
             # image, pad]) in the main layers; the context refiner's blocks are not among the patch's
             sequence=UnifiedSequence("latent", {"noise_refiner": "first", "layers": "before_pad"}),
             supported="ComfyUI's Lumina 2 and Z-Image (comfy.ldm.lumina.model.NextDiT)"),
)


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
        call.grid = (1, cells_of(shape[2], self.patch), cells_of(shape[3], self.patch))  # padded to whole patches

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



LAYOUTS = {"comfy_nextdit": ComfyNextDiT}
