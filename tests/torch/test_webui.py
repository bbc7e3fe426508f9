"""The A1111 web UI extension's logic (tomesd/webui/a1111.py) on the original LDM code, under the web UI's token
merging cycle. The web UI's code is not installable here (no package index has it), so `apply_token_merging` below
is the cycle as A1111 1.10's modules/sd_models.py runs it, and `generate` the passes of its processing.py: the base
ratio, the high-res pass's, the base again (the next generation), then 0. Each case checks that the output changes
where merging runs, that the text reaching cross-attention is whole, and that the model is unpatched afterwards."""
from __future__ import annotations

import types

import pytest
import torch

import tiny_torch as T
import tomesd
from references import load_tomesd_ref
from tomesd.webui.a1111 import WebUIChoice, WebUITomesd, install, uninstall
from tomesd.runtime.tome_patch import PATCH_ATTR

ref = load_tomesd_ref()
INPUTS = T.unet_inputs(2, 16, 16)


def apply_token_merging(sd_models, sd_model, token_merging_ratio):
    """A1111's per-pass call: unpatch when the ratio changes, patch with its fixed arguments, remember the ratio."""
    current = getattr(sd_model, "applied_token_merged_ratio", 0)
    if current == token_merging_ratio:
        return
    if current > 0:
        sd_models.tomesd.remove_patch(sd_model)
    if token_merging_ratio > 0:
        sd_models.tomesd.apply_patch(sd_model, ratio=token_merging_ratio, use_rand=False, merge_attn=True,
                                     merge_crossattn=False, merge_mlp=False)
    sd_model.applied_token_merged_ratio = token_merging_ratio


def denoise(model):
    x, t, c = INPUTS
    with torch.no_grad():
        return model.model.diffusion_model(x, t.expand(x.shape[0]), c)


def generate(sd_models, model, ratios=(0.5, 0.3, 0.5, 0)):
    """One denoiser call per pass, as processing.py sets each pass's ratio before sampling."""
    outputs = []
    for ratio in ratios:
        apply_token_merging(sd_models, model, ratio)
        outputs.append(denoise(model))
    return outputs


def webui(choice=WebUIChoice(), size=None):
    said = []
    module = types.SimpleNamespace(apply_token_merging=apply_token_merging, tomesd=ref,
                                   model_data=types.SimpleNamespace(sd_model=None))
    previous = install(module, WebUITomesd(lambda: choice, size=lambda: size, say=said.append))
    return module, previous, said


def leftovers(model):
    """Hooks and attributes anything left on the model's modules."""
    found = []
    for name, module in model.named_modules():
        hooks = module._forward_hooks or module._forward_pre_hooks
        if hooks or getattr(module, PATCH_ATTR, None) is not None or "forward" in vars(module):
            found.append(name)
    return found


def test_the_web_uis_cycle_runs_tomesd_0_1_3s_merge_and_leaves_nothing():
    model = T.ldm_model()
    plain = denoise(model)
    sd_models, previous, said = webui()
    assert previous is ref
    outputs = generate(sd_models, model)
    expected = generate(types.SimpleNamespace(tomesd=ref), T.ldm_model())  # the web UI as shipped: tomesd 0.1.3
    for ours, theirs in zip(outputs[:3], expected[:3]):
        assert (ours - plain).abs().max() > 1e-2  # merging runs
        assert (ours - theirs).abs().max() < 1e-5  # as tomesd 0.1.3's
    assert (outputs[0] - outputs[1]).abs().max() > 1e-3  # the high-res pass's own ratio
    assert torch.equal(outputs[3], plain) and not leftovers(model) and not said


def test_tiles_of_many_sizes_in_one_pass_merge_and_stay_bounded():
    """Tiled Diffusion (multidiffusion-upscaler) calls the web UI's patched model once per tile of a latent, edge tiles
    in other sizes: each tile merges, the patch keeps at most kept_sizes (16) sizes, removal leaves nothing."""
    model = T.ldm_model()
    sd_models, _, said = webui()
    apply_token_merging(sd_models, model, 0.5)
    patch = getattr(model.model.diffusion_model, PATCH_ATTR)
    sizes = [(h, w) for h in (8, 12, 16, 20, 24) for w in (8, 12, 16, 20)]  # 20 tile sizes
    for h, w in sizes * 2:
        x, t, c = T.unet_inputs(1, h, w)
        with torch.no_grad(), tomesd.observe(model) as seen:
            merged = model.model.diffusion_model(x, t.expand(1), c)
        assert seen.calls[0].merged_blocks("attn"), (h, w)
        assert len(patch.matcher.kept) <= patch.args.kept_sizes == 16
    apply_token_merging(sd_models, model, 0)
    with torch.no_grad():
        assert (model.model.diffusion_model(x, t.expand(1), c) - merged).abs().max() > 1e-3
    assert not leftovers(model) and not said


def test_a_choice_changed_between_generations_patches_anew():
    """A1111 patches again only when its ratio changes: before a generation the extension takes off a patch made for
    another choice, so the next pass (same ratio) runs the new one."""
    model = T.ldm_model()
    current = {"choice": WebUIChoice()}
    sd_models = types.SimpleNamespace(apply_token_merging=apply_token_merging, tomesd=ref,
                                      model_data=types.SimpleNamespace(sd_model=None))
    webui_tomesd = WebUITomesd(lambda: current["choice"])
    install(sd_models, webui_tomesd)
    tome = generate(sd_models, model, ratios=(0.5,))[0]
    current["choice"] = WebUIChoice(method="ToDo")
    webui_tomesd.refresh(model)  # the script's before_process
    todo = generate(sd_models, model, ratios=(0.5,))[0]
    expected = generate(webui(WebUIChoice(method="ToDo"))[0], T.ldm_model(), ratios=(0.5, 0))[0]
    assert (todo - tome).abs().max() > 1e-3 and torch.equal(todo, expected)
    webui_tomesd.refresh(model)  # same choice: the patch stays
    assert model.applied_token_merged_ratio == 0.5
    generate(sd_models, model, ratios=(0,))
    assert not leftovers(model)


def test_image_tokens_merge_and_the_text_reaching_cross_attention_is_whole():
    model = T.ldm_model()
    contexts = []
    for name, module in model.named_modules():
        if name.endswith("attn2"):  # the text, as every cross-attention gets it
            module.register_forward_pre_hook(lambda m, a, k: contexts.append(k["context"].shape[1]), with_kwargs=True)
    sd_models, _, _ = webui(WebUIChoice(levels="2", proportional_attention=True))
    apply_token_merging(sd_models, model, 0.5)
    with tomesd.observe(model) as seen:
        denoise(model)
    apply_token_merging(sd_models, model, 0)
    merged = {n_m for call in seen.calls for block in call.blocks.values() for n_m in block.sites.get("attn", [])}
    assert merged and all(m < n for n, m in merged)  # both levels' image tokens merged ...
    assert len(merged) == 2
    assert contexts and set(contexts) == {INPUTS[2].shape[1]}  # ... and all 7 text tokens reach every attn2


@pytest.mark.parametrize("choice", [WebUIChoice(method="ToDo"), WebUIChoice(levels="2"),
                                    WebUIChoice(proportional_attention=True)], ids=["todo", "levels-2", "prop"])
def test_the_extensions_choices_change_the_output_and_say_so(choice):
    model = T.ldm_model()
    plain = denoise(model)
    tome = generate(webui()[0], T.ldm_model(), ratios=(0.5, 0))[0]
    sd_models, _, said = webui(choice)
    outputs = generate(sd_models, model)
    assert (outputs[0] - plain).abs().max() > 1e-2 and (outputs[0] - tome).abs().max() > 1e-3
    assert torch.equal(outputs[3], plain) and not leftovers(model) and not said
    assert choice.infotext()  # what differs from plain ToMe goes to the generation's parameters


def test_a_setting_the_model_cannot_run_is_one_line_and_an_unpatched_pass():
    # no recommendation is recorded for SD1 at 640x640 on a CPU
    model = T.ldm_model()
    plain = denoise(model)
    sd_models, _, said = webui(WebUIChoice(method="recommended"), size=(640, 640))
    outputs = generate(sd_models, model)
    assert len(said) == 3  # a line for each pass that turns merging on (0.5, 0.3, 0.5)
    assert said[0].startswith("[tomesd] token merging is off for this pass") and "sd1 at 640x640" in said[0]
    for output in outputs:
        assert torch.equal(output, plain)
    assert not leftovers(model)


def test_proportional_attention_under_an_attention_that_cannot_weigh_is_refused_before_the_pass():
    """A1111's xformers (or sub-quadratic, ...) optimization makes no SDPA call, where merged keys are weighed."""
    model = T.ldm_model()
    plain = denoise(model)
    said = []
    sd_models = types.SimpleNamespace(apply_token_merging=apply_token_merging, tomesd=ref,
                                      model_data=types.SimpleNamespace(sd_model=None))
    install(sd_models, WebUITomesd(lambda: WebUIChoice(proportional_attention=True), say=said.append,
                                   attention=lambda: "xformers"))
    outputs = generate(sd_models, model)
    assert len(said) == 3 and "this web UI's attention is xformers" in said[0]
    assert all(torch.equal(output, plain) for output in outputs) and not leftovers(model)


def test_a_model_it_cannot_patch_is_one_line_and_an_unpatched_pass():
    model = T.LDMWrapper(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    sd_models, _, said = webui()
    apply_token_merging(sd_models, model, 0.5)
    assert len(said) == 1 and "nothing for ToMe to merge" in said[0]
    assert not leftovers(model)


def test_installing_over_a_model_tomesd_0_1_3_patched_unpatches_it_first():
    model = T.ldm_model()
    plain = denoise(model)
    sd_models = types.SimpleNamespace(apply_token_merging=apply_token_merging, tomesd=ref,
                                      model_data=types.SimpleNamespace(sd_model=model))
    apply_token_merging(sd_models, model, 0.5)  # the web UI's first generation, before the extension loaded
    assert not torch.equal(denoise(model), plain)
    previous = install(sd_models, WebUITomesd(lambda: WebUIChoice(method="ToDo")))
    assert torch.equal(denoise(model), plain) and model.applied_token_merged_ratio == 0
    apply_token_merging(sd_models, model, 0.5)
    assert not torch.equal(denoise(model), plain)
    uninstall(sd_models, previous)
    assert sd_models.tomesd is ref and torch.equal(denoise(model), plain) and not leftovers(model)


def test_forge_which_runs_its_own_copy_is_refused_by_name():
    forge_sd_models = types.SimpleNamespace(apply_token_merging=apply_token_merging)  # no `tomesd` there
    with pytest.raises(RuntimeError, match="Forge.s apply_token_merging runs its own copy"):
        install(forge_sd_models, WebUITomesd(WebUIChoice))


def test_a_choice_outside_the_settings_is_refused():
    with pytest.raises(ValueError, match="one of ToMe, ToDo, recommended"):
        WebUIChoice(method="fast")
