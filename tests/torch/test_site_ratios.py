"""Per-site ratios (tomesd #44): `ratio={"attn": 0.5, "mlp": 0.25}` merges each site at its own ratio, all
from one matching per block; one ratio for every site equals exact ToMe bit for bit."""
import pytest
import torch

import tiny_torch as T
import tomesd
from probes import assert_loop_compiles_once_and_equals_eager
from tome_core import compute_merge, compute_merges, get_backend, rng


def run_unet(model, inputs):
    with torch.no_grad():
        return model(*inputs).sample


def probe_unet(model, inputs):
    """Tokens entering each BasicTransformerBlock's self-attention queries, cross-attention queries and
    feed-forward (hooked inside each, after the patch's own pre-hooks)."""
    seen = {"attn": [], "crossattn": [], "mlp": []}
    handles = []
    for block in model.modules():
        if type(block).__name__ == "BasicTransformerBlock":
            for site, module in (("attn", block.attn1.to_q), ("crossattn", block.attn2.to_q), ("mlp", block.ff.net[0].proj)):
                handles.append(module.register_forward_pre_hook(lambda m, a, site=site: seen[site].append(a[0].shape[1])))
    out = run_unet(model, inputs)
    for handle in handles:
        handle.remove()
    return out, seen


@pytest.mark.parametrize("sites,flags", [({"attn": 0.5}, {}), ({"attn": 0.5, "mlp": 0.5}, {"merge_mlp": True}),
                                         ({"attn": 0.3, "crossattn": 0.3}, {"merge_crossattn": True})])
def test_one_ratio_for_every_named_site_equals_exact_tome(sites, flags):
    model, inputs = T.unet(), T.unet_inputs()
    base = run_unet(model, inputs)
    ratio = next(iter(sites.values()))
    tomesd.apply_patch(model, ratio=ratio, **flags)
    exact = run_unet(model, inputs)
    tomesd.apply_patch(model, ratio=sites)
    try:
        assert torch.equal(run_unet(model, inputs), exact)
    finally:
        tomesd.remove_patch(model)
    assert (exact - base).abs().max().item() > 1e-2


def test_each_site_merges_at_its_own_ratio():
    model, inputs = T.unet(), T.unet_inputs()
    _, plain = probe_unet(model, inputs)
    tomesd.apply_patch(model, ratio={"attn": 0.5, "crossattn": 0.75, "mlp": 0.25})
    try:
        _, seen = probe_unet(model, inputs)
    finally:
        tomesd.remove_patch(model)
    # the finest level's blocks (16x16 = 256 tokens) merge; the coarser ones do not, by default. Cross-attention
    # at 0.75 merges every src token (3 of each 4): 64 rows, one per dst.
    fine = [i for i, n in enumerate(plain["attn"]) if n == 256]
    assert fine and all(seen["attn"][i] == 128 and seen["crossattn"][i] == 64 and seen["mlp"][i] == 192 for i in fine)
    assert all(seen[site][i] == plain[site][i] for site in seen for i in range(len(plain["attn"])) if i not in fine)


def test_per_site_merges_come_from_one_matching():
    """The tokens merged away at the smaller ratio are among those merged at the larger one, and each merge
    equals compute_merge's at its r."""
    metric = torch.randn(2, 64, 8, generator=torch.Generator().manual_seed(0))
    xp = get_backend(metric)
    offsets = rng.randint(xp, metric, [16], 4, rng.call_key(xp, 0, None))
    merges = compute_merges(xp, metric, 8, 8, 2, 2, [12, 30], offsets)
    for r in (12, 30):
        single = compute_merge(xp, metric, 8, 8, 2, 2, r, offsets)
        x = torch.randn(2, 64, 5)
        assert torch.equal(merges[r].merge(x), single.merge(x))

    def merged_tokens(merge):
        rows = merge._flat_rows.reshape(2, 64)[0]
        return {t for t in range(64) if (rows == rows[t]).sum() > 1}

    assert merged_tokens(merges[12]) < merged_tokens(merges[30])


def test_flux_per_site_ratios_on_double_blocks():
    """Flux's double blocks merge attention and feed-forward at their own ratios (one matching for the batch)."""
    model, inputs = T.flux(), T.flux_inputs()
    seen = {"attn": [], "mlp": []}
    handles = []
    for block in model.transformer_blocks:
        handles.append(block.attn.to_q.register_forward_pre_hook(lambda m, a: seen["attn"].append(a[0].shape[1])))
        handles.append(block.ff.net[0].proj.register_forward_pre_hook(lambda m, a: seen["mlp"].append(a[0].shape[1])))
    tomesd.apply_patch(model, ratio={"attn": 0.5, "mlp": 0.25})
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        tomesd.remove_patch(model)
        for handle in handles:
            handle.remove()
    assert seen == {"attn": [32, 32], "mlp": [48, 48]}


def test_a_loop_with_per_site_ratios_compiles_once_and_equals_eager():
    steps = [T.transformer_inputs("sd3", t=t, seed=i) for i, t in enumerate((900.0, 500.0, 100.0))]
    assert_loop_compiles_once_and_equals_eager(T.transformer("sd3"), T.run_transformer, steps,
                                               ratio={"attn": 0.5, "mlp": 0.25})


@pytest.mark.parametrize("kwargs,message", [
    (dict(ratio={"att": 0.5}), "names sites among"),
    (dict(ratio={}), "names sites among"),
    (dict(ratio={"attn": 1.5}), r"ratio\['attn'\] must be a number in \[0, 1\]"),
    (dict(ratio={"attn": 0.5}, merge_mlp=True), "merge_mlp=True contradicts"),
    (dict(ratio={"attn": 0.5, "mlp": 0.3}, merge_attn=False), "merge_attn=False contradicts"),
    (dict(ratio={"attn": 0.5}, mode="downsample"), "no meaning with mode='downsample'"),
])
def test_bad_per_site_ratios_are_refused_before_any_change(kwargs, message):
    model = T.unet()
    with pytest.raises(ValueError, match=message):
        tomesd.apply_patch(model, **kwargs)
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())
