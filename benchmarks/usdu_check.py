"""ssitu's Ultimate SD Upscale (ComfyUI_UltimateSDUpscale with its A1111 script, Coyote-A's ultimate-upscale; neither on
any package index) run with the ToMe and ToDo nodes on ComfyUI 0.3.75 (.refs): the tiny SD1 UNet, a VAE of SD's shape
with random weights, a 320x448 image redrawn in 256x256 tiles, uniform and not, with and without a seam fix
(docs/comfyui.md). The node pack folder must hold the A1111 script at repositories/ultimate_sd_upscale:

    git -C USDU_REPO archive HEAD | tar -x -C custom_nodes/ComfyUI_UltimateSDUpscale   # (or its .py files)
    git -C COYOTE_REPO show 2322caa:scripts/ultimate-upscale.py \\
        > custom_nodes/ComfyUI_UltimateSDUpscale/repositories/ultimate_sd_upscale/scripts/ultimate-upscale.py
    .venv-torch/bin/python benchmarks/usdu_check.py custom_nodes/ComfyUI_UltimateSDUpscale

Prints, per setting and node, the largest change against the unpatched run, the tile token counts seen, the sizes the
patch keeps and the hooks left on the shared UNet."""
import asyncio
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
import comfy_host  # noqa: E402

comfy_host.import_comfy()
import comfy.sd  # noqa: E402
import nodes  # noqa: E402
from comfy.ldm.models.autoencoder import AutoencoderKL  # noqa: E402

import tiny_torch  # noqa: E402
import tomesd  # noqa: E402
from tomesd.comfyui.nodes import ToDo, ToMe  # noqa: E402
from tomesd.hosts.comfyui_patcher import comfy_patches  # noqa: E402


def vae():
    ddconfig = {"double_z": True, "z_channels": 4, "resolution": 256, "in_channels": 3, "out_ch": 3, "ch": 128,
                "ch_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_resolutions": [], "dropout": 0.0}
    model = tiny_torch.randomize_(AutoencoderKL(ddconfig=ddconfig, embed_dim=4), seed=5, gain=1.0)
    return comfy.sd.VAE(sd=model.state_dict())


def defaults(node) -> dict:
    return {k: v[1]["default"] for k, v in node.INPUT_TYPES()["required"].items() if k != "model"}


def stub_unused_imports() -> None:
    """usdu_utils imports torchvision's GaussianBlur and blurs with PIL's; this CPU torch has no loadable torchvision,
    so a stand-in that fails if it is ever called. Likewise spandrel, which ComfyUI's upscale-model node imports."""
    try:
        import torchvision  # noqa: F401
    except Exception:
        import types

        class GaussianBlur:
            def __init__(self, *args, **kwargs):
                raise RuntimeError("torchvision's GaussianBlur is stubbed here")

        transforms = types.ModuleType("torchvision.transforms")
        transforms.GaussianBlur = GaussianBlur
        package = types.ModuleType("torchvision")
        package.transforms = transforms
        sys.modules.update({"torchvision": package, "torchvision.transforms": transforms})
    try:  # ComfyUI's upscale-model node (imported by USDU's upscaler; no upscale model is used here) loads with spandrel
        import spandrel  # noqa: F401
    except ImportError:
        import types

        spandrel = types.ModuleType("spandrel")
        spandrel.ModelLoader = spandrel.ImageModelDescriptor = object
        spandrel.MAIN_REGISTRY = types.SimpleNamespace(add=lambda *a: None)
        sys.modules["spandrel"] = spandrel


def main() -> None:
    stub_unused_imports()
    assert asyncio.run(nodes.load_custom_node(os.path.abspath(sys.argv[1]))), "Ultimate SD Upscale did not load"
    usdu = nodes.NODE_CLASS_MAPPINGS["UltimateSDUpscaleNoUpscale"]
    model, the_vae = comfy_host.sd1_patcher()[0], vae()
    gen = torch.Generator().manual_seed(100)
    positive, negative = [[torch.randn(1, 7, 32, generator=gen), {}]], [[torch.zeros(1, 7, 32), {}]]
    image = torch.rand(1, 320, 448, 3, generator=gen)

    def redraw(m, uniform: bool, seam: str):  # under inference mode, as ComfyUI's executor runs a node
        with torch.inference_mode():
            return usdu().upscale(image, m, positive, negative, the_vae, 0, 3, 2.0, "euler", "normal", 0.5,
                                  "Linear", 256, 256, 8, 32, seam, 0.5, 8, 64, 16, uniform, False)[0]

    for uniform, seam in ((True, "None"), (False, "None"), (False, "Half Tile")):
        plain = redraw(model, uniform, seam)
        for name, node in (("ToMe", ToMe), ("ToDo", ToDo)):
            patched = node().patch(model=model, **defaults(node))[0]
            with tomesd.observe(patched) as seen:
                out = redraw(patched, uniform, seam)
            counts = sorted({n for c in seen.calls for b in c.blocks.values() for v in b.sites.values() for n, _ in v})
            kept = [len(p.matcher.kept) for p in comfy_patches(patched)]
            hooks = sum(len(x._forward_hooks) + len(x._forward_pre_hooks) for x in model.model.diffusion_model.modules())
            print(f"uniform tiles {uniform}, seam fix {seam}, {name}: change {float((out - plain).abs().max()):.4f}, "
                  f"model calls {len(seen.calls)}, token counts {counts}, sizes kept {kept}, hooks left {hooks}")


if __name__ == "__main__":
    main()
