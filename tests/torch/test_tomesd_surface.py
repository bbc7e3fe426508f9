"""tomesd 0.1.3's whole module surface (issue 68, item 2): every public name of its `tomesd.patch` and
`tomesd.utils` is here, and works as tomesd's did (compute_merge, hook_tome_model, isinstance_str, init_generator)
or refuses by name with the call that works (the block-class factories, and a host's replacement of
make_tome_block, which apply_patch would otherwise ignore)."""
import inspect

import pytest
import torch

import tiny_torch as T
import tomesd
import tomesd.patch
import tomesd.utils
from multiset import assert_same_rows
from references import load_tomesd_ref

ref = load_tomesd_ref()


def _public(module):
    # typing's names (Type, Dict, ...) and math are tomesd's own imports; torch is one that hosts reach through it
    return {name for name in dir(module) if not name.startswith("_") and name != "math"
            and getattr(getattr(module, name), "__module__", None) != "typing"}


@pytest.mark.parametrize("ours, theirs", [(tomesd.patch, ref.patch), (tomesd.utils, ref.utils)])
def test_every_public_name_of_tomesd_013s_modules_is_here(ours, theirs):
    missing = {name for name in _public(theirs) if not hasattr(ours, name)}
    assert not missing, missing
    assert tomesd.patch.torch is torch  # imported when asked, so importing tomesd imports no framework


def _info(use_rand=True, **over):
    args = dict(ratio=0.5, max_downsample=1, sx=2, sy=2, use_rand=use_rand, generator=None, merge_attn=True,
                merge_crossattn=False, merge_mlp=True, **over)
    return {"size": (16, 16), "args": args, "hooks": []}


@pytest.mark.parametrize("batch, use_rand", [(2, True), (1, True), (2, False)])
def test_compute_merge_is_tomesds(batch, use_rand):
    x = torch.randn(batch, 256, 8, generator=torch.Generator().manual_seed(0))
    ours, theirs = _info(use_rand), _info(use_rand)
    torch.manual_seed(5)  # both fork the global RNG's state into their generator
    mine = tomesd.patch.compute_merge(x, ours)
    torch.manual_seed(5)
    tomesds = ref.patch.compute_merge(x, theirs)
    m_a, m_c, m_m, u_a, u_c, u_m = mine
    assert m_a(x).shape == (batch, 128, 8) and m_c(x) is x and u_c(x) is x  # cross-attention left alone
    for f, g in zip(mine[:3], tomesds[:3]):
        if g.__name__ != "do_nothing":
            assert_same_rows(f(x).numpy(), g(x).numpy(), 1e-6)  # tomesd's rows, in the core's row order
    assert torch.allclose(u_a(m_a(x)), tomesds[3](tomesds[0](x)), atol=1e-6)
    assert (u_m(m_m(x)) - x).abs().max() > 0.1  # it merged
    assert ours["args"]["generator"] is not None  # made as tomesd made it, kept for the next block
    deeper = tomesd.patch.compute_merge(torch.randn(batch, 64, 8), ours)  # downsampled 2x, past max_downsample
    assert all(f.__name__ == "do_nothing" for f in deeper)


def test_hook_tome_model_records_the_latent_size_into_tomesds_info():
    model = torch.nn.Conv2d(4, 4, 1)
    model._tome_info = _info()
    tomesd.patch.hook_tome_model(model)
    model(torch.randn(1, 4, 12, 20))
    assert model._tome_info["size"] == (12, 20)
    model._tome_info["hooks"].pop().remove()
    with pytest.raises(TypeError, match=r"_tome_info.*tomesd\.apply_patch\(model"):
        tomesd.patch.hook_tome_model(torch.nn.Conv2d(4, 4, 1))


def test_utils_are_tomesds():
    unet = T.unet()
    for name in ("UNet2DConditionModel", "Module", "ModelMixin", "Conv2d"):
        assert tomesd.utils.isinstance_str(unet, name) == ref.utils.isinstance_str(unet, name)
    torch.manual_seed(3)
    a = tomesd.utils.init_generator(torch.device("cpu"))
    torch.manual_seed(3)
    b = ref.utils.init_generator(torch.device("cpu"))
    assert torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))
    fallback = torch.Generator()
    assert tomesd.utils.init_generator(torch.device("meta"), fallback) is fallback


@pytest.mark.parametrize("name", ["make_tome_block", "make_diffusers_tome_block"])
def test_block_class_factories_refuse_naming_apply_patch(name):
    with pytest.raises(TypeError, match=rf"{name}\(BasicTransformerBlock\).*tomesd\.apply_patch\(model"):
        from diffusers.models.attention import BasicTransformerBlock

        getattr(tomesd.patch, name)(BasicTransformerBlock)


def test_a_hosts_replaced_make_tome_block_is_refused_not_ignored(monkeypatch):
    """SD.Next's DirectML hook sets tomesd.patch.make_tome_block to its own and calls apply_patch: refused before
    anything changes, and with the factory set back the patch applies."""
    unet, inputs = T.unet(), T.unet_inputs()
    with torch.no_grad():
        plain = unet(*inputs).sample
    monkeypatch.setattr(tomesd.patch, "make_tome_block", lambda block_class: block_class)
    with pytest.raises(RuntimeError, match=r"make_tome_block was replaced .*cannot take effect.*Set it back"):
        tomesd.apply_patch(unet, ratio=0.5)
    with torch.no_grad():
        assert torch.equal(unet(*inputs).sample, plain)  # nothing was patched
    monkeypatch.undo()
    tomesd.apply_patch(unet, ratio=0.5)
    try:
        with torch.no_grad():
            assert (unet(*inputs).sample - plain).abs().max() > 1e-3
    finally:
        tomesd.remove_patch(unet)
