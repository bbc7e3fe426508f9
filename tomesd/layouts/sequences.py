"""Tokens a layout passes whole around the image's merge (a head before the target's tokens, a tail after them), and
the refusal of a sequence split by an engine whose split ToMe cannot read."""
from __future__ import annotations

from typing import Any


def with_tail(merge: Any, tail: int) -> Any:
    """A block's merge (one, or one per site) extended over `tail` reference tokens that pass whole."""
    if not tail or merge is None:
        return merge
    if isinstance(merge, dict):
        return {flag: m.with_passing_tail(tail) for flag, m in merge.items()}
    return merge.with_passing_tail(tail)


def with_head(merge: Any, head: int) -> Any:
    """A block's merge (one, or one per site) extended over `head` condition tokens before the target's that pass
    whole (layouts/image_first.py: Framepack's history latents)."""
    if not head or merge is None:
        return merge
    if isinstance(merge, dict):
        return {flag: m.with_passing_head(head) for flag, m in merge.items()}
    return merge.with_passing_head(head)


def split_sequence(model: str, held: int, whole: int) -> ValueError:
    """A block holding a share of the call's image tokens, split by an engine whose split ToMe does not read."""
    return ValueError(
        f"a block of {model} holds {held} of the call's {whole} image tokens: the sequence was split across "
        f"processes by an engine whose split ToMe cannot read (xDiT, ParaAttention), so it cannot tell which tokens "
        f"this process holds. ToMe merges within each rank's band under diffusers' "
        f"enable_parallelism(ContextParallelConfig(...)) and cache-dit's ParallelismConfig: run {model} there, or "
        f"remove_patch under this engine"
    )
