"""Block kinds of diffusers 0.42's later denoisers (roots_diffusers_0_42.py): JoyImage Edit's double-stream block, Krea 2's
single-stream block, Flux.3's per-mode and single blocks, Helios', NucleusMoE-Image's and AnyFlow's blocks."""
from __future__ import annotations

from typing import Tuple

from .kind_types import BlockKind, Downsample, Sublayer


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


DIFFUSERS_0_42_KINDS: Tuple[BlockKind, ...] = (
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
    # Krea 2: one stream, [text, image] joined by the root. Its gated attention rotates queries and keys by rows
    # (cos, sin) [text + image, D] with diffusers' apply_rotary_emb on [B, S, heads, D] and calls the dispatch
    # (per-sample rows there, keys shrinkable there: the image's last); its SwiGLU sees the joined sequence too. Its
    # pipeline's text mask reaches the attention as the root's [B, 1, 1, text + image], ones over the image: sliced
    # to the merged image's keys (the first text + M entries: every image entry is True, so the slice is exact).
    BlockKind(
        "Krea2TransformerBlock",
        sublayers=(Sublayer("attn", "merge_attn", tokens=("hidden_states",), rotary="image_rotary_emb",
                            rotates="cos_sin"),
                   Sublayer("ff", "merge_mlp", tokens=("hidden_states",))),
        downsample=(Downsample("attn", "dispatch"),),
        mask="image_ones_last",
        module="diffusers.",
    ),
    # Flux.3: per-mode blocks (the image's see its tokens alone; the text's and the reference image's are this class
    # too, left alone by the root kind's skip_blocks), then single blocks over [text, image] joined inside the block;
    # both give `attn` and `ff` one modulated sequence.
    _parallel("Flux3ModeTransformerBlock"), _parallel("Flux3SingleTransformerBlock"),
    # Helios: Wan's block over [history, target] (the target last): self-attention rotating queries and keys by rows
    # [B, S, D] (a batch axis: they follow each sample) before the dispatch, given positionally; cross-attention to
    # the text, of the target's tokens alone (guidance_cross_attn) or of all; the feed-forward.
    BlockKind(
        "HeliosTransformerBlock",
        sublayers=(Sublayer("attn1", "merge_attn", tokens=("hidden_states",), rotary="rotary_emb", rotary_axis=1),
                   Sublayer("attn2", "merge_crossattn", tokens=("hidden_states",)),
                   Sublayer("ffn", "merge_mlp")),
        downsample=(Downsample("attn1", "dispatch"),),
        module="diffusers.",
    ),
    # NucleusMoE-Image: the image's queries attend to keys and values [image, text] (the text's projected in the same
    # attention, or cached), the image's rotated by complex rows [image, D/2] (item 0 of (image rows, text rows); no
    # batch axis: one matching serves the batch). Its MLP is not a site: the mixture-of-experts layers take the
    # modulated and the unmodulated tokens as two inputs. Its pipeline always passes a text mask, which the root
    # joins as [image (all True), text] over those keys: sliced to the merged image's keys (key_masks.MaskSlice).
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
    # AnyFlow (bidirectional): Wan's block, its self-attention's rotary rows a dict {"query": rows, "key": rows} of
    # complex tables [1, 1, S, D/2] (a batch axis: they follow each sample) applied on [B, heads, S, D] before the
    # dispatch; cross-attention to the text (and image embedding); the feed-forward. (AnyFlow FAR's block of this
    # name sits under a root refused in roots_diffusers_0_42.py.)
    BlockKind(
        "AnyFlowTransformerBlock",
        sublayers=(Sublayer("attn1", "merge_attn", tokens=("hidden_states",), rotary="rotary_emb", rotary_axis=2),
                   Sublayer("attn2", "merge_crossattn", tokens=("hidden_states",)),
                   Sublayer("ffn", "merge_mlp")),
        downsample=(Downsample("attn1", "dispatch"),),
        module="diffusers.",
    ),
)
