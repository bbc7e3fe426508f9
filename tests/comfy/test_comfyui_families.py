"""ComfyUI's own classes of the families added by root entries: Chroma (Flux's DoubleStreamBlock and
SingleStreamBlock under its own root class) merges through the ToMe node where claimed, on its clone only."""
import pytest
import torch

import comfy_host
import tomesd

comfy_host.import_comfy()

from tomesd.comfyui.nodes import ToMe  # noqa: E402

TEXT = 5


def _inputs():
    gen = torch.Generator().manual_seed(1)
    x, context = torch.randn(2, 4, 16, 16, generator=gen), torch.randn(2, TEXT, 32, generator=gen)
    return (x, torch.full((2,), 0.8), context), {"guidance": torch.full((2,), 3.5)}


@pytest.fixture(scope="module")
def chroma():
    return comfy_host.chroma_patcher()


def test_chroma_merges_its_image_tokens_in_every_block_and_only_in_its_clone(chroma):
    args, conds = _inputs()
    base = comfy_host.run(chroma, *args, **conds)
    patched = ToMe().patch(chroma, 0.5, 0.0, 0.0, "auto", "", True, 1, 0.0, 1.0, "")[0]
    with tomesd.observe(patched) as seen:
        out = comfy_host.run(patched, *args, **conds)
    (call,) = seen.calls
    image = 8 * 8  # a 16x16 latent in 2x2 patches
    # the double block's image stream, then the single blocks' [text, image]: half the image tokens merge
    assert [call.blocks[i].sites["attn"] for i in sorted(call.blocks)] == [
        [(image, image // 2)], [(TEXT + image, TEXT + image // 2)], [(TEXT + image, TEXT + image // 2)]]
    assert (out - base).abs().max() > 1e-2
    assert torch.equal(comfy_host.run(chroma, *args, **conds), base)  # the unpatched clone, bit for bit


def test_chroma_given_an_attention_mask_is_refused_naming_the_node(chroma):
    args, conds = _inputs()
    n = TEXT + 8 * 8
    patched = ToMe().patch(chroma, 0.5, 0.0, 0.0, "auto", "", True, 1, 0.0, 1.0, "")[0]
    with pytest.raises(ValueError, match="Chroma given an attention mask.*Bypass the ToMe node"):
        comfy_host.run(patched, *args, attention_mask=torch.zeros(2, 1, n, n), **conds)
