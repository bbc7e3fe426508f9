"""Proportional attention's hooks: a merged key weighs as the tokens it holds (ToMe for ViTs).

Where a self- or joint attention runs on merged image tokens, its hook arms the host's SDPA seam
(`host.key_weight_seam()`, backends/torch_sdpa.py) with the log of each merged row's token count before the
attention's own forward, and checks after it that the attention's one call of scaled_dot_product_attention took
them: an attention computed another way (its own softmax, xformers, a flash-attn backend) would run unweighted
while the user asked for weights, so it is refused by name, with the setting that works.
"""
from __future__ import annotations

from typing import Any

from ..layouts.entries import Span


def weighs(patch: Any, flag: str) -> bool:
    """Whether the site `flag` turns on weighs its keys: proportional attention on, and the site's keys are image
    tokens (self- or joint attention; cross-attention's keys are text)."""
    return patch.args.mode == "merge" and bool(patch.args.proportional_attention) and flag == "merge_attn"


def open_key_seam(patch: Any) -> None:
    if patch.key_seam is None:  # each host has one: torch_sdpa.py, paddle_sdpa.py
        patch.key_seam = patch.host.key_weight_seam()
        patch.key_seam.open(patch)


def weigh_at_dispatch_where_all_dispatch(patch: Any) -> None:
    """At install: where every weighed attention's processor calls diffusers' attention dispatch (Flux, Wan and the
    other dispatching transformers), the weights join the queries, keys and values there, before the backend runs
    (torch_sdpa.KeyWeights.around), so every kernel of the dispatcher takes them: native SDPA, flex, flash, sage,
    xformers (a head one channel wider, padded to the multiple of 8 CUDA's kernels take). Elsewhere (the UNets'
    and SD3's processors call torch's SDPA themselves) the SDPA seam stays."""
    dispatches = getattr(patch.host, "dispatches", None)
    # (restored tokens in downsample mode run the backend twice inside one dispatch call, arming the weights there)
    if patch.key_seam is None or dispatches is None or (patch.downsampling and patch.args.restore_tokens):
        return
    for block, kind in zip(patch.blocks, patch.kinds):
        attention = getattr(block, kind.self_attention or "", None)
        if attention is None or not dispatches(getattr(attention, "processor", None)):
            return
    _weigh_at(patch, patch.host.attention_seam())


def _weigh_at(patch: Any, seam: Any) -> None:
    """The patch's key weights move to `seam` (diffusers' attention dispatch)."""
    if patch.key_seam is not seam:
        patch.key_seam.close(patch)
        patch.key_seam = seam
        seam.open(patch)


def weigh_at_dispatch(patch: Any) -> None:
    """Under context parallelism (found at the first call) the attention's keys are exchanged between ranks inside
    diffusers' attention dispatch, so an SDPA call would meet keys whose sizes other ranks hold: the weights join
    the keys at the dispatch instead, before the exchange (torch_sdpa.KeyWeights.around). Every weighed attention
    must go through the dispatch; one that does not is refused by name."""
    seam = patch.host.attention_seam()
    if patch.key_seam is seam:
        return
    for block, kind in zip(patch.blocks, patch.kinds):
        attention = getattr(block, kind.self_attention or "", None)
        processor = getattr(attention, "processor", None)
        if attention is not None and not patch.host.dispatches(processor):
            raise ValueError(
                f"proportional_attention under context parallelism weighs merged keys at diffusers' attention "
                f"dispatch, before the ranks exchange them, and {type(processor).__name__} of "
                f"{type(block).__name__} does not call it; use a processor that calls dispatch_attention_fn, or "
                f"apply_patch with proportional_attention=False")
    _weigh_at(patch, seam)


def arm(patch: Any, merge: Any, image_keys_first: bool, uses: int = 1) -> None:
    """The next `uses` SDPA calls weigh the merged keys of `merge` (each merged row's size, from its inverse count)."""
    weights = patch.host.key_weights(merge.inv_counts, image_keys_first, getattr(merge, "uniform", False))
    patch.key_seam.arm(weights, uses)


def check_weighed(patch: Any, where: Any) -> None:
    if not patch.key_seam.disarm():
        processor = getattr(where, "processor", None)
        how = f"its processor {type(processor).__name__}" if processor is not None else "it"
        seam = patch.key_seam
        raise RuntimeError(
            f"ToMe's proportional attention weighs merged keys in {seam.weighs_in}, but {type(where).__name__} ran "
            f"on merged tokens and {how} made no call of it ({seam.bypasses}); turn proportional_attention off, or "
            f"{seam.remedy}")


class WeighSpanKeys:
    """A span's attention (kinds.Span) weighs its keys: armed around the module whose forward calls it
    (`attention_call`), or from the span's start to its first end where attention is a function: one attention
    per end (ComfyUI's SD3.5 block computes its joint and its image self-attention before either output
    projection)."""

    def __init__(self, patch: Any, index: int, span: Span, uses: int = 1) -> None:
        self.patch, self.index, self.span, self.uses = patch, index, span, uses

    def pre(self, module: Any, *_: Any) -> None:
        merge = self.patch.site_merge(self.index, self.span.flag)
        if merge is not None:
            arm(self.patch, merge, self.span.image_first, self.uses)  # the image's keys first: HunyuanVideo's (ComfyUI)

    def post(self, module: Any, *_: Any) -> None:
        if self.patch.site_merge(self.index, self.span.flag) is not None:
            check_weighed(self.patch, module if self.span.attention_call is not None else self.patch.blocks[self.index])
