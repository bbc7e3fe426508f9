"""The Forge side of the web UI extension (tomesd/webui/forge.py) on the ModelPatcher interface Forge shares with
ComfyUI: `clone()`, `model_options`, `set_model_unet_function_wrapper`, and a sampler that calls
`model_options["model_function_wrapper"](model.apply_model, {"input", "timestep", "c", ...})`. Forge's code is not
installable here; ComfyUI 0.3.75 still serves that interface, so its ModelPatcher, UNet and KSampler stand in (Forge's
own UnetPatcher and UNet were run once by hand: docs/webui.md). Each pass is Forge's: `TomePatcher().patch(model=unet,
ratio=r)` on the pass's UNet patcher, then sampling with what it returned."""
from __future__ import annotations

import copy

import torch

import comfy_host
import tomesd

comfy_host.import_comfy()

from tomesd.webui.forge import ForgeToMe, forge_tome_patcher, install, rechain  # noqa: E402
from tomesd.webui.a1111 import WebUIChoice  # noqa: E402


def _hooks(model) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.model.diffusion_model.modules())


def test_forges_passes_merge_on_their_clone_and_leave_the_unet_bare():
    unet = comfy_host.sd1_patcher()[0]
    plain = comfy_host.sample(unet)
    said = []
    patcher = forge_tome_patcher(lambda: WebUIChoice(), say=said.append)
    outputs = []
    for ratio in (0.5, 0.3):  # the base pass, the high-res pass
        patched = patcher().patch(model=unet, ratio=ratio)
        assert patched is not unet and isinstance(patched.model_options["model_function_wrapper"], ForgeToMe)
        with tomesd.observe(patched) as seen:
            outputs.append(comfy_host.sample(patched))
        assert seen.calls and all(call.merged_blocks("attn") for call in seen.calls)
        assert _hooks(unet) == 0 and "model_function_wrapper" not in unet.model_options
    assert (outputs[0] - plain).abs().max() > 1e-3 and (outputs[1] - outputs[0]).abs().max() > 1e-4
    assert torch.equal(comfy_host.sample(unet), plain) and not said
    # Forge's clone deep-copies model_options: the copy's wrapper is the same one, and runs the same
    clone = copy.deepcopy(patched.model_options)
    assert clone["model_function_wrapper"] is patched.model_options["model_function_wrapper"]


def test_todo_and_a_wrapper_the_unet_carried_already():
    unet = comfy_host.sd1_patcher()[0].clone()
    calls = []

    def other(apply_model, params):  # another extension's wrapper, set before token merging
        calls.append(params["input"].shape)
        return apply_model(params["input"], params["timestep"], **params["c"])

    unet.set_model_unet_function_wrapper(other)
    plain = comfy_host.sample(unet)
    patched = forge_tome_patcher(lambda: WebUIChoice(method="ToDo"))().patch(model=unet, ratio=0.5)
    with tomesd.observe(patched) as seen:
        out = comfy_host.sample(patched)
    assert calls and (out - plain).abs().max() > 1e-3
    assert any(n > m for call in seen.calls for block in call.blocks.values() for n, m in block.sites.get("downsample",
                                                                                                          []))


def test_what_forge_cannot_run_is_one_line_and_the_unet_unchanged():
    unet = comfy_host.sd3_patcher()
    said = []
    back = forge_tome_patcher(lambda: WebUIChoice(), say=said.append)().patch(model=unet, ratio=0.5)
    assert back is unet and "model_function_wrapper" not in unet.model_options and _hooks(unet) == 0
    assert len(said) == 1 and said[0].startswith("[tomesd] token merging is off for this pass")
    assert "Forge's UNets (SD1, SD2, SDXL) and Flux" in said[0]
    flux = comfy_host.flux_patcher()[0]
    said.clear()
    back = forge_tome_patcher(lambda: WebUIChoice(method="ToDo"), say=said.append)().patch(model=flux, ratio=0.5)
    assert back is flux and len(said) == 1 and "mode='downsample' cannot run on DoubleStreamBlock" in said[0]
    sd1 = comfy_host.sd1_patcher()[0]
    said.clear()
    back = forge_tome_patcher(lambda: WebUIChoice(method="recommended"), size=lambda: (640, 640),
                              say=said.append)().patch(model=sd1, ratio=0.5)
    assert back is sd1 and len(said) == 1 and "sd1 at 640x640" in said[0]


def test_extensions_acting_after_token_merging():
    """Forge's own extensions act in the same pass after token merging: a self-attention patch (PAG, SAG) runs the
    pass unpatched with one line; a model function wrapper set over ours (MultiDiffusion) is put inside ours again."""
    unet = comfy_host.sd1_patcher()[0]
    said = []
    patcher = forge_tome_patcher(lambda: WebUIChoice(), say=said.append)
    patched = patcher().patch(model=unet, ratio=0.5)
    attn1 = lambda q, k, v, extra_options: (q, k, v)  # noqa: E731  (an identity self-attention patch)
    with_patch = patched.clone()
    with_patch.set_model_attn1_patch(attn1)
    plain_with_patch = unet.clone()
    plain_with_patch.set_model_attn1_patch(attn1)
    assert torch.equal(comfy_host.sample(with_patch), comfy_host.sample(plain_with_patch))
    assert len(said) == 1 and "another node patches this model's self-attention" in said[0]

    calls = []

    def tiled(apply_model, params):  # the shape of MultiDiffusion's wrapper: it calls the model itself
        calls.append(params["input"].shape)
        return apply_model(params["input"], params["timestep"], **params["c"])

    replaced = patched.clone()
    replaced.set_model_unet_function_wrapper(tiled)
    assert not isinstance(replaced.model_options["model_function_wrapper"], ForgeToMe)
    again = rechain(replaced, patcher.last)
    with tomesd.observe(again) as seen:
        out = comfy_host.sample(again)
    assert calls and seen.calls and all(call.merged_blocks("attn") for call in seen.calls)
    assert torch.equal(out, comfy_host.sample(patched))  # an identity wrapper inside: ToMe's output
    assert rechain(patched, patcher.last) is patched and rechain(replaced, None) is replaced


def test_the_recommended_setting_on_forges_flux_is_flux_s():
    flux = comfy_host.flux_patcher()[0]
    said = []
    patched = forge_tome_patcher(lambda: WebUIChoice(method="recommended"), say=said.append)().patch(model=flux,
                                                                                                      ratio=0.5)
    assert patched is not flux and not said  # the CPU pick for Flux at 1024 (ratio 0.5), not SD1's (downsampling)
    assert patched.model_options["model_function_wrapper"].args.mode == "merge"


def _flux(cls):
    import comfy.ops

    torch.manual_seed(0)
    net = cls(in_channels=4, out_channels=4, patch_size=2, vec_in_dim=32, context_in_dim=32, hidden_size=64,
              mlp_ratio=4.0, num_heads=4, depth=2, depth_single_blocks=2, axes_dim=[4, 6, 6], theta=10000,
              qkv_bias=True, guidance_embed=False, operations=comfy.ops.disable_weight_init, dtype=torch.float32,
              device="cpu")
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn_like(p) / p[0].numel() ** 0.5 if p.ndim >= 2 else 1 + 0.1 * torch.randn_like(p))
    return net.eval()


def test_forges_flux_reads_as_comfyuis_layout_patchified_by_two():
    """Forge's Flux (backend.nn.flux.IntegratedFluxTransformer2DModel) is Black Forest Labs' code as ComfyUI's is,
    under a name ending as diffusers' Flux's, patchified by a fixed 2 (it has no patch_size to read). Stand-in:
    ComfyUI's Flux under that name and module; read as Forge's, not as diffusers' Flux (which would want img_ids),
    the same weights patched as ComfyUI's give its output (Forge's own class, run by hand, equals ComfyUI's under
    ToMe to 6e-6: docs/webui.md)."""
    from comfy.ldm.flux.model import Flux

    from tomesd.families import root_kind

    stand_in = type("IntegratedFluxTransformer2DModel", (Flux,), {"__module__": "backend.nn.flux"})
    forge_flux, comfy_flux = _flux(stand_in), _flux(Flux)
    assert root_kind(forge_flux).family == "Flux (Forge)"
    gen = torch.Generator().manual_seed(1)
    x, t = torch.randn(2, 4, 16, 16, generator=gen), torch.full((2,), 0.5)
    context, y = torch.randn(2, 5, 32, generator=gen), torch.randn(2, 32, generator=gen)

    def run(net):
        with torch.no_grad():
            return net(x, t, context=context, y=y)

    plain = run(forge_flux)
    outputs = []
    for net in (forge_flux, comfy_flux):
        tomesd.apply_patch(net, ratio=0.5)
        try:
            with tomesd.observe(net) as seen:
                outputs.append(run(net))
        finally:
            tomesd.remove_patch(net)
    tokens = {n_m for call in seen.calls for block in call.blocks.values() for n_m in block.sites.get("attn", [])}
    assert tokens == {(64, 32), (69, 37)}  # double blocks: the image's 64; single blocks: 5 text + 64 -> 5 + 32
    assert (outputs[0] - plain).abs().max() > 0.1 and (outputs[0] - outputs[1]).abs().max() < 1e-5
    assert torch.equal(run(forge_flux), plain)


def test_install_replaces_forges_patcher_by_name():
    import types

    misc = types.SimpleNamespace(TomePatcher=object)
    ours = forge_tome_patcher(WebUIChoice)
    assert install(misc, ours) is object and misc.TomePatcher is ours
