"""What diffusers promises of SD3 / SD3.5 transformers still holds under the patch: attention processors,
fused projections, peft LoRA, layerwise casting, save/load."""
import contextlib

import pytest
import torch

import step_caches as S
import tiny_torch as T
import tomesd

KINDS = ("sd3", "sd35")
MODES = {"merge": dict(ratio=0.5), "downsample": dict(mode="downsample")}
TOL = 1e-5


def run(model, **kwargs):
    return T.run_transformer(model, T.transformer_inputs(kwargs.pop("kind", "sd3")))


def lora_config():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0", "add_k_proj"],
                      init_lora_weights=False)


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("kind", KINDS)
def test_peft_lora_loaded_before_the_patch(kind, mode):
    unpatched = T.transformer(kind)
    unpatched.add_adapter(lora_config())
    model = T.transformer(kind)
    model.add_adapter(lora_config())  # the same adapter weights: peft's init follows the global seed
    model.load_state_dict(unpatched.state_dict())
    base = run(unpatched, kind=kind)
    assert torch.equal(run(model, kind=kind), base)
    tomesd.apply_patch(model, **MODES[mode])
    out = run(model, kind=kind)
    assert (out - base).abs().max().item() > 1000 * TOL
    tomesd.remove_patch(model)
    assert torch.equal(run(model, kind=kind), base)


def test_lora_after_a_downsample_patch_is_refused_clearly_and_merge_mode_runs():
    model = T.transformer("sd3")
    tomesd.apply_patch(model, mode="downsample")
    model.add_adapter(lora_config())
    with pytest.raises(ValueError, match="apply_patch again"):
        run(model)
    tomesd.apply_patch(model, mode="downsample")  # applied again: the hooks sit on the adapters' layers
    again = run(model)
    tomesd.remove_patch(model)
    base = run(model)
    assert (again - base).abs().max().item() > 1000 * TOL
    tomesd.apply_patch(model, ratio=0.5)  # merge mode hooks the attention module itself: adapters compose
    model.add_adapter(lora_config(), adapter_name="second")
    assert (run(model) - run_unpatched_copy(model)).abs().max().item() > 1000 * TOL
    tomesd.remove_patch(model)


def run_unpatched_copy(model):
    import copy

    twin = copy.deepcopy(model)
    tomesd.remove_patch(twin)
    return run(twin)


@pytest.mark.parametrize("kind", ["sd3"])  # SD3.5 fused fails in diffusers 0.42 itself (attn2 has no text)
def test_fused_projections_merge_as_unfused(kind):
    model = T.transformer(kind)
    tomesd.apply_patch(model, ratio=0.5)
    merged = run(model, kind=kind)
    assert (merged - run_unpatched_copy(model)).abs().max().item() > 1000 * 1e-4  # far beyond the parity below
    model.fuse_qkv_projections()
    fused = run(model, kind=kind)
    assert (fused - merged).abs().max().item() < 1e-4  # fused projections: the same merge
    model.unfuse_qkv_projections()  # (downsampling on fused projections: test_fused_downsample.py)
    tomesd.remove_patch(model)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_attention_processors_swapped_after_the_patch(mode):
    from diffusers.models.attention_processor import JointAttnProcessor2_0

    model = T.transformer("sd3")
    base = run(model)
    tomesd.apply_patch(model, **MODES[mode])
    out = run(model)
    model.set_attn_processor(JointAttnProcessor2_0())  # a fresh processor object of the default kind
    assert torch.equal(run(model), out)
    tomesd.remove_patch(model)
    assert torch.equal(run(model), base) and (out - base).abs().max().item() > 1000 * TOL


@pytest.mark.parametrize("mode", sorted(MODES))
def test_layerwise_casting_after_the_patch(mode):
    storage = getattr(torch, "float8_e4m3fn", torch.bfloat16)
    model, unpatched = T.transformer("sd3"), T.transformer("sd3")
    tomesd.apply_patch(model, **MODES[mode])
    for m in (model, unpatched):
        m.enable_layerwise_casting(storage_dtype=storage, compute_dtype=torch.float32)
    out, base = run(model), run(unpatched)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    assert (out - base).abs().max().item() > 1e-2  # still merged or downsampled under casting


@pytest.mark.parametrize("mode", sorted(MODES))
def test_save_pretrained_of_a_patched_model_saves_the_host_weights_only(mode, tmp_path):
    from diffusers import SD3Transformer2DModel

    model = T.transformer("sd3")
    base = run(model)
    tomesd.apply_patch(model, **MODES[mode])
    patched = run(model)
    assert (patched - base).abs().max().item() > 1000 * TOL
    model.save_pretrained(tmp_path)
    loaded = SD3Transformer2DModel.from_pretrained(tmp_path).eval()
    assert torch.equal(run(loaded), base)  # nothing of the patch travels in the weights
    tomesd.apply_patch(loaded, **MODES[mode])
    assert torch.equal(run(loaded), patched)


def flux_queries(model, inputs):
    """Output, and the query tokens of each Flux block's attention that ran (a cached step runs fewer)."""
    seen, handles = [], []
    for block in list(model.transformer_blocks) + list(model.single_transformer_blocks):
        handles.append(block.attn.to_q.register_forward_pre_hook(lambda m, a: seen.append(a[0].shape[1])))
    with torch.no_grad():
        out = model(**inputs).sample
    for handle in handles:
        handle.remove()
    return out, seen


def test_first_block_cache_stacks_with_the_patch_on_flux(unpatch):
    """diffusers' First Block Cache and ToMe on one Flux model: cached calls run only the first block,
    which merges, and match nothing for the blocks they skip; the pair is deterministic; removing either
    leaves the other working as it does alone."""
    from diffusers import FirstBlockCacheConfig

    steps = [T.flux_inputs(t=0.5)] * 3  # the first block's residual repeats: the cache skips after the first call

    def fresh(cache, patch):
        model = T.flux()
        if cache:
            model.enable_cache(FirstBlockCacheConfig(threshold=0.05))
        if patch:
            tomesd.apply_patch(model, ratio=0.5)
            unpatch(model)
        return model

    def loop(model):
        outs, queries, counts = [], [], []
        patched = hasattr(model, "_tome_patch")
        for inputs in steps:
            with (tomesd.observe(model) if patched else contextlib.nullcontext()) as observed:
                if getattr(model, "is_cache_enabled", False):
                    with model.cache_context("cond"):
                        out, seen = flux_queries(model, inputs)
                else:
                    out, seen = flux_queries(model, inputs)
            outs.append(out)
            queries.append(seen)
            counts.append(observed.calls[0].computed if patched else 0)
        return outs, queries, counts

    both_model = fresh(True, True)
    both, both_q, both_counts = loop(both_model)
    again, _, _ = loop(fresh(True, True))
    cache_only, cache_q, _ = loop(fresh(True, False))
    tome_only, tome_q, _ = loop(fresh(False, True))
    # 64 image tokens, 5 text tokens: double blocks see the image, single blocks text + image.
    assert cache_q == [[64, 64, 69, 69], [64], [64]]  # the cache acts: later calls run the first block only
    assert both_q == [[32, 32, 37, 37], [32], [32]]  # ... and with the patch that block merges
    assert tome_q == [[32, 32, 37, 37]] * 3
    assert both_counts == [4, 1, 1]  # skipped blocks cost no matching
    assert all(torch.equal(a, b) for a, b in zip(both, again))  # deterministic
    assert (both[0] - cache_only[0]).abs().max().item() > 1000 * TOL
    tomesd.remove_patch(both_model)  # the cache alone again
    both_model._reset_stateful_cache()
    after, after_q, _ = loop(both_model)
    assert after_q == cache_q and all(torch.equal(a, b) for a, b in zip(after, cache_only))
    model = fresh(True, True)
    model.disable_cache()  # the patch alone again
    off, off_q, _ = loop(model)
    assert off_q == tome_q and all(torch.equal(a, b) for a, b in zip(off, tome_only))


# diffusers' step caches beside the patch, applied by diffusers' own functions (SD3Transformer2DModel has
# no `enable_cache` in diffusers 0.42). Not here, because they fail without the patch too, in diffusers
# itself: First Block Cache on SD3 (its tail residual subtracts text outputs, and SD3's last block,
# `context_pre_only`, returns None for them) and
# FasterCache on Flux (a 4-D / 3-D concatenation); First Block Cache on Flux is tested above.
@pytest.mark.parametrize("kind,cache", [("sd3", "taylorseer"), ("sd3", "fastercache")])
def test_diffusers_step_caches_stack_with_downsampling(kind, cache):
    """Both act (cached steps run fewer attentions, computed attentions take downsampled keys), the pair
    is deterministic, and removing either (after a run) leaves the other working as it does alone."""
    from diffusers.hooks.hooks import CacheContext, _set_cache_context

    def fresh(with_cache, patch):
        model = S.model(kind)
        if with_cache:
            S.apply(model, kind, cache)
        if patch:
            tomesd.apply_patch(model, mode="downsample")
        return model

    def loop(model):
        outs, seen = [], []
        attns = [b.attn for b in model.modules() if type(b).__name__.endswith("TransformerBlock")]
        handles = [a.to_k.register_forward_pre_hook(lambda m, a: seen[-1].append(a[0].shape[1])) for a in attns]
        try:
            for t in S.TIMESTEPS:
                S.Clock.value = t
                seen.append([])
                inputs = T.transformer_inputs("sd3", t=t) if kind == "sd3" else T.flux_inputs(t=t / 1000)
                _set_cache_context(model, CacheContext("cond"))
                outs.append(T.run_transformer(model, inputs))
        finally:
            for h in handles:
                h.remove()
        return outs, seen

    both_model = fresh(True, True)
    both, both_q = loop(both_model)
    again, _ = loop(fresh(True, True))
    cache_only, cache_q = loop(fresh(True, False))
    tome_only, tome_q = loop(fresh(False, True))
    full = len(tome_q[0])
    assert any(len(step) < full for step in cache_q)  # the cache skips attentions at its cached steps ...
    assert [len(s) for s in both_q] == [len(s) for s in cache_q]  # ... and does so with the patch on
    # Every attention that ran took downsampled image keys, none the full ones.
    merged, unmerged = set(tome_q[0]), set(cache_q[0])
    assert merged.isdisjoint(unmerged) and {q for step in both_q for q in step} <= merged
    assert all(torch.equal(a, b) for a, b in zip(both, again))  # deterministic
    assert (both[-1] - cache_only[-1]).abs().max().item() > 1000 * TOL
    tomesd.remove_patch(both_model)  # the cache alone again, from a fresh run
    S.reset(both_model)
    after, after_q = loop(both_model)
    assert after_q == cache_q and all(torch.equal(a, b) for a, b in zip(after, cache_only))
    model = fresh(True, True)
    loop(model)
    S.remove(model, cache)  # the patch alone again
    off, off_q = loop(model)
    assert off_q == tome_q and all(torch.equal(a, b) for a, b in zip(off, tome_only))
