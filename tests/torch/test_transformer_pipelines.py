"""Whole Flux and PixArt pipelines (SD3's are in test_transformers.py): apply_patch(pipe) patches the
denoisers and nothing else, every attention of theirs sees merged image tokens, and remove_patch gives
back the pipeline's own images; reuse_steps counts the pipeline's own steps."""
import pytest
import torch

import tiny_torch as T
import tomesd
from tomesd.families import KNOWN_BLOCKS
from tomesd.runtime.tome_patch import PATCH_ATTR

PIPELINES = {
    "flux": (lambda: T.flux_pipeline(), T.run_flux_pipeline),
    "flux-controlnet": (lambda: T.flux_pipeline(controlnet=True), T.run_flux_pipeline),
    "pixart-alpha": (lambda: T.pixart_pipeline(), T.run_pixart_pipeline),
    "pixart-sigma": (lambda: T.pixart_pipeline(sigma=True), T.run_pixart_pipeline),
}


def query_probe(model):
    """Query tokens of every self-attention of `model`'s blocks (Flux's attn, PixArt's attn1)."""
    seen, handles = [], []
    for block in model.modules():
        if type(block).__name__ in KNOWN_BLOCKS.split(", "):
            attn = getattr(block, "attn1", None) or block.attn
            handles.append(attn.to_q.register_forward_pre_hook(lambda m, a: seen.append(a[0].shape[1])))
    return seen, handles


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_a_pipeline_patches_its_denoisers_and_nothing_else(name):
    build, run = PIPELINES[name]
    pipe = build()
    denoisers = ["transformer"] + (["controlnet"] if hasattr(pipe, "controlnet") else [])
    plain_q, handles = query_probe(pipe.transformer)
    base = run(pipe)
    for h in handles:
        h.remove()
    tomesd.apply_patch(pipe, ratio=0.5)
    patched = [n for n, c in pipe.components.items()
               if isinstance(c, torch.nn.Module) and any(PATCH_ATTR in m.__dict__ for m in c.modules())]
    seen, handles = query_probe(pipe.transformer)
    cn_seen, cn_handles = query_probe(pipe.controlnet) if "controlnet" in denoisers else ([], [])
    merged = run(pipe)
    for h in handles + cn_handles:
        h.remove()
    assert sorted(patched) == sorted(denoisers)  # never the VAE
    assert len(seen) == len(plain_q) and all(q < p for q, p in zip(seen, plain_q))  # every attention merged
    if cn_handles:
        assert cn_seen and all(q < max(plain_q) for q in cn_seen)
    assert abs(merged - base).max() > 1e-2
    tomesd.remove_patch(pipe)
    assert (run(pipe) == base).all()


@pytest.mark.parametrize("name", ["flux", "pixart-alpha"])
def test_reuse_steps_on_a_pipeline_counts_its_steps_and_every_call_merges(name):
    build, run = PIPELINES[name]
    pipe = build()
    tomesd.apply_patch(pipe, ratio=0.5, reuse_steps=2)
    with tomesd.observe(pipe.transformer) as seen:
        run(pipe, steps=4)
    blocks = len(pipe.transformer._tome_patch.blocks)
    assert [(call.computed, call.reused) for call in seen.calls] == [(blocks, 0), (0, blocks)] * 2
    assert [call.merged_blocks("attn") for call in seen.calls] == [list(range(blocks))] * 4  # reusing calls too
    tomesd.remove_patch(pipe)
