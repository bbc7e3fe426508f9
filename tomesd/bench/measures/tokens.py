"""How many tokens reach self-attention: shared by the benchmark and `python -m tomesd demo`."""
from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List, Tuple


@contextlib.contextmanager
def token_counter(model: Any, backend: str) -> Iterator[List[Tuple[str, int]]]:
    """(block name, tokens) self-attention attends over (its keys), per call, in call order. Counted
    at the self-attention's to_k (_key_site), which runs inside the attention, so after any merge (ours,
    tomesd's or ppdiffusers') or downsampling of the keys."""
    from ...backends.frameworks import host_ops
    from ...runtime.tome_patch import transformer_blocks

    host = host_ops(backend)
    blocks = {id(block) for block in transformer_blocks(host, model)}
    seen: List[Tuple[str, int]] = []

    def hook_for(name: str):
        def count(module: Any, args: tuple, kwargs: dict) -> None:
            tokens = kwargs.get("hidden_states", args[0] if args else None)
            seen.append((name, int(tokens.shape[1])))
        return count

    handles = [_key_site(block).register_forward_pre_hook(hook_for(name), with_kwargs=True)
               for name, block in host.named_modules(model) if id(block) in blocks]
    seam = None
    if backend == "torch":  # keys downsampled after to_k, at diffusers' attention dispatch (Flux, Wan)
        from ...backends.torch_dispatch import SEAM as seam

        def shrunk(before: int, after: int) -> None:
            if seen:
                seen[-1] = (seen[-1][0], seen[-1][1] - before + after)

        seam.observers.append(shrunk)
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()
        if seam is not None:
            seam.observers.remove(shrunk)


def _key_site(block: Any) -> Any:
    """Where a block's self-attention keys are counted: its `to_k` (image keys; text keys of joint attention
    have their own projection), or, where one layer projects queries, keys and values together (Flux.2's
    single blocks), the attention module's input, which is the sequence it attends over."""
    from ...families import block_kind
    from ...layouts.entries import sublayer

    kind = block_kind(block)
    name = kind.self_attention or next(span.attention_call for span in kind.spans if span.attention_call)
    attention = sublayer(block, name)
    to_k = getattr(attention, "to_k", None)
    return attention if to_k is None else to_k


def counts(seen: List[Tuple[str, int]]) -> List[int]:
    return [n for _, n in seen]


def tokens_per_level(latent: "int | Tuple[int, int]", before: List[int], after: List[int]) -> Dict[str, List[int]]:
    """Self-attention tokens summed per downsample level of a latent (a side, or (height, width)):
    {level: [without ToMe, with ToMe]}."""
    from tome_core import level_of

    latent_hw = (latent, latent) if isinstance(latent, int) else tuple(latent)
    levels: Dict[str, List[int]] = {}
    for n_before, n_after in zip(before, after):
        # A video transformer's sequence holds every frame, more tokens than one frame's latent: level 0.
        level = level_of(latent_hw, n_before) if n_before <= latent_hw[0] * latent_hw[1] else 0
        entry = levels.setdefault(str(level), [0, 0])
        entry[0] += n_before
        entry[1] += n_after
    return levels
