"""Downsampling on fused QKV projections (issue 60, item 3): diffusers' `fuse_qkv_projections()` gives the UNets' and
PixArt's self-attention and SD3's joint attention one to_qkv, so no module takes the keys' input alone; ToMe shrinks
the image's keys and values inside the fused processor's one SDPA call instead. A linear projection commutes with
taking every n-th token and with a cell's mean, so the output equals the unfused model's downsampling to fp32
round-off: fused before apply_patch or after it, with proportional attention, and unfused again."""
import pytest
import torch
import torch.nn.functional as F

import tiny_torch as T
import tomesd

CASES = [("unet", dict()), ("unet", dict(downsample_method="avg")),
         ("unet", dict(downsample_factor=3, downsample_method="avg", proportional_attention=True)),
         ("sd3", dict()), ("sd3", dict(downsample_method="avg")), ("sd3", dict(proportional_attention=True)),
         ("sd3", dict(downsample_factor=3, downsample_method="avg", proportional_attention=True)),
         ("pixart", dict(downsample_method="avg"))]


def _model(kind):
    torch.manual_seed(0)
    if kind == "unet":
        model, inputs = T.unet(), T.unet_inputs()
        return model, lambda: model(*inputs).sample
    model, inputs = T.transformer(kind), T.transformer_inputs(kind)
    return model, lambda: model(**inputs).sample


@pytest.mark.parametrize("kind,settings", CASES, ids=lambda v: v if isinstance(v, str) else
                         ",".join(f"{k}={w}" for k, w in v.items()) or "nearest")
def test_fused_projections_downsample_as_the_unfused_model_does(kind, settings):
    model, run = _model(kind)
    with torch.no_grad():
        base = run()
        tomesd.apply_patch(model, mode="downsample", **settings)
        try:
            unfused = run()
            model.fuse_qkv_projections()  # after apply_patch
            after = run()
            model.unfuse_qkv_projections()
            again = run()
        finally:
            tomesd.remove_patch(model)
        model.fuse_qkv_projections()  # before apply_patch
        tomesd.apply_patch(model, mode="downsample", **settings)
        try:
            before = run()
        finally:
            tomesd.remove_patch(model)
            model.unfuse_qkv_projections()
    tol = 1e-5 * base.abs().max().item()
    assert (unfused - base).abs().max().item() > 1000 * tol  # downsampling acts, far beyond the tolerance
    assert (after - unfused).abs().max().item() <= tol
    assert (before - unfused).abs().max().item() <= tol
    assert torch.equal(again, unfused)


def test_a_fused_attention_whose_sdpa_was_swapped_out_is_refused_by_name(monkeypatch):
    model, run = _model("unet")
    model.fuse_qkv_projections()
    tomesd.apply_patch(model, mode="downsample")
    try:
        with torch.no_grad():
            run()  # the seam is in place from the first fused attention on
            own = F.scaled_dot_product_attention
            monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **k: own.__wrapped__(*a, **k))
            with pytest.raises(RuntimeError, match="no call of torch's scaled_dot_product_attention"):
                run()
    finally:
        monkeypatch.undo()
        tomesd.remove_patch(model)
        model.unfuse_qkv_projections()


@pytest.mark.parametrize("fused_first", [True, False], ids=["fused-before-apply", "fused-after-apply"])
@pytest.mark.parametrize("settings", [dict(), dict(downsample_factor=3, downsample_method="avg",
                                                   proportional_attention=True)], ids=["nearest", "avg-prop"])
def test_fused_downsampling_compiles_into_one_graph_equal_to_eager(settings, fused_first):
    """Compiled before any eager call. Fused before apply_patch (or with proportional attention) the SDPA seam is
    open from the start: one graph. Fused after it, without weights, the seam opens in the first trace, and the
    next call compiles once more (then no more)."""
    from probes import CountingBackend

    model, run = _model("unet")
    if fused_first:
        model.fuse_qkv_projections()
    tomesd.apply_patch(model, mode="downsample", **settings)
    if not fused_first:
        model.fuse_qkv_projections()
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            backend = CountingBackend()
            compiled = torch.compile(run, backend=backend, fullgraph=True)  # a graph break raises
            outs = [compiled(), compiled(), compiled()]
            eager = run()
    finally:
        torch._dynamo.reset()
        tomesd.remove_patch(model)
        model.unfuse_qkv_projections()
    assert backend.graphs == (1 if fused_first or settings else 2) and all(torch.equal(out, eager) for out in outs)


def test_average_pooling_of_keys_normalised_after_a_fused_projection_is_refused_by_name():
    """qk-norm after to_qkv: the mean of normalised keys is not the normalised mean, so avg is refused there."""
    model, run = _model("unet")
    for attn in [m for name, m in model.named_modules() if name.endswith("attn1")]:
        attn.norm_k = torch.nn.LayerNorm(attn.inner_dim // attn.heads)  # as a model with qk-norm has
    model.fuse_qkv_projections()
    with pytest.raises(ValueError, match="downsample_method='nearest'"):
        tomesd.apply_patch(model, mode="downsample", downsample_method="avg")
    tomesd.apply_patch(model, mode="downsample")  # nearest: taking every n-th key commutes with the norm
    try:
        with torch.no_grad():
            run()
    finally:
        tomesd.remove_patch(model)
        model.unfuse_qkv_projections()
