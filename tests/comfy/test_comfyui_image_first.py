"""ComfyUI's families whose blocks put the image first, [image, text], beyond test_comfyui.py's contract (EXPECTED:
tokens per site, the clone untouched, bit for bit after; test_text_tokens_never_merge): HunyuanVideo's and HiDream-I1's
rotary rows following each sample's merged tokens, HunyuanVideo's attention output unmerged before its block splits it,
a sampler run each, and the refusals (condition tokens that would join the image's, ToDo)."""
from __future__ import annotations

import pytest
import torch

import comfy_host
import tomesd

comfy_host.import_comfy()

from test_comfyui import _inputs, _model, tome, todo  # noqa: E402


# ---- HunyuanVideo (and 1.5: the same class, test_comfyui.py's EXPECTED) ----

def test_hunyuan_video_rotary_rows_follow_each_samples_merged_tokens(monkeypatch):
    """Rows `pe` [B, 1, image + text, ...] with the image first: in the double block the image's rows follow each
    sample's merged tokens and the text's stay after them; in the single block the text's rows are the merge's tail."""
    import comfy.ldm.flux.math as flux_math

    model = _model("hunyuan_video")
    args, conds = _inputs("hunyuan_video")
    rows = []
    rope = flux_math.apply_rope
    monkeypatch.setattr(flux_math, "apply_rope", lambda q, k, pe: rows.append(pe) or rope(q, k, pe))
    comfy_host.run(model, *args, **conds)
    plain = rows[:]  # the double and the single block's rows, unpatched
    rows.clear()
    patched = tome(model)
    with tomesd.observe(patched) as seen:
        comfy_host.run(patched, *args, **conds)
    assert len(rows) == len(plain) == 2
    double, single = (seen.calls[0].blocks[i].merge.representatives for i in (0, 1))
    assert double.shape == (2, 24) and single.shape == (2, 30) and not torch.equal(double[0], double[1])
    assert rows[0].shape[2] == 24 + 6 and torch.equal(rows[0][:, :, 24:], plain[0][:, :, 48:])
    for b in range(2):
        assert torch.equal(rows[0][b, :, :24], plain[0][b, :, double[b]])
        assert torch.equal(single[b, 24:], torch.arange(48, 54))  # the text passes whole, in place
        assert torch.equal(rows[1][b], plain[1][b, :, single[b]])


def test_hunyuan_video_attention_output_unmerges_before_its_block_splits_it(monkeypatch):
    """The flipped double block splits its attention's output at the block input's image length: the output's
    merged image (its first 24 tokens) unmerges at the attention function, so the image's output projection gets the
    48 image tokens, each its merged row, and the text's gets the text's 6 rows exactly."""
    import comfy.ldm.flux.layers as flux_layers

    model = _model("hunyuan_video")
    args, conds = _inputs("hunyuan_video")
    outputs, inputs = [], {}
    attention = flux_layers.attention
    monkeypatch.setattr(flux_layers, "attention", lambda *a, **k: outputs.append(attention(*a, **k)) or outputs[-1])
    block = model.model.diffusion_model.double_blocks[0]
    handles = [layer.register_forward_pre_hook(lambda m, a, name=name: inputs.setdefault(name, a[0].clone()))
               for name, layer in (("image", block.img_attn.proj), ("text", block.txt_attn.proj))]
    patched = tome(model)
    try:
        with tomesd.observe(patched) as seen:
            comfy_host.run(patched, *args, **conds)
    finally:
        for handle in handles:
            handle.remove()
    merged = outputs[0]  # the double block's attention output, as the host's function returned it: [B, 24 + 6, C]
    assert merged.shape[1] == 30 and inputs["image"].shape[1] == 48
    assert torch.equal(inputs["text"], merged[:, 24:])
    assert torch.equal(inputs["image"], seen.calls[0].blocks[0].merge.unmerge(merged[:, :24]))
    assert flux_layers.attention.__name__ == "<lambda>"  # the seam is gone after the call: the name as it was bound


def test_hunyuan_video_runs_in_a_sampler():
    import comfy.ldm.flux.layers as flux_layers

    attention = flux_layers.attention
    model = _model("hunyuan_video")
    latent = {"samples": torch.randn(1, 4, 3, 8, 8, generator=torch.Generator().manual_seed(3))}
    plain = comfy_host.sample(model, steps=2, cfg=1.0, latent=latent, pooled=True)
    patched = tome(model, mlp=0.5)
    with tomesd.observe(patched) as seen:
        out = comfy_host.sample(patched, steps=2, cfg=1.0, latent=latent, pooled=True)
    assert torch.isfinite(out).all() and (out - plain).abs().max() > 1e-3
    assert len(seen.calls) == 2 and all(call.merged_blocks("attn") == [0, 1] for call in seen.calls)
    assert all(call.merged_blocks("mlp") == [0] for call in seen.calls)
    assert flux_layers.attention is attention  # ComfyUI's function, bound as it was


def test_hunyuan_video_refusals(monkeypatch):
    """Condition tokens that would join the image's are refused at the call: the token_replace image-to-video
    model's first frame (guiding_frame_index), a reference latent (ref_latent), a text mask over every key. ToDo has no
    seam. And a block whose attention function was swapped after the patch armed the seam is refused, not merged."""
    import comfy.ldm.flux.layers as flux_layers

    original = flux_layers.attention
    model = _model("hunyuan_video")
    args, conds = _inputs("hunyuan_video")
    base = comfy_host.run(model, *args, **conds)
    for given, why in ((dict(guiding_frame_index=torch.zeros(1)), r"guiding_frame_index: HunyuanVideo-I2V"),
                       (dict(ref_latent=torch.randn(2, 4, 1, 8, 8)), r"reference latent's tokens .*ref_latent"),
                       (dict(attention_mask=torch.ones(2, 6)), r"given an attention mask")):
        with pytest.raises(ValueError, match=why + ".*Bypass the ToMe node"):
            comfy_host.run(tome(model), *args, **given, **conds)
    with pytest.raises(ValueError, match=r"ToDo node: ComfyUI's HunyuanVideo rotates .*Use the ToMe node on this"):
        todo(model)
    block = model.model.diffusion_model.double_blocks[0]
    # Other code rebinds the name under the armed seam. Not by monkeypatch: its undo would bind again what it found
    # there, the seam's wrapper, after the seam was gone.
    handle = block.register_forward_pre_hook(lambda m, a: setattr(flux_layers, "attention", original))
    try:
        with pytest.raises(RuntimeError, match="armed comfy.ldm.flux.layers:attention .* made no call of it"):
            comfy_host.run(tome(model), *args, **conds)
    finally:
        handle.remove()
        flux_layers.attention = original
    assert torch.equal(comfy_host.run(model, *args, **conds), base)


@pytest.mark.parametrize("family", ["hunyuan_video", "hidream"])
def test_proportional_attention_weighs_the_image_keys_where_they_sit(family, monkeypatch):
    """Under ComfyUI's pytorch attention the ToMe node's proportional_attention weighs each merged attention's keys:
    where the merged image's keys are fewer than the attention's, they are its first keys (the text after them)."""
    import importlib

    import torch.nn.functional as F

    from tomesd.backends import torch_sdpa
    from tomesd.comfyui.nodes import ToMe

    sdpa = F.scaled_dot_product_attention
    attention = importlib.import_module("comfy.ldm.modules.attention")
    for name in ("comfy.ldm.flux.math", "comfy.ldm.hidream.model"):
        monkeypatch.setattr(importlib.import_module(name), "optimized_attention", attention.attention_pytorch)
    model = _model(family)
    args, conds = _inputs(family)
    weighed = []
    weigh = torch_sdpa.KeyWeights.widened_for_default_scale  # at ComfyUI's attention override
    monkeypatch.setattr(torch_sdpa.KeyWeights, "widened_for_default_scale", lambda self, q, k, *a: weighed.append(
        (self.first, self.log_sizes.shape[-1], k.shape[-2])) or weigh(self, q, k, *a))
    plain = comfy_host.run(ToMe().patch(model, 0.5, 0.0, 0.0, "auto", "", True, 1, 0.0, 1.0, "", False)[0], *args,
                           **conds)
    out = comfy_host.run(ToMe().patch(model, 0.5, 0.0, 0.0, "auto", "", True, 1, 0.0, 1.0, "", True)[0], *args, **conds)
    assert len(weighed) == 2 and (out - plain).abs().max() > 1e-3  # both blocks' attentions
    assert all(first for first, merged, keys in weighed if merged < keys)
    assert any(merged < keys for _, merged, keys in weighed)
    assert F.scaled_dot_product_attention is sdpa  # the node's patch is off again after its call


# ---- HiDream-I1 ----

def test_hidream_rotary_rows_follow_each_samples_merged_tokens(monkeypatch):
    """Both blocks' attentions get rows [B, image + text, 1, ...] whose text rows are as they were and whose image
    rows are, per sample, each merged token's representative's: the image's rows are the first, the text's after."""
    import comfy.ldm.hidream.model as hidream

    model = _model("hidream")
    args, conds = _inputs("hidream")
    rows = []
    rope = hidream.apply_rope
    monkeypatch.setattr(hidream, "apply_rope", lambda q, k, freqs: rows.append(freqs) or rope(q, k, freqs))
    comfy_host.run(model, *args, **conds)
    plain = rows[:]  # the double and the single block's rows, unpatched (one table: the root's)
    rows.clear()
    patched = tome(model)
    with tomesd.observe(patched) as seen:
        comfy_host.run(patched, *args, **conds)
    assert len(rows) == len(plain) == 2
    for index, got in enumerate(rows):
        reps = seen.calls[0].blocks[index].merge.representatives  # [B, 32]: one matching per sample
        assert reps.shape == (2, 32) and not torch.equal(reps[0], reps[1])
        text = plain[index].shape[1] - 64
        assert got.shape[1] == 32 + text
        assert torch.equal(got[:, 32:], plain[index][:, 64:])  # the text's rows untouched, after the image's
        for b in range(2):
            assert torch.equal(got[b, :32], plain[index][b, reps[b]])


def test_hidream_single_blocks_pass_their_text_whole():
    """The single block's attention sees [image, text]: the image (first) merges, the 19 text tokens after it reach
    the attention's projections as they were given (test_comfyui.py checks the double block's text, which has
    layers of its own)."""
    model = _model("hidream")
    args, conds = _inputs("hidream")
    block = model.model.diffusion_model.single_stream_blocks[0].block
    seen = {}
    layers = {"attn1": block.attn1, "to_q": block.attn1.to_q}
    handles = [layer.register_forward_pre_hook(lambda m, a, name=name: seen.setdefault(name, a[0].clone()))
               for name, layer in layers.items()]
    try:
        comfy_host.run(tome(model, mlp=0.5), *args, **conds)
    finally:
        for handle in handles:
            handle.remove()
    given, merged = seen["attn1"], seen["to_q"]  # the block's tokens as given, and as the projections saw them
    assert given.shape[1] == 83 and merged.shape[1] == 51
    assert torch.equal(merged[:, -19:], given[:, -19:])
    assert not torch.equal(merged[:, :32], given[:, :32])  # the image's tokens did merge


def _hidream_sample(model, latent):
    """KSampler (euler, 2 steps, no guidance: one call per step) with HiDream's conditioning: T5 tokens, a pooled
    vector and Llama layers."""
    import nodes

    gen = torch.Generator().manual_seed(100)

    def cond(scale):
        return [[scale * torch.randn(1, 7, 32, generator=gen),
                 {"pooled_output": scale * torch.randn(1, 32, generator=gen),
                  "conditioning_llama3": scale * torch.randn(1, 2, 6, 32, generator=gen)}]]

    return nodes.KSampler().sample(model, 0, 2, 1.0, "euler", "normal", cond(1.0), cond(0.0), latent)[0]["samples"]


def test_hidream_runs_in_a_sampler():
    model = _model("hidream")
    latent = {"samples": torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(3))}
    plain = _hidream_sample(model, latent)
    patched = tome(model, mlp=0.5)
    with tomesd.observe(patched) as seen:
        out = _hidream_sample(patched, latent)
    assert torch.isfinite(out).all() and (out - plain).abs().max() > 1e-3
    assert len(seen.calls) == 2 and all(call.merged_blocks("attn") == [0, 1] for call in seen.calls)
    assert all(call.merged_blocks("mlp") == [0, 1] for call in seen.calls)


def test_hidream_refusals():
    """HiDream-E1's condition image joins the latent along the width (its tokens beside the target's in every row):
    refused at the call. ToDo has no seam (keys projected from the tokens given, attention a plain function)."""
    model = _model("hidream")
    args, conds = _inputs("hidream")
    condition = torch.randn(2, 4, 16, 16)
    base = comfy_host.run(model, *args, image_cond=condition, **conds)
    with pytest.raises(ValueError, match=r"condition image \(image_cond: HiDream-E1's edit\).*Bypass the ToMe node"):
        comfy_host.run(tome(model), *args, image_cond=condition, **conds)
    assert torch.equal(comfy_host.run(model, *args, image_cond=condition, **conds), base)
    with pytest.raises(ValueError, match=r"ToDo node: ComfyUI's HiDream .*Use the ToMe node on this model"):
        todo(model)
