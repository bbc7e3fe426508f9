"""The web UI extension's logic run on the web UIs' own code, which no package index has (docs/webui.md, "How it is
tested"): give it the code from the Forge repository (which holds A1111's history too).

    git -C FORGE_REPO show d6228060:modules/sd_models.py > a1111_sd_models.py   # A1111 1.7-era
    git -C FORGE_REPO archive HEAD backend packages_3rdparty | tar -x -C forge/
    pip install --no-deps --target forge_deps gguf                               # Forge's backend imports it
    git -C GENERATIVE_MODELS_REPO archive HEAD sgm | tar -x -C sgm/              # A1111's SDXL code
    PYTHONPATH=.:tests .venv-torch/bin/python benchmarks/webui_check.py --a1111 a1111_sd_models.py --sgm sgm \
        --forge forge --forge-deps forge_deps [--forge-args --attention-pytorch]

A1111: its own `apply_token_merging` (its source, executed with its `tomesd` pointed at the extension's WebUITomesd)
over the passes 0.5, 0.3, 0.5, 0 on the tiny LDM model. Forge: its own UnetPatcher, IntegratedUNet2DConditionModel
(SD1- and SDXL-shaped, random weights) and `calc_cond_uncond_batch`, with `backend.misc.tomesd.TomePatcher` replaced
as the extension does and called as Forge's `apply_token_merging` calls it; its Flux too, and beside ComfyUI's Flux
with the same weights. Prints the change each makes."""
from __future__ import annotations

import argparse
import ast
import sys

import torch


def _a1111_function(path: str, module) -> dict:
    """A1111's own apply_token_merging, from its source, with its global `tomesd` set to `module`."""
    source = open(path).read()
    function = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef)
                    and n.name == "apply_token_merging")
    namespace = {"tomesd": module}
    exec(ast.get_source_segment(source, function), namespace)
    return namespace["apply_token_merging"]


def a1111(path: str) -> None:
    import tiny_torch as T
    from tomesd.webui.a1111 import WebUIChoice, WebUITomesd

    for choice in (WebUIChoice(), WebUIChoice(method="ToDo"), WebUIChoice(method="recommended")):
        said: list = []
        apply_token_merging = _a1111_function(path, WebUITomesd(lambda: choice, size=lambda: (640, 640),
                                                                say=said.append))
        model, (x, t, c) = T.ldm_model(), T.unet_inputs(2, 16, 16)
        with torch.no_grad():
            plain = model.model.diffusion_model(x, t.expand(2), c)
            changes = []
            for ratio in (0.5, 0.3, 0.5, 0):
                apply_token_merging(model, ratio)
                changes.append(float((model.model.diffusion_model(x, t.expand(2), c) - plain).abs().max()))
        print(f"A1111 {choice.method}: largest change per pass {[round(v, 4) for v in changes]}, "
              f"{len(said)} console lines")


def a1111_sdxl(a1111_path: str, sgm_root: str) -> None:
    """A1111's SDXL: Stability's sgm UNet (SDXL-shaped, tiny, random weights) inside the shape of sgm's DiffusionEngine,
    under A1111's own apply_token_merging: as shipped (tomesd 0.1.3) and with the extension."""
    import types

    import tomesd
    from references import load_tomesd_ref
    from tomesd.webui.a1111 import WebUIChoice, WebUITomesd

    for name, folder in (("sgm", "sgm"), ("sgm.modules", "sgm/modules")):  # their __init__s import lightning, kornia
        package = types.ModuleType(name)
        package.__path__ = [f"{sgm_root}/{folder}"]
        sys.modules[name] = package
    from sgm.modules.diffusionmodules.openaimodel import UNetModel

    torch.manual_seed(0)
    net = UNetModel(in_channels=4, model_channels=32, out_channels=4, num_res_blocks=1, attention_resolutions=[2, 4],
                    channel_mult=(1, 2, 2), num_head_channels=8, transformer_depth=[0, 1, 1], context_dim=32,
                    use_linear_in_transformer=True, num_classes="sequential", adm_in_channels=64).eval()
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn_like(p) / p[0].numel() ** 0.5 if p.ndim >= 2 else 1 + 0.1 * torch.randn_like(p))
    engine = torch.nn.Module()  # sgm's DiffusionEngine's shape: .model.diffusion_model, a conditioner
    engine.model, engine.conditioner = torch.nn.Module(), torch.nn.Module()
    engine.model.diffusion_model = net
    gen = torch.Generator().manual_seed(1)
    x, c, y = torch.randn(2, 4, 32, 32, generator=gen), torch.randn(2, 7, 32, generator=gen), torch.randn(2, 64, generator=gen)

    def run():
        with torch.no_grad():
            return net(x, torch.full((2,), 10), context=c, y=y)

    plain = run()
    for label, module in [("as shipped (tomesd 0.1.3)", load_tomesd_ref())] + [
            (str(choice), WebUITomesd(lambda choice=choice: choice)) for choice in
            (WebUIChoice(), WebUIChoice(levels="4"), WebUIChoice(method="ToDo"), WebUIChoice(proportional_attention=True))]:
        apply_token_merging = _a1111_function(a1111_path, module)
        changes = []
        for ratio in (0.5, 0.3, 0.5, 0):
            apply_token_merging(engine, ratio)
            changes.append(round(float((run() - plain).abs().max()), 4))
        left = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in net.modules())
        print(f"A1111 SDXL (sgm) {label}: largest change per pass {changes}, hooks left {left}")


def forge(root: str, deps: str, forge_args: list) -> None:
    sys.argv = ["webui", "--always-cpu", *forge_args]
    sys.path[:0] = [root, deps]
    import backend.args  # noqa: F401  (Forge parses its arguments at import)
    import backend.misc.tomesd as misc
    from backend.nn.unet import IntegratedUNet2DConditionModel
    from backend.patcher.unet import UnetPatcher
    from backend.sampling import sampling_function
    from backend.sampling.condition import Condition, ConditionCrossAttn
    from diffusers import DDIMScheduler

    import tomesd
    from tomesd.webui.a1111 import WebUIChoice
    from tomesd.webui.forge import forge_tome_patcher, install

    def build(sdxl: bool):
        torch.manual_seed(0)
        config = dict(in_channels=4, model_channels=32, out_channels=4, num_res_blocks=[1, 1, 1], channel_mult=(1, 2, 2),
                      num_head_channels=8, use_spatial_transformer=True, context_dim=32, use_linear_in_transformer=True,
                      transformer_depth=[0, 1, 1] if sdxl else [1, 1, 0], transformer_depth_middle=1,
                      transformer_depth_output=[0, 0, 1, 1, 1, 1] if sdxl else [1, 1, 1, 1, 0, 0])
        if sdxl:
            config.update(num_classes="sequential", adm_in_channels=2816)
        net = IntegratedUNet2DConditionModel(**config)
        with torch.no_grad():
            for p in net.parameters():
                p.copy_(torch.randn_like(p) / p[0].numel() ** 0.5 if p.ndim >= 2 else 1 + 0.1 * torch.randn_like(p))
        net.storage_dtype = net.computation_dtype = torch.float32
        net.load_device = net.offload_device = net.initial_device = torch.device("cpu")
        return UnetPatcher.from_model(net, DDIMScheduler(beta_schedule="scaled_linear"), config=None)

    def run(unet, sdxl: bool):
        gen = torch.Generator().manual_seed(1)
        x, text = torch.randn(2, 4, 32, 32, generator=gen), torch.randn(1, 7, 32, generator=gen)
        conds = {"c_crossattn": ConditionCrossAttn(text)}
        if sdxl:
            conds["y"] = Condition(torch.randn(1, 2816, generator=gen))
        with torch.no_grad():
            return sampling_function.calc_cond_uncond_batch(unet.model, [{"model_conds": conds}], None, x,
                                                            torch.full((2,), 5.0), unet.model_options)[0]

    forges_own = misc.TomePatcher
    current = {"choice": WebUIChoice()}
    install(misc, forge_tome_patcher(lambda: current["choice"]))
    for sdxl in (False, True):
        name = "SDXL" if sdxl else "SD1"
        unet = build(sdxl)
        plain = run(unet, sdxl)
        print(f"Forge {name}, Forge's own TomePatcher: change {float((run(forges_own().patch(unet, 0.5), sdxl) - plain).abs().max()):.4f}")
        for choice in (WebUIChoice(), WebUIChoice(method="ToDo"), WebUIChoice(proportional_attention=True)):
            current["choice"] = choice
            patched = misc.TomePatcher().patch(model=unet, ratio=0.5)  # as Forge's apply_token_merging calls it
            if patched is unet:
                print(f"Forge {name} {choice}: refused, the pass runs unpatched")
                continue
            with tomesd.observe(patched) as seen:
                out = run(patched, sdxl)
            sites = sorted({(s, n, m) for c in seen.calls for b in c.blocks.values() for s, v in b.sites.items()
                            for n, m in v})
            left = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in unet.model.diffusion_model.modules())
            print(f"Forge {name} {choice}: change {float((out - plain).abs().max()):.4f}, sites (tokens in, out) {sites}, "
                  f"hooks left on the UNet {left}, unpatched output as before {torch.equal(run(unet, sdxl), plain)}")


def forge_flux() -> None:
    """Forge's Flux (tiny, random weights): through Forge's sampling with the extension's TomePatcher, and beside
    ComfyUI's Flux given the same weights, both patched by apply_patch (called after forge(): Forge imported)."""
    import backend.misc.tomesd as misc
    from backend.nn.flux import IntegratedFluxTransformer2DModel
    from backend.patcher.unet import UnetPatcher
    from backend.sampling import sampling_function
    from backend.sampling.condition import Condition, ConditionCrossAttn
    from diffusers import DDIMScheduler

    import comfy_host
    import tomesd
    from tomesd.webui.a1111 import WebUIChoice
    from tomesd.webui.forge import forge_tome_patcher, install

    torch.manual_seed(0)
    shape = dict(vec_in_dim=32, context_in_dim=32, hidden_size=64, mlp_ratio=4.0, num_heads=4, depth=2,
                 depth_single_blocks=2, axes_dim=[4, 6, 6], theta=10000, qkv_bias=True, guidance_embed=False)
    net = IntegratedFluxTransformer2DModel(in_channels=4, **shape)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn_like(p) / p[0].numel() ** 0.5 if p.ndim >= 2 else 1 + 0.1 * torch.randn_like(p))
    net.storage_dtype = net.computation_dtype = torch.float32
    net.load_device = net.offload_device = net.initial_device = torch.device("cpu")
    unet = UnetPatcher.from_model(net, DDIMScheduler(beta_schedule="scaled_linear"), config=None)
    gen = torch.Generator().manual_seed(1)
    x, text, pooled = torch.randn(2, 4, 16, 16, generator=gen), torch.randn(1, 5, 32, generator=gen), torch.randn(1, 32, generator=gen)

    def run(u):
        conds = {"c_crossattn": ConditionCrossAttn(text), "y": Condition(pooled)}
        with torch.no_grad():
            return sampling_function.calc_cond_uncond_batch(u.model, [{"model_conds": conds}], None, x,
                                                            torch.full((2,), 5.0), u.model_options)[0]

    plain = run(unet)
    current = {"choice": WebUIChoice()}
    install(misc, forge_tome_patcher(lambda: current["choice"]))
    for choice in (WebUIChoice(), WebUIChoice(proportional_attention=True), WebUIChoice(method="ToDo")):
        current["choice"] = choice
        patched = misc.TomePatcher().patch(model=unet, ratio=0.5)
        if patched is unet:
            print(f"Forge Flux {choice}: refused, the pass runs unpatched")
            continue
        with tomesd.observe(patched) as seen:
            out = run(patched)
        sites = sorted({(s, n, m) for c in seen.calls for b in c.blocks.values() for s, v in b.sites.items()
                        for n, m in v})
        print(f"Forge Flux {choice}: change {float((out - plain).abs().max()):.4f}, sites {sites}, unpatched output "
              f"as before {torch.equal(run(unet), plain)}")
    comfy_host.import_comfy()
    import comfy.ops
    from comfy.ldm.flux.model import Flux

    comfy_flux = Flux(in_channels=4, out_channels=4, patch_size=2, operations=comfy.ops.disable_weight_init,
                      dtype=torch.float32, device="cpu", **shape)
    comfy_flux.load_state_dict(net.state_dict())
    t, context, y = torch.full((2,), 0.5), torch.randn(2, 5, 32, generator=gen), torch.randn(2, 32, generator=gen)

    def call(model):
        with torch.no_grad():
            return model(x, t, context=context, y=y)

    base = call(net)
    print(f"Forge Flux against ComfyUI's Flux, same weights, unpatched: {float((base - call(comfy_flux)).abs().max()):.1e}")
    for settings in (dict(ratio=0.5), dict(ratio=0.5, merge_mlp=True), dict(ratio=0.75, merge_mlp=True)):
        outputs = []
        for model in (net, comfy_flux):
            tomesd.apply_patch(model, **settings)
            outputs.append(call(model))
            tomesd.remove_patch(model)
        print(f"  {settings}: ToMe changes Forge's by {float((outputs[0] - base).abs().max()):.3f}, Forge's against "
              f"ComfyUI's {float((outputs[0] - outputs[1]).abs().max()):.1e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a1111", help="A1111's modules/sd_models.py")
    parser.add_argument("--sgm", help="a folder holding Stability's sgm/ (generative-models), for A1111's SDXL")
    parser.add_argument("--forge", help="a folder holding Forge's backend/ and packages_3rdparty/")
    parser.add_argument("--forge-deps", default="", help="a folder with gguf (Forge's backend imports it)")
    parser.add_argument("--forge-args", nargs="*", default=[], help="Forge's own arguments (--attention-pytorch)")
    args = parser.parse_args()
    if args.a1111:
        a1111(args.a1111)
        if args.sgm:
            a1111_sdxl(args.a1111, args.sgm)
    if args.forge:
        forge(args.forge, args.forge_deps, args.forge_args)
        forge_flux()


if __name__ == "__main__":
    main()
