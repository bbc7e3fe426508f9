"""BlenderNeko's Tiled KSampler (ComfyUI_TiledKSampler, not on any package index) run with the ToMe and ToDo nodes on
ComfyUI 0.3.75 (.refs), the tiny SD1 UNet, a 320x448 latent in 256x256 tiles, each tiling strategy (docs/comfyui.md):

    mkdir -p /tmp/tiles/custom_nodes/ComfyUI_TiledKSampler && for f in __init__.py nodes.py tiling.py; do
        git -C TILED_KSAMPLER_REPO show HEAD:$f > /tmp/tiles/custom_nodes/ComfyUI_TiledKSampler/$f; done
    .venv-torch/bin/python benchmarks/tiled_check.py /tmp/tiles/custom_nodes/ComfyUI_TiledKSampler

Prints, per strategy and node, the largest change against the unpatched tiled run, the token counts the tiles
brought, how many sizes the patch keeps, and the hooks left on the shared UNet."""
import asyncio
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
import comfy_host
comfy_host.import_comfy()
import nodes, tomesd
from comfy_extras.nodes_tomesd import TomePatchModel
from tomesd.comfyui.nodes import ToMe, ToDo
from tomesd.hosts.comfyui_patcher import comfy_patches
assert asyncio.run(nodes.load_custom_node(sys.argv[1])), "Tiled KSampler did not load"
Tiled = nodes.NODE_CLASS_MAPPINGS["BNK_TiledKSampler"]
model = comfy_host.sd1_patcher()[0]
gen = torch.Generator().manual_seed(100)
pos = [[torch.randn(1, 7, 32, generator=gen), {}]]; neg = [[torch.zeros(1, 7, 32), {}]]
latent = {"samples": torch.randn(1, 4, 40, 56, generator=torch.Generator().manual_seed(3))}
def tiled(m, strategy):
    return Tiled().sample(m, 0, 256, 256, strategy, 3, 2.0, "euler", "normal", pos, neg, latent, 1.0)[0]["samples"]
def defaults(node):
    return {k: v[1]["default"] for k, v in node.INPUT_TYPES()["required"].items() if k != "model"}
for strategy in ("random", "padded", "simple"):
    plain = tiled(model, strategy)
    for name, m in (("ToMe", ToMe().patch(model=model, **defaults(ToMe))[0]), ("ToDo", ToDo().patch(model=model, **defaults(ToDo))[0]),
                    ("built-in TomePatchModel", TomePatchModel.execute(model, 0.5)[0] if hasattr(TomePatchModel, "execute") else TomePatchModel().patch(model, 0.5)[0])):
        try:
            if name.startswith("built-in"):  # ComfyUI's own (queries only): not observable
                out = tiled(m, strategy)
                print(f"{strategy:7s} {name}: change {float((out - plain).abs().max()):.4f}")
                continue
            with tomesd.observe(m) as seen:
                out = tiled(m, strategy)
            shapes = sorted({n for c in seen.calls for b in c.blocks.values() for s, v in b.sites.items() for n, _ in v})
            kept = [len(p.matcher.kept) for p in comfy_patches(m)]
            hooks = sum(len(x._forward_hooks) + len(x._forward_pre_hooks) for x in model.model.diffusion_model.modules())
            print(f"{strategy:7s} {name}: change {float((out - plain).abs().max()):.4f}, calls {len(seen.calls)}, token counts in {shapes}, kept sizes {kept}, hooks left {hooks}")
        except Exception as e:
            print(f"{strategy:7s} {name}: FAILED {type(e).__name__}: {str(e)[:200]}")
