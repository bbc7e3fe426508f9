"""Tiled sampling and upscaling with the ToMe and ToDo nodes, on ComfyUI's own sampler. BlenderNeko's Tiled KSampler
and ssitu's Ultimate SD Upscale (neither installable from a package index) sample one patched MODEL over the tiles
of a latent: edge tiles come in other sizes than the inner ones, and a tiled sampler's step loop goes from tile to
tile, so the sizes interleave from one call to the next. Here the patched clone samples 18 tile sizes in that order,
twice: each tile merges and its output changes, the input MODEL is untouched, and what the patch keeps per size
stays within its bound (kept_sizes, 16 by default) while the sizes outnumber it."""
from __future__ import annotations

import pytest
import torch

import comfy_host
import tomesd

comfy_host.import_comfy()

from tomesd.comfyui.nodes import ToDo, ToMe  # noqa: E402
from tomesd.hosts.comfyui_patcher import comfy_patches  # noqa: E402

TILES = [(8, 8), (8, 12), (12, 8), (12, 12), (16, 8), (8, 16), (16, 12), (12, 16), (16, 16), (20, 8), (8, 20),
         (20, 12), (12, 20), (20, 16), (16, 20), (20, 20), (24, 8), (8, 24)]  # latent tiles (pixels: 8x)


def _defaults(node) -> dict:
    required = node.INPUT_TYPES()["required"]
    return {name: spec[1]["default"] for name, spec in required.items() if name != "model"}


def _tile(h: int, w: int) -> dict:
    return {"samples": torch.randn(1, 4, h, w, generator=torch.Generator().manual_seed(h * 100 + w))}


@pytest.mark.parametrize("node", [ToMe, ToDo], ids=["tome", "todo"])
def test_tiles_of_many_sizes_merge_and_stay_bounded(node):
    model = comfy_host.sd1_patcher()[0]
    plain = {size: comfy_host.sample(model, steps=1, latent=_tile(*size)) for size in TILES}
    patched = getattr(node(), node.FUNCTION)(model=model, **_defaults(node))[0]
    outputs = {}
    for _ in range(2):  # the tiled sampler's next pass over the same tiles
        for size in TILES:
            with tomesd.observe(patched) as seen:
                outputs[size] = comfy_host.sample(patched, steps=1, latent=_tile(*size))
            site = "attn" if node is ToMe else "downsample"
            assert any(n > m for call in seen.calls for block in call.blocks.values()
                       for n, m in block.sites.get(site, [])), size  # the tile's tokens (or keys) shrink
            (patch,) = comfy_patches(patched)
            assert len(patch.matcher.kept) <= patch.args.kept_sizes == 16
    for size in TILES:
        assert outputs[size].shape == plain[size].shape
        assert (outputs[size] - plain[size]).abs().max() > 1e-3, size
    net = model.model.diffusion_model
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in net.modules()) == 0
    for size in TILES[:3]:
        assert torch.equal(comfy_host.sample(model, steps=1, latent=_tile(*size)), plain[size])
