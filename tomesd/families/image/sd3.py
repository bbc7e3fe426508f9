"""SD3 / SD3.5 and MMDiT's kin: diffusers' JointTransformerBlock (joint attention over [image, text]) and its
ControlNet's image-only blocks, ComfyUI's MMDiT (Stability's reference code: JointBlock pairs), and AuraFlow's MMDiT
blocks. diffusers' SD3 transformer is read by dit.py's suffix rule ("diffusion transformer", layout "patches")."""
from __future__ import annotations

from typing import Tuple

from ...layouts.entries import BlockKind, Downsample, RootKind, Span, Sublayer


BLOCK_KINDS: Tuple[BlockKind, ...] = (
    # SD3 / SD3.5: `attn` is joint attention over [image, text], given the image as `hidden_states`
    # and the text as `encoder_hidden_states`; it returns (image, text). SD3.5's `attn2` is
    # image-only self-attention. Text tokens never pass through a hooked input.
    BlockKind(
        "JointTransformerBlock",
        sublayers=(Sublayer("attn", "merge_attn", tokens=("hidden_states",), outputs=(0,), image_keys_first=True),
                   Sublayer("attn2", "merge_attn", tokens=("hidden_states",)),
                   Sublayer("ff", "merge_mlp")),
        downsample=(Downsample("attn", "projections"), Downsample("attn2", "projections")),
    ),
    # SD3.5 ControlNets' image-only blocks (SD3ControlNetModel without joint_attention_dim): SD3's joint
    # processor with no text, so `attn` is plain self-attention returning the image alone.
    BlockKind(
        "SD3SingleTransformerBlock",
        sublayers=(Sublayer("attn", "merge_attn", tokens=("hidden_states",)), Sublayer("ff", "merge_mlp")),
        downsample=(Downsample("attn", "projections"),),
    ),
    # SD3's MMDiT in ComfyUI (and Stability's reference code): a JointBlock(context, x) pairs a text and an
    # image DismantledBlock whose q, k, v come from one fused `qkv` and meet in a function. The image's
    # norm1 output merges (SD3.5's second self-attention `attn2` takes it too), both attentions' `proj` and
    # the MLP unmerge. The text block is never hooked.
    BlockKind(
        "JointBlock",
        sublayers=(),
        downsample=(),
        tokens=("x",),
        token_position=1,
        spans=(Span("x_block.norm1", None, ("x_block.attn.proj", "x_block.attn2.proj"), "merge_attn",
                    attention="x_block.attn"),
               Span("x_block.norm2", None, ("x_block.mlp",), "merge_mlp", attention="x_block.attn")),
        no_downsample=(
            "SD3's MMDiT (ComfyUI) projects queries, keys and values with one fused layer (qkv), so keys and "
            "values cannot take other tokens than queries; use mode='merge'"),
    ),
    # AuraFlow's MMDiT blocks: joint attention over [text, image] given the image as hidden_states, returning
    # (image, text); image keys and values come from to_k / to_v alone (text's from add_k_proj / add_v_proj).
    BlockKind(
        "AuraFlowJointTransformerBlock",
        sublayers=(Sublayer("attn", "merge_attn", tokens=("hidden_states",), outputs=(0,)),
                   Sublayer("ff", "merge_mlp")),
        downsample=(Downsample("attn", "projections"),),
    ),
    # AuraFlow's single blocks see [text, image] joined: attention and feed-forward merge its last N tokens.
    BlockKind(
        "AuraFlowSingleTransformerBlock",
        sublayers=(Sublayer("attn", "merge_attn", tokens=("hidden_states",)), Sublayer("ff", "merge_mlp")),
        downsample=(),
        no_downsample=(
            "AuraFlow's single blocks project keys and values of [text, image] joined with one to_k / to_v and "
            "call torch's attention itself, so no seam takes image keys alone; use mode='merge'"),
    ),
)


ROOT_KINDS: Tuple[RootKind, ...] = (
    RootKind("SD3 (ComfyUI)", ("MMDiT",), "patches", supported="ComfyUI's SD3 / SD3.5 MMDiT"),
    # Patchified latents [B, C, H, W] whose blocks see [text, image] joined (AuraFlow's single blocks) or whose
    # rotary rows [image, D] are applied inside processors that do not dispatch (CogView4, HunyuanDiT): the
    # image is the last N tokens, matched once for the batch where rotary rows cannot follow each sample.
    RootKind("AuraFlow", ("AuraFlowTransformer2DModel",), "patchgrid", supported="the AuraFlow transformer (torch)"),
)
