"""cache-dit (DBCache, with and without its TaylorSeer calibrator) and ToMe on the tiny Flux, SD3 and Wan
pipelines, in either order: both act (cached steps run fewer blocks, computed blocks merge), the pair is
deterministic and order-free, and removing either leaves the other as it is alone. (cache-dit is pinned in
the torch environment; it needs diffusers >= 0.36, so the paddle environment, on 0.32, leaves this out.)"""
import cache_dit
import numpy as np
import pytest
import torch

import tiny_torch as T
import tomesd


STEPS = 8
TOL = 1e-5


def pipeline(kind, tmp_path):
    if kind == "flux":
        return T.flux_pipeline(), lambda p: T.run_flux_pipeline(p, steps=STEPS)
    if kind == "wan":
        return T.wan_pipeline(), lambda p: T.run_wan_pipeline(p, steps=STEPS)
    pipe = T.sd3_pipeline(tmp_path)
    return pipe, lambda p: p("a tiny test", num_inference_steps=STEPS, height=32, width=32, guidance_scale=2.0,
                             output_type="np", generator=torch.Generator().manual_seed(0)).images


def config(calibrator):
    from cache_dit import DBCacheConfig, TaylorSeerCalibratorConfig

    # Random weights: a loose threshold, so the middle blocks are skipped after the warm-up steps.
    cache = DBCacheConfig(Fn_compute_blocks=1, Bn_compute_blocks=0, residual_diff_threshold=10.0, max_warmup_steps=2)
    return dict(cache_config=cache, calibrator_config=TaylorSeerCalibratorConfig(taylorseer_order=1) if calibrator else None)


def run(pipe, call):
    """Output, and the query tokens of each attention that ran (the image attention's to_q)."""
    queries = []
    attns = [getattr(b, n) for b in pipe.transformer.modules() if type(b).__name__.endswith("Block")
             for n in ("attn", "attn1") if getattr(b, n, None) is not None]
    handles = [a.to_q.register_forward_pre_hook(lambda m, a: queries.append(a[0].shape[1])) for a in attns]
    try:
        return np.asarray(call(pipe)), queries
    finally:
        for h in handles:
            h.remove()


# cache-dit 1.5.3 itself fails on SD3 with its TaylorSeer calibrator and no Bn blocks, without ToMe
# ("State 'transformer_blocks_Bn_residual' not found"): that pair is left out.
PAIRS = [(kind, calibrator) for kind in ("flux", "sd3", "wan") for calibrator in (False, True)
         if (kind, calibrator) != ("sd3", True)]


@pytest.mark.parametrize("kind,calibrator", PAIRS,
                         ids=[f"{k}-{'dbcache+taylorseer' if c else 'dbcache'}" for k, c in PAIRS])
def test_cache_dit_stacks_with_the_patch_in_either_order(kind, calibrator, tmp_path):
    made = []  # cache-dit keeps the pipelines it caches alive: their patches are removed at the end

    def fresh(cache, patch, patch_first=False):
        pipe, call = pipeline(kind, tmp_path)
        made.append(pipe)
        if patch and patch_first:
            tomesd.apply_patch(pipe, ratio=0.5)
        if cache:
            cache_dit.enable_cache(pipe, **config(calibrator))
        if patch and not patch_first:
            tomesd.apply_patch(pipe, ratio=0.5)
        return pipe, call

    try:
        both_pipe, call = fresh(True, True)
        both, both_q = run(both_pipe, call)
        again, _ = run(*fresh(True, True, patch_first=True))
        cache_only, cache_q = run(*fresh(True, False))
        tome_only, tome_q = run(*fresh(False, True))
        merged, full = set(tome_q), set(cache_q)
        assert merged.isdisjoint(full)
        assert len(both_q) == len(cache_q) < len(tome_q)  # the cache skips blocks, with the patch on too
        assert set(both_q) <= merged  # every attention that ran merged
        assert np.array_equal(both, again)  # deterministic, whichever came first
        assert np.abs(both - cache_only).max() > 1000 * TOL
        assert np.abs(both - tome_only).max() > 1000 * TOL

        tomesd.remove_patch(both_pipe)  # the cache alone
        after, after_q = run(both_pipe, call)
        assert after_q == cache_q and np.array_equal(after, cache_only)
        pipe, call = fresh(True, True)
        cache_dit.disable_cache(pipe)  # the patch alone
        off, off_q = run(pipe, call)
        assert off_q == tome_q and np.array_equal(off, tome_only)
    finally:
        for pipe in made:
            tomesd.remove_patch(pipe)
