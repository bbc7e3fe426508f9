"""Wan 2.1 / 2.2 and the families built on its block: SkyReels-V2, ChronoEdit, Wan VACE, Wan Animate, AnyFlow
(bidirectional) and Helios (history tokens before the target's: layout "history", History here); ComfyUI's Wan (and
Wan's own code). Every frame's tokens in one sequence (layout "spacetime"). Wan Animate 2 and AnyFlow FAR are refused
by name."""
from __future__ import annotations

from typing import Any, Tuple

from ...layouts.coordinates import SpaceTime
from ...layouts.entries import (NOT_YET, RUN_WITHOUT, BlockKind, Downsample, RootKind, Sublayer,
                               comfy_rotates_inside)
from ...layouts.grids import spacetime_patch


BLOCK_KINDS: Tuple[BlockKind, ...] = (
    # Wan 2.1 / 2.2: self-attention over every frame's image tokens, its rotary rows [1, S, 1, D] (frame,
    # row and column positions) applied inside the processor; cross-attention to the text (and, for
    # image-to-video, the image embedding); the feed-forward. The block calls them positionally.
    BlockKind(
        "WanTransformerBlock",
        sublayers=(Sublayer("attn1", "merge_attn", tokens=("hidden_states",), rotary="rotary_emb", rotary_axis=1),
                   Sublayer("attn2", "merge_crossattn", tokens=("hidden_states",)),
                   Sublayer("ffn", "merge_mlp")),
        downsample=(Downsample("attn1", "dispatch"),),
    ),
    BlockKind(  # SkyReels-V2: Wan's block; its self-attention takes the mask and rotary rows by position
        "SkyReelsV2TransformerBlock",
        sublayers=(Sublayer("attn1", "merge_attn", tokens=("hidden_states",), rotary="rotary_emb", rotary_axis=1),
                   Sublayer("attn2", "merge_crossattn", tokens=("hidden_states",)),
                   Sublayer("ffn", "merge_mlp")),
        downsample=(Downsample("attn1", "dispatch"),),
    ),
    # AnyFlow (bidirectional): Wan's block, its self-attention's rotary rows a dict {"query": rows, "key": rows} of
    # complex tables [1, 1, S, D/2] (a batch axis: they follow each sample) applied on [B, heads, S, D] before the
    # dispatch; cross-attention to the text (and image embedding); the feed-forward. (AnyFlow FAR's block of this
    # name sits under a root refused below.)
    BlockKind(
        "AnyFlowTransformerBlock",
        sublayers=(Sublayer("attn1", "merge_attn", tokens=("hidden_states",), rotary="rotary_emb", rotary_axis=2),
                   Sublayer("attn2", "merge_crossattn", tokens=("hidden_states",)),
                   Sublayer("ffn", "merge_mlp")),
        downsample=(Downsample("attn1", "dispatch"),),
        module="diffusers.",
    ),
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
    # Wan in ComfyUI (and Wan's own code): as diffusers' Wan block, its rotary rows `freqs` [B, image, 1, ...]
    # passed to the self-attention by position.
    BlockKind(
        "WanAttentionBlock",
        sublayers=(Sublayer("self_attn", "merge_attn", tokens=("x",), rotary="freqs", rotary_axis=1),
                   Sublayer("cross_attn", "merge_crossattn", tokens=("x",)),
                   Sublayer("ffn", "merge_mlp")),
        downsample=(),
        tokens=("x",),
        no_downsample=comfy_rotates_inside("Wan"),
    ),
)


ROOT_KINDS: Tuple[RootKind, ...] = (
    # Video transformers: every frame's tokens in one sequence, frames outermost. Wan [B, C, F, H, W],
    # CogVideoX [B, F, C, H, W].
    RootKind("Wan", ("WanTransformer3DModel",), "spacetime", frame_axis=2,
             supported="the Wan video transformer (torch)"),
    RootKind("SkyReels-V2", ("SkyReelsV2Transformer3DModel",), "spacetime", frame_axis=2,
             supported="the SkyReels-V2 video transformer (torch)"),
    RootKind("ChronoEdit", ("ChronoEditTransformer3DModel",), "spacetime", frame_axis=2,
             supported="the ChronoEdit video transformer (torch)"),
    # Wan VACE: Wan's blocks merge; its VACE blocks (another class) carry the control video's tokens whole.
    RootKind("Wan VACE", ("WanVACETransformer3DModel",), "spacetime", frame_axis=2,
             supported="the Wan VACE video transformer (torch; its control tokens never merge)"),
    # Wan 2.2 Animate: Wan's blocks. Its pose latents are added to the target's tokens before the blocks and its
    # face features enter through face adapters between blocks (keys of their own cross-attention, on every
    # token), so no condition token joins the blocks' sequence: only the target's merge.
    RootKind("Wan Animate", ("WanAnimateTransformer3DModel",), "spacetime", frame_axis=2,
             supported="the Wan Animate video transformer (torch; its pose and face conditions never merge)"),
    RootKind(family="Wan Animate 2", classes=("WanAnimate2Transformer3DModel",), layout="levels",
             refused=f"a transformer over per-sample token lists whose self-attention packs each frame's tokens "
                     f"against a reference key/value cache under a flex block mask, {NOT_YET} "
                     f"(WanAnimateTransformer3DModel merges); {RUN_WITHOUT}"),
    # AnyFlow (bidirectional): Wan's layout on a latent [B, F, C, H, W] (permuted to Wan's inside), Wan's blocks under
    # its own class (above); its timestep and modulations may be per frame, outside ToMe's sites.
    RootKind(family="AnyFlow", classes=("AnyFlowTransformer3DModel",), layout="spacetime", frame_axis=1,
             supported="the AnyFlow video transformer (torch)"),
    RootKind(family="AnyFlow FAR", classes=("AnyFlowFARTransformer3DModel",), layout="levels",
             refused=f"a causal video transformer whose attention runs under a key/value cache of earlier frames and "
                     f"a flex block mask, {NOT_YET} (AnyFlowTransformer3DModel, its bidirectional model, merges); "
                     f"{RUN_WITHOUT}"),
    # Helios: Wan's layout and blocks under its own classes; its history latents' tokens (long, mid, short) are joined
    # before the target's: the target's are the last N and merge, the history's pass whole (History, below).
    # Built with is_amplify_history=True, refused at apply time.
    RootKind(family="Helios", classes=("HeliosTransformer3DModel",), layout="history", frame_axis=2,
             supported="the Helios video transformer (torch; its history tokens pass whole)"),
    RootKind("Wan (ComfyUI)", ("WanModel",), "spacetime", frame_axis=2, supported="ComfyUI's Wan (comfy.ldm.wan.model.WanModel)"),
)


class History(SpaceTime):
    """Helios: Wan's space-time grid over its latent [B, C, F, H, W]; its history latents' tokens (long, mid, short)
    precede the target's in every block's sequence, so the target's are the last N, as the coordinate layouts read
    them, and the history passes whole."""

    def __init__(self, root: Any, kind: RootKind, xp: Any) -> None:
        super().__init__(root, kind, xp, kind.frame_axis, spacetime_patch(root) or (1, 1, 1))
        self.amplified = bool(getattr(getattr(root, "config", None), "is_amplify_history", False))

    def validate(self, patch: Any) -> None:
        # Its self-attention then scales the first (sequence - original_context_length) keys as history's: with the
        # target's tokens merged that count would reach into the history, scaling too few.
        if self.amplified:
            raise ValueError(
                f"ToMe cannot merge {self.model} built with is_amplify_history=True: its attention finds the history's "
                f"keys by the target's unmerged length (original_context_length); run it without ToMe")


LAYOUTS = {"history": History}
