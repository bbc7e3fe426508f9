"""The ToMe node's proportional_attention on ComfyUI's own models: under ComfyUI's pytorch attention (its default
on NVIDIA GPUs) every merged self- or joint attention weighs its keys at ComfyUI's attention override (SD3.5's second
self-attention too), and the output moves; an attention call that bypasses the override and is not torch's SDPA is
refused at the first call, naming the switch that works. (Every attention function: test_comfyui_attention_kernels.py.)"""
import importlib

import pytest
import torch
import torch.nn.functional as F

import comfy_host
import tomesd

comfy_host.import_comfy()

from test_comfyui import _inputs, _model  # noqa: E402
from tomesd.backends import torch_sdpa  # noqa: E402
from tomesd.comfyui.nodes import ToMe  # noqa: E402

SDPA = F.scaled_dot_product_attention

ATTENTION_USERS = ("comfy.ldm.modules.attention", "comfy.ldm.flux.math", "comfy.ldm.modules.diffusionmodules.mmdit",
                   "comfy.ldm.wan.model", "comfy.ldm.qwen_image.model")


def tome(model, proportional):
    return ToMe().patch(model, 0.5, 0.0, 0.0, "auto", "", True, 1, 0.0, 1.0, "", proportional)[0]


@pytest.fixture
def pytorch_attention(monkeypatch):
    """ComfyUI as started with --use-pytorch-cross-attention: its attention functions call torch's SDPA."""
    attention = importlib.import_module("comfy.ldm.modules.attention")
    for name in ATTENTION_USERS:
        module = importlib.import_module(name)
        for attr in ("optimized_attention", "optimized_attention_masked"):
            if hasattr(module, attr):
                monkeypatch.setattr(module, attr, attention.attention_pytorch)


@pytest.mark.parametrize("family, per_site", [("sd1", 1), ("flux", 1), ("sd3.5", 2), ("wan", 1),
                                              ("qwen", 1)])
def test_every_merged_attention_weighs_its_keys(family, per_site, pytorch_attention, monkeypatch):
    model = _model(family)
    args, conds = _inputs(family)
    plain = comfy_host.run(tome(model, False), *args, **conds)
    weighed = []
    weigh = torch_sdpa.KeyWeights.widened_for_default_scale  # at ComfyUI's attention override
    monkeypatch.setattr(torch_sdpa.KeyWeights, "widened_for_default_scale",
                        lambda self, *a: weighed.append(self.log_sizes.shape) or weigh(self, *a))
    patched = tome(model, True)
    with tomesd.observe(patched) as seen:
        out = comfy_host.run(patched, *args, **conds)
    sites = sum(1 for call in seen.calls for block in call.blocks.values()
                for n, m in block.sites.get("attn", []) if m < n)
    assert sites > 0 and len(weighed) == per_site * sites  # SD3.5: its joint and its image self-attention
    assert F.scaled_dot_product_attention is SDPA  # the node's patch is off again after its call
    if torch.isfinite(plain).all() and torch.isfinite(out).all():  # (the tiny SD3.5 overflows either way)
        assert (out - plain).abs().max() > 1e-3


def test_an_attention_call_that_drops_transformer_options_and_is_not_torchs_sdpa_is_refused(monkeypatch):
    """Code that calls ComfyUI's attention without the model call's transformer_options never meets the override
    (test_comfyui_attention_kernels.py); under a kernel other than torch's SDPA its keys go unweighed: refused."""
    attention = importlib.import_module("comfy.ldm.modules.attention")

    def without_options(*args, transformer_options=None, **kwargs):
        return attention.attention_sub_quad(*args, **kwargs)  # what ComfyUI picks on a CPU

    monkeypatch.setattr(importlib.import_module("comfy.ldm.flux.math"), "optimized_attention", without_options)
    model = _model("flux")
    args, conds = _inputs("flux")
    with pytest.raises(RuntimeError, match="--use-pytorch-cross-attention"):
        comfy_host.run(tome(model, True), *args, **conds)
    assert F.scaled_dot_product_attention is SDPA
