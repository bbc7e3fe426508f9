"""The nodes' inputs say what they do: ratio widgets end where merging stops, and every refusal comes at the node,
before anything is patched, naming the node, the input as typed and an input or node that works (issue 39)."""
from __future__ import annotations

import re

import pytest
import torch

import comfy_host
import tomesd

comfy_host.import_comfy()

from tome_core import ToMeArgs  # noqa: E402
from tomesd.hosts.comfyui_patcher import APPLY_MODEL, WRAPPER_KEY, ComfyToMe  # noqa: E402
from tomesd.comfyui.nodes import ToDo, ToMe  # noqa: E402

SIGMA = torch.full((2,), 0.8)
RATIO_WIDGETS = ("ratio", "crossattn_ratio", "mlp_ratio")


def tome(model, ratio=0.5, crossattn=0.0, mlp=0.0, levels="auto", blocks="", reuse=1, schedule=""):
    return ToMe().patch(model, ratio, crossattn, mlp, levels, blocks, True, reuse, 0.0, 1.0, schedule)[0]


def todo(model, levels="auto", blocks=""):
    return ToDo().patch(model, 2, "nearest", levels, blocks, 0.0, 1.0)[0]


@pytest.fixture(scope="module")
def models():
    return {"sd1": comfy_host.sd1_patcher()[0], "flux": comfy_host.flux_patcher()[0], "sd3": comfy_host.sd3_patcher(),
            "wan": comfy_host.wan_patcher(), "chroma": comfy_host.chroma_patcher()}


def _flux_inputs():
    gen = torch.Generator().manual_seed(1)
    args = (torch.randn(2, 4, 16, 16, generator=gen), SIGMA, torch.randn(2, 5, 32, generator=gen))
    return args, {"y": torch.randn(2, 32, generator=gen)}


def _self_attention_tokens(model) -> set:
    args, conds = _flux_inputs()
    with tomesd.observe(model) as seen:
        comfy_host.run(model, *args, **conds)
    (call,) = seen.calls
    return {pair for block in call.blocks.values() for pair in block.sites.get("attn", [])}


# ---- ratio widgets: capped where merging stops ----

def test_ratio_widgets_end_where_merging_stops_and_say_so():
    required = ToMe.INPUT_TYPES()["required"]
    for name in RATIO_WIDGETS:
        spec = required[name][1]
        assert spec["max"] == 0.75, name  # one dst per 2x2 cell stays: 3 of 4 tokens can merge
        assert "0.75" in spec["tooltip"] and "2x2" in spec["tooltip"], name
    assert "0.75" in ToMe.INPUT_TYPES()["optional"]["ratio_schedule"][1]["tooltip"]


def test_merging_stops_at_the_cap(models):
    """The premise of the cap: at 0.75 only the dst tokens are left, and the library given more merges no more."""
    flux = models["flux"]
    assert _self_attention_tokens(tome(flux, ratio=0.75)) == {(64, 16), (69, 21)}  # 64 image tokens -> 64 / 4
    wrapper = ComfyToMe(ToMeArgs(ratio=0.95))  # the library, as the old 0.95 widget asked it
    wrapper.prepare(flux.model.diffusion_model)
    past = flux.clone()
    past.add_wrapper_with_key(APPLY_MODEL, WRAPPER_KEY, wrapper)
    assert _self_attention_tokens(past) == {(64, 16), (69, 21)}


@pytest.mark.parametrize("widget", RATIO_WIDGETS)
def test_a_ratio_past_the_cap_is_refused_before_anything_is_patched(models, widget):
    flux = models["flux"]
    values = {"ratio": 0.5, "crossattn": 0.0, "mlp": 0.0, widget.replace("_ratio", ""): 0.9}
    with pytest.raises(ValueError, match=rf"^ToMe node: {widget} asks for 0.9, above 0.75, where merging stops.*"
                                         r"Use 0.75 or less"):
        tome(flux, **values)
    assert not flux.wrappers.get(APPLY_MODEL)  # nothing put on the input MODEL
    assert sum(len(m._forward_pre_hooks) for m in flux.model.diffusion_model.modules()) == 0


def test_a_scheduled_ratio_past_the_cap_is_refused_with_the_schedule_as_typed(models):
    with pytest.raises(ValueError, match=r"ToMe node: ratio_schedule '0:0.5, 0.5:0.9' asks for 0.9, above 0.75"):
        tome(models["flux"], schedule=" 0:0.5, 0.5:0.9 ")


# ---- blocks and levels: what was typed, and what works ----

def test_blocks_out_of_range_echoes_what_was_typed(models):
    with pytest.raises(ValueError) as refused:
        tome(models["flux"], blocks="0-40")
    message = str(refused.value)
    assert message.startswith("ToMe node: blocks '0-40' reaches block 40, but this model (Flux) has blocks 0-3 "
                              "(DoubleStreamBlock 0-1, SingleStreamBlock 2-3)")
    assert "leave blocks empty" in message and "[0, 1, 2" not in message
    with pytest.raises(ValueError, match=r"ToMe node: blocks '0, 5' reaches block 5, but this model \(Wan\) has "
                                         r"blocks 0-1\. Type indices within 0-1"):
        tome(models["wan"], blocks="0, 5")


def test_levels_and_blocks_refusals_name_the_input_that_works(models):
    with pytest.raises(ValueError) as refused:
        tome(models["sd3"], levels="2")
    message = str(refused.value)
    assert message.startswith("ToMe node: levels 2 ") and "Set levels to auto" in message
    assert "blocks=[" not in message and "this model has blocks 0-1" in message
    with pytest.raises(ValueError, match=r"ToMe node: blocks '0-4' .* UNet.*Leave blocks empty and set levels"):
        tome(models["sd1"], blocks="0-4")
    with pytest.raises(ValueError, match=r"ToMe node: blocks must be .*'0-9, 12', got 'first'"):
        tome(models["flux"], blocks="first")
    with pytest.raises(ValueError, match=r"the range '3-1' runs backwards; write it as '1-3'"):
        tome(models["flux"], blocks="3-1")


# ---- refusals that name the ComfyUI node or input that works ----

@pytest.mark.parametrize("name", ["flux", "sd3", "wan"])
def test_todo_refusal_names_the_tome_node_and_its_ratio(models, name):
    with pytest.raises(ValueError) as refused:
        todo(models[name], blocks="0-40")  # ToDo's refusal comes first: no blocks would make it run
    message = str(refused.value)
    assert message.startswith("ToDo node: ") and "Use the ToMe node on this model" in message
    assert "its ratio (0.5 to start, up to 0.75)" in message
    assert not re.search(r"diffusers|mode=|apply_patch", message), message


@pytest.mark.parametrize("name", ["flux", "sd3"])
def test_crossattn_ratio_on_a_model_without_cross_attention_is_refused(models, name):
    with pytest.raises(ValueError, match=r"ToMe node: crossattn_ratio 0.5 would change nothing.*no cross-attention"
                                         r".*Set crossattn_ratio to 0"):
        tome(models[name], crossattn=0.5)


def test_ratio_schedule_refusals_name_what_to_change(models):
    with pytest.raises(ValueError, match=r"ToMe node: reuse_steps 2 cannot go with ratio_schedule.*Set reuse_steps "
                                         r"to 1"):
        tome(models["flux"], reuse=2, schedule="0:0.6, 0.5:0.3")
    with pytest.raises(ValueError, match=r"ToMe node: ratio_schedule schedules .*or clear ratio_schedule"):
        tome(models["flux"], mlp=0.3, schedule="0:0.6")
    with pytest.raises(ValueError, match=r"ToMe node: start must be below stop"):
        ToMe().patch(models["sd1"], 0.5, 0.0, 0.0, "auto", "", True, 1, 0.8, 0.5)


# ---- an attention mask over [text, image] (Chroma's text padding, regional prompts on Flux) ----

@pytest.mark.parametrize("name", ["flux", "chroma"])
def test_an_attention_mask_on_a_flux_layout_model_is_refused_naming_the_node(models, name):
    """ComfyUI passes Flux-layout models (Flux, Flux.2, Chroma) an `attention_mask` conditioning over the joined
    [text, image] sequence; merged image tokens would no longer fit it (a shape error inside the attention).
    Refused at the call, naming the model, the node and what works; without the mask the same call merges."""
    args, conds = _flux_inputs()
    if name == "chroma":  # its approximator embeds the guidance, not a pooled vector
        conds = {"guidance": torch.full((2,), 3.5)}
    n = 5 + 8 * 8  # text tokens + image tokens (a 16x16 latent in 2x2 patches)
    mask = torch.zeros(2, 1, n, n)
    patched = tome(models[name])  # (the ToDo node refuses Flux-layout models at the node, mask or not)
    with pytest.raises(ValueError, match="given an attention mask.*Bypass the ToMe node"):
        comfy_host.run(patched, *args, attention_mask=mask, **conds)
    comfy_host.run(patched, *args, **conds)
