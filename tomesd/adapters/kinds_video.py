"""Block kinds of diffusers' video transformers whose blocks see every frame's tokens in one sequence (roots.py:
layout "spacetime"), added from diffusers 0.42 by table entries: ConsisID, Cosmos, EasyAnimate, Sana-Video; and those
over a packed latent whose grid comes from the root's arguments (layout "packed", layouts_packed.py): LTX-Video,
Qwen-Image; and those whose attention mask is the text's (BlockKind.mask): Mochi, HunyuanVideo 1.5. (Wan's,
CogVideoX's and SkyReels-V2's are in kinds.py; Wan Animate runs Wan's block.)"""
from __future__ import annotations

from typing import Tuple

from .kind_types import BlockKind, Downsample, Sublayer
from .kinds_ltx2 import LTX2_KINDS

VIDEO_KINDS: Tuple[BlockKind, ...] = (
    # ConsisID: CogVideoX's block under another class name (joint attention over [text, image] returning
    # (image, text), image rows [image, D]; the feed-forward sees [text, image] joined).
    BlockKind(
        "ConsisIDBlock",
        sublayers=(Sublayer("attn1", "merge_attn", tokens=("hidden_states",), outputs=(0,),
                            rotary="image_rotary_emb"),
                   Sublayer("ff", "merge_mlp")),
        downsample=(),
        no_downsample=(
            "ConsisID's attention processor (CogVideoX's) joins text and image tokens before projecting keys and "
            "values (and rotates the image keys after), so no seam takes image keys alone; use mode='merge'"),
    ),
    # Cosmos: image self-attention rotating queries and keys by rows (cos, sin) [image, D] (halves rotated, on
    # [B, heads, S, D]: not the dispatch's interleaved "cos_sin", so matched once for the batch) before
    # diffusers' dispatch; cross-attention to the text (Cosmos 2.5: and image context); the feed-forward. The
    # AdaLN modulations around them may be per token (a per-frame timestep); they stay outside the sites.
    BlockKind(
        "CosmosTransformerBlock",
        sublayers=(Sublayer("attn1", "merge_attn", tokens=("hidden_states",), rotary="image_rotary_emb"),
                   Sublayer("attn2", "merge_crossattn", tokens=("hidden_states",)),
                   Sublayer("ff", "merge_mlp")),
        downsample=(Downsample("attn1", "dispatch"),),
    ),
    # EasyAnimate: joint attention over [text, image] given the image as hidden_states, returning (image, text),
    # its image queries and keys rotated by rows [image, D] inside the processor, which calls torch's attention
    # itself. Its feed-forward is not a site: a block built without a text feed-forward (past mmdit_layers) runs
    # `ff` on the image and then on the text.
    BlockKind(
        "EasyAnimateTransformerBlock",
        sublayers=(Sublayer("attn1", "merge_attn", tokens=("hidden_states",), outputs=(0,),
                            rotary="image_rotary_emb"),),
        downsample=(),
        no_downsample=(
            "EasyAnimate's processor rotates the image keys after projecting them and calls torch's attention "
            "itself, so no seam takes the rotated keys; use mode='merge'"),
    ),
    # Sana-Video: linear self-attention over every frame's image tokens, rotated by Wan's rows [1, S, 1, D];
    # cross-attention to the text. Its feed-forward (GLUMBTempConv) convolves the (frames, rows, columns) grid,
    # so it is not a merge site.
    BlockKind(
        "SanaVideoTransformerBlock",
        sublayers=(Sublayer("attn1", "merge_attn", tokens=("hidden_states",), rotary="rotary_emb", rotary_axis=1),
                   Sublayer("attn2", "merge_crossattn", tokens=("hidden_states",))),
        downsample=(),
        no_downsample=(
            "Sana-Video's linear self-attention rotates its keys by every image token's rotary row, so keys "
            "cannot come from the downsampled grid; use mode='merge'"),
        no_weights=("Sana-Video's self-attention is linear attention (ReLU kernels, no softmax), so there are no "
                    "scores for a merged key's weight; apply_patch with proportional_attention=False"),
    ),
    # LTX-Video: self-attention over every frame's tokens, its queries and keys rotated by rows (cos, sin) [B, S, D]
    # (a batch axis: they follow each sample); cross-attention to the text (given the tokens by position); the
    # feed-forward. The AdaLN modulations (per token where LTX 0.9.5+'s pipelines give a timestep per token) and
    # gates are applied to the block's own tensors around these sub-layers, on every token, never inside them.
    BlockKind(
        "LTXVideoTransformerBlock",
        sublayers=(Sublayer("attn1", "merge_attn", tokens=("hidden_states",), rotary="image_rotary_emb",
                            rotary_axis=1),
                   Sublayer("attn2", "merge_crossattn", tokens=("hidden_states",)),
                   Sublayer("ff", "merge_mlp")),
        downsample=(Downsample("attn1", "dispatch"),),
    ),
    # Qwen-Image (diffusers): a double-stream block whose image stream is its own input. Its `attn` projects image
    # and text apart, rotates them by (image rows [S, D/2] complex, text rows), joins [text, image] for diffusers'
    # dispatch and returns (image, text): the image merges around it and its rows (item 0) follow; `img_mlp` sees
    # the image alone. The text's modules are never hooked. The image's rows have no batch axis and are applied as
    # complex numbers (no way the dispatch seam rotates per sample), so one matching serves the batch. (ComfyUI's
    # class of this name: kinds_comfy.py.)
    BlockKind(
        "QwenImageTransformerBlock",
        sublayers=(Sublayer("attn", "merge_attn", tokens=("hidden_states",), outputs=(0,), rotary="image_rotary_emb",
                            rotary_item=0),
                   Sublayer("img_mlp", "merge_mlp", tokens=("hidden_states",))),
        downsample=(Downsample("attn", "dispatch"),),  # rotated keys [text, image] at the dispatch: image last
        module="diffusers.",
    ),
    # Mochi: image and text enter the block apart; the joint attention rotates the image's queries and keys by rows
    # (cos, sin) [image, heads, D/2] with its own function (no dispatch: one matching serves the batch), then per
    # sample joins [image, the text its mask keeps]; the image's length comes from the queries it is given.
    BlockKind(
        "MochiTransformerBlock",
        sublayers=(Sublayer("attn1", "merge_attn", tokens=("hidden_states",), outputs=(0,), rotary="image_rotary_emb"),
                   Sublayer("ff", "merge_mlp")),
        downsample=(),
        no_downsample="Mochi's processor projects the image's keys with its queries and joins the text per sample "
                      "inside, so no seam takes image keys alone; use mode='merge'",
        no_weights="Mochi's processor calls torch's attention once per sample on a joined sequence it cuts by the "
                   "mask; use proportional_attention=False",
        mask="text",
    ),
    # HunyuanVideo 1.5 (diffusers): image and text enter the block apart; the joint attention rotates the image's
    # queries and keys by rows (cos, sin) [image, D], then joins [image, text] for the dispatch. Its mask is the
    # text's only, padded with True to the joined length inside the processor, so it fits merged image tokens.
    BlockKind(
        "HunyuanVideo15TransformerBlock",
        sublayers=(Sublayer("attn", "merge_attn", tokens=("hidden_states",), outputs=(0,), rotary="image_rotary_emb",
                            rotates="cos_sin", image_keys_first=True),
                   Sublayer("ff", "merge_mlp")),
        downsample=(),
        no_downsample="its processor pads the text's mask to the queries' length, so keys shorter than the queries "
                      "would not fit it; use mode='merge'",
        no_weights="its processor always gives torch's attention a mask (the text's, padded), which the weighing of "
                   "merged keys cannot join; use proportional_attention=False",
        mask="text",
    ),
) + LTX2_KINDS  # LTX-2's audio and video block (kinds_ltx2.py)
