"""Merge mode stacked with diffusers' step caches (TaylorSeer, FasterCache, Pyramid Attention Broadcast,
MagCache, First Block Cache) on SD3, Flux, PixArt and Wan: ToMe's hooks sit innermost in the attention's
forward chain, so a cache of attention outputs keeps and replays full tokens; both act; the pair is
deterministic and does not depend on which was applied first; removing either leaves the other as it is
alone."""
import pytest
import torch

import step_caches as S
import tomesd
from tomesd.backends.torch_links import link_of

TOL = 1e-5
PAIRS = [(kind, name) for kind in ("sd3", "flux", "pixart", "wan") for name in S.CACHES
         if (kind, name) not in S.FAILS_IN_DIFFUSERS]


_PATCHED = []  # the nets fresh() patched in this test: unpatched as it ends (tests/conftest.py checks)


@pytest.fixture(autouse=True)
def _unpatch_fresh_nets():
    yield
    while _PATCHED:
        tomesd.remove_patch(_PATCHED.pop())


def fresh(kind, cache=None, patch=False, patch_first=False):
    net = S.model(kind)
    if patch:
        _PATCHED.append(net)
    if patch and patch_first:
        tomesd.apply_patch(net, ratio=0.5)
    if cache:
        S.apply(net, kind, cache)
    if patch and not patch_first:
        tomesd.apply_patch(net, ratio=0.5)
    return net


def same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("kind,cache", PAIRS)
def test_merge_mode_stacks_with_a_step_cache(kind, cache):
    both_net = fresh(kind, cache, patch=True)
    both, both_q, both_seen = S.loop(kind, both_net)
    again, _, _ = S.loop(kind, fresh(kind, cache, patch=True, patch_first=True))
    cache_only, cache_q, _ = S.loop(kind, fresh(kind, cache))
    tome_only, tome_q, _ = S.loop(kind, fresh(kind, patch=True))
    full = {q for step in cache_q for q in step}
    merged = {q for step in tome_q for q in step}
    assert full.isdisjoint(merged)
    # Both act: the cache skips the attentions it skips alone, and every attention that computes merges.
    assert [len(step) for step in both_q] == [len(step) for step in cache_q]
    assert any(len(step) < len(tome_q[0]) for step in cache_q)
    assert {q for step in both_q for q in step} <= merged
    if S.CACHES[cache].layer_outputs:
        kept = S.kept_token_counts(both_net)
        assert kept and kept.isdisjoint(merged)  # the cache keeps full tokens only
    if cache == "pab":  # it replays its last output: a skipped attention gives what it gave when computed
        # (Flux's single blocks go on with merged tokens after their attention, merged by each step's own
        # matching: only attentions whose output the block sees whole are compared.)
        replays = [(now, before) for step in range(1, len(both_q)) if not both_q[step]
                   for now, before in zip(both_seen[step], both_seen[step - 1]) if now.shape[1] in full]
        assert replays and all(torch.equal(now, before) for now, before in replays)
    assert same(both, again)  # deterministic, whichever was applied first
    assert max((a - b).abs().max().item() for a, b in zip(both, cache_only)) > 1000 * TOL
    assert max((a - b).abs().max().item() for a, b in zip(both, tome_only)) > 1000 * TOL

    tomesd.remove_patch(both_net)  # the cache alone again
    S.reset(both_net)
    after, after_q, _ = S.loop(kind, both_net)
    assert after_q == cache_q and same(after, cache_only)
    net = fresh(kind, cache, patch=True)
    S.loop(kind, net)
    S.remove(net, cache)  # the patch alone again
    off, off_q, _ = S.loop(kind, net)
    assert off_q == tome_q and same(off, tome_only)


def test_a_cache_applied_after_the_patch_inside_a_span_is_seated_at_the_first_call():
    """Flux's single blocks merge from their norm to proj_out; a cache on the attention inside that span is
    found at the first call after it was added: the attention's output unmerges inside the cache (which
    keeps full tokens) and merges again outside it. The same outputs as when the cache came first."""
    net = fresh("flux", "taylorseer", patch=True, patch_first=True)
    outs, _, _ = S.loop("flux", net)
    assert 69 in S.kept_token_counts(net)  # the single blocks' text + image, unmerged
    first, _, _ = S.loop("flux", fresh("flux", "taylorseer", patch=True))
    assert same(outs, first)
    tomesd.remove_patch(net)
    assert not any(link_of(v) is not None for m in net.modules() for v in vars(m).values())


def test_a_cache_on_a_module_inside_a_merged_region_is_refused():
    """A cache pointed (by its identifiers) at a module that sees merged tokens, not at an attention or a
    block, would keep one step's merged order: refused before anything changes, naming what stacks."""
    from diffusers.hooks import TaylorSeerCacheConfig, apply_taylorseer_cache

    net = S.model("sd3")
    apply_taylorseer_cache(net, TaylorSeerCacheConfig(cache_identifiers=[r"^transformer_blocks\.\d+\.attn\.to_out\.0$"]))
    with pytest.raises(ValueError, match="Cache the attention modules .* or whole blocks"):
        tomesd.apply_patch(net, ratio=0.5)
    assert not any("_tome_patch" in m.__dict__ for m in net.modules())


def test_the_link_leaves_the_module_as_it_was():
    """remove_patch restores every forward chain: no instance `forward` where there was none, diffusers'
    and accelerate's chains as they were."""
    from accelerate.hooks import ModelHook, add_hook_to_module

    net = S.model("sd3")
    S.apply(net, "sd3", "pab")
    attn = net.transformer_blocks[0].attn
    add_hook_to_module(attn, ModelHook())
    before = {id(m): dict(vars(m)) for m in net.modules()}
    chain = [(ref.forward, ref.original_forward) for ref in attn._diffusers_hook._fn_refs]
    tomesd.apply_patch(net, ratio=0.5)
    assert link_of(attn._diffusers_hook._fn_refs[0].original_forward) is not None  # innermost
    tomesd.remove_patch(net)
    assert [(ref.forward, ref.original_forward) for ref in attn._diffusers_hook._fn_refs] == chain
    for m in net.modules():
        assert vars(m).keys() == before[id(m)].keys()
        assert all(vars(m)[k] is v for k, v in before[id(m)].items() if k in ("forward", "_old_forward"))


@pytest.mark.parametrize("kind, cache, mode", [("flux", "pab", "merge"), ("flux", "fbc", "merge"),
                                              ("sd3", "taylorseer", "merge"), ("wan", "magcache", "merge"),
                                              ("pixart", "pab", "downsample")])
def test_weighed_merging_stacks_with_step_caches(kind, cache, mode):
    """A cache that skips an attention skips its arming with it (else the next attention, the cross-attention,
    would take the image keys' weights): the loop runs, the weights act where it computes. (PixArt's grid
    downsamples into whole cells over image keys alone: its weights cancel, the output is unweighted's.)"""
    outputs = {}
    setting = dict(ratio=0.5) if mode == "merge" else dict(mode="downsample")
    for weighed in (False, True):
        net = S.model(kind).eval()
        tomesd.apply_patch(net, proportional_attention=weighed, **setting)
        if mode == "downsample":  # self-attention skipped, cross-attention computed: where a leak would land
            from diffusers.hooks import PyramidAttentionBroadcastConfig, apply_pyramid_attention_broadcast

            apply_pyramid_attention_broadcast(net, PyramidAttentionBroadcastConfig(
                spatial_attention_block_skip_range=2, spatial_attention_timestep_skip_range=(-1, 1000),
                current_timestep_callback=lambda: S.Clock.value))
        else:
            S.apply(net, kind, cache)
        try:
            outputs[weighed], computed, _ = S.loop(kind, net)
        finally:
            tomesd.remove_patch(net)
            S.remove(net, cache)
        assert min(map(len, computed)) < max(map(len, computed))  # the cache skipped attentions at some steps
    change = max((a - b).abs().max().item() for a, b in zip(outputs[True], outputs[False]))
    assert change > 1e-4 if mode == "merge" else change < 1e-5
