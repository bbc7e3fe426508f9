"""A patched forward that raises anywhere (a user's hook before a block, the attention's processor between ToMe's
merge and unmerge with proportional attention armed, the feed-forward inside a merged region) leaves nothing behind:
the next forward of that model, and of another patched model in the process, equals what it gave before the failure."""
import pytest
import torch

import tiny_torch as T
import tomesd

SETTINGS = {"merge": dict(ratio=0.5), "proportional": dict(ratio=0.5, proportional_attention=True),
            "merge_mlp": dict(ratio=0.5, merge_mlp=True), "reuse": dict(ratio=0.5, reuse_steps=2),
            "downsample": dict(mode="downsample", proportional_attention=True)}


def _unet(seed):
    model, (x, t, c) = T.unet(seed=seed), T.unet_inputs()
    blocks = [m for m in model.modules() if type(m).__name__ == "BasicTransformerBlock"]
    return model, lambda: model(x, t, c).sample, blocks[0], blocks[0].attn1, blocks[0].ff


def _flux(seed):
    model, inputs = T.flux(seed=seed), T.flux_inputs()
    block = model.transformer_blocks[0]
    return model, lambda: model(**inputs).sample, block, block.attn, block.ff


MODELS = {"unet": _unet, "flux": _flux}


class RaisingProcessor:
    """An attention processor that fails before it attends (after ToMe's merge and its arming of the attention)."""

    def __call__(self, *args, **kwargs):
        raise RuntimeError("the attention failed")


def _fail(where, block, attn, ff, run):
    if where == "processor":
        processor = attn.processor
        attn.processor = RaisingProcessor()
        try:
            with pytest.raises(Exception):
                run()
        finally:
            attn.processor = processor
        return
    module = block if where == "block" else ff
    hook = module.register_forward_pre_hook(lambda m, args: (_ for _ in ()).throw(RuntimeError(f"a hook on {where}")))
    try:
        with pytest.raises(RuntimeError, match=f"a hook on {where}"):
            run()
    finally:
        hook.remove()


def _downsamples_flux() -> bool:
    """Flux downsamples at diffusers' attention dispatch, which came in 0.35; older diffusers is refused by name
    (test_flux.py), so there is no downsampled Flux forward to fail."""
    import diffusers
    from packaging.version import Version

    return Version(diffusers.__version__) >= Version("0.35")


CASES = [(kind, setting) for kind in sorted(MODELS) for setting in sorted(SETTINGS)
         if (kind, setting) != ("flux", "downsample") or _downsamples_flux()]


@pytest.mark.parametrize("where", ["block", "processor", "feed-forward"])
@pytest.mark.parametrize("kind,setting", CASES)
def test_the_next_forwards_are_as_if_the_failed_call_never_ran(kind, setting, where):
    model, run, block, attn, ff = MODELS[kind](0)
    other, run_other, *_ = MODELS[kind](1)
    with torch.no_grad():
        base = run()
        for m in (model, other):
            tomesd.apply_patch(m, **SETTINGS[setting])
        try:
            expected, expected_other = run(), run_other()
            assert (expected - base).abs().max() > 1e-2  # the patch acts
            _fail(where, block, attn, ff, run)
            assert torch.equal(run_other(), expected_other)
            assert torch.equal(run(), expected)
            assert torch.equal(run_other(), expected_other)
        finally:
            tomesd.remove_patch(model)
            tomesd.remove_patch(other)
        assert torch.equal(run(), base)
