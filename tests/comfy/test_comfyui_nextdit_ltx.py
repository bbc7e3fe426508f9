"""ComfyUI's NextDiT (Lumina 2 and Z-Image), LTX-Video and Cosmos Predict2 under the nodes, beyond test_comfyui.py's
contract (where EXPECTED holds their tokens in and out per site, the input MODEL untouched, bit for bit): the caption
and Z-Image's pad tokens pass whole, each its own row; the rotary rows follow each sample's merged tokens; LTX-Video's
guide frames (keyframe_idxs) pass whole; Cosmos Predict2's blocks on the grid [B, T, H, W, D] merge around their
attentions; a sampler run merges in every step and leaves the input MODEL as it was; ToDo is refused at the node,
naming the ToMe node."""
from __future__ import annotations

import pytest
import torch

import comfy_host
import tomesd

comfy_host.import_comfy()

from test_comfyui import _inputs, _model, tome, todo  # noqa: E402

# name -> (image tokens, pad tokens after them, caption tokens before them in the main layers)
NEXTDIT = {"lumina2": (64, 0, 7), "zimage": (36, 28, 32)}


def _qkv_inputs(model, net, args, conds) -> dict:
    """What the noise refiner's and the first main layer's attentions project (their qkv's input: merged tokens)."""
    seen = {}
    sites = {"refiner": net.noise_refiner[0].attention.qkv, "layer": net.layers[0].attention.qkv}
    handles = [module.register_forward_pre_hook(lambda m, a, key=key: seen.setdefault(key, a[0].clone()))
               for key, module in sites.items()]
    try:
        comfy_host.run(model, *args, **conds)
    finally:
        for handle in handles:
            handle.remove()
    return seen


@pytest.mark.parametrize("name", sorted(NEXTDIT))
def test_nextdit_caption_and_pad_tokens_pass_whole(name):
    """Only image tokens merge: the caption (before the image in the main layers) and Z-Image's pad tokens (after it)
    keep a row each, holding their own token alone, and reach the attention as they would unpatched."""
    n, pad, caption = NEXTDIT[name]
    model = _model(name)
    args, conds = _inputs(name)
    net = model.model.diffusion_model
    plain = _qkv_inputs(model, net, args, conds)
    patched = tome(model)
    with tomesd.observe(patched) as seen:
        merged = _qkv_inputs(patched, net, args, conds)
    m = n - n // 2
    assert merged["refiner"].shape[1] == m + pad and merged["layer"].shape[1] == caption + m + pad
    assert torch.equal(merged["refiner"][:, m:], plain["refiner"][:, n:])  # the pad tokens, as they were
    assert torch.equal(merged["layer"][:, :caption], plain["layer"][:, :caption])  # the caption, as it was
    for block, head in ((0, 0), (1, caption)):
        rows = seen.calls[0].blocks[block].merge.sample_rows()  # [B, tokens]: each token's merged row
        assert torch.equal(rows[:, :head], torch.arange(head).expand(2, head))
        assert torch.equal(rows[:, head + n:], torch.arange(head + m, head + m + pad).expand(2, pad))
        image = rows[:, head:head + n]
        assert image.min() == head and image.max() == head + m - 1  # image tokens only in the image's rows


def test_nextdit_rotary_rows_follow_each_samples_merged_tokens(monkeypatch):
    """Each block's rows [B, S, 1, ...] over [caption, image, pad] (the noise refiner's over [image, pad]) reach
    the attention as each merged row's representative's, per sample: the caption's and pads' as they were."""
    import comfy.ldm.lumina.model as lumina

    model = _model("zimage")
    args, conds = _inputs("zimage")
    rows = []
    rope = lumina.apply_rope
    monkeypatch.setattr(lumina, "apply_rope", lambda q, k, freqs: rows.append(freqs) or rope(q, k, freqs))
    comfy_host.run(model, *args, **conds)
    plain = list(rows)  # context refiner, noise refiner, layers 0 and 1
    rows.clear()
    patched = tome(model)
    with tomesd.observe(patched) as seen:
        comfy_host.run(patched, *args, **conds)
    assert len(rows) == len(plain) == 4 and torch.equal(rows[0], plain[0])  # the context refiner: unmerged
    for block, call, head in ((0, 1, 0), (1, 2, 32)):
        reps = seen.calls[0].blocks[block].merge.representatives  # [B, M]: one matching per sample
        assert reps.shape == (2, head + 18 + 28) and not torch.equal(reps[0], reps[1])
        assert torch.equal(reps[:, :head], torch.arange(head).expand(2, head))
        for b in range(2):
            assert torch.equal(rows[call][b], plain[call][b, reps[b]])


def _ltxv_qkv(model, args, conds) -> torch.Tensor:
    """Block 0's attn1 query input (merged tokens)."""
    seen = []
    layer = model.model.diffusion_model.transformer_blocks[0].attn1.to_q
    handle = layer.register_forward_pre_hook(lambda m, a: seen.append(a[0].clone()))
    try:
        comfy_host.run(model, *args, **conds)
    finally:
        handle.remove()
    return seen[0]


def test_ltxv_rotary_rows_follow_and_guide_frames_pass_whole(monkeypatch):
    """attn1's rows `pe` [B, 1, N, ...] follow each sample's merged tokens. A guide frame appended to the latent
    (LTXVAddGuide: keyframe_idxs for its tokens, the latent's last frame) passes whole: the target's 2 frames of
    8x8 tokens merge, the guide's 64 tokens reach attn1 as they would unpatched, with their own rows."""
    import comfy.ldm.lightricks.model as ltxv

    model = _model("ltxv")
    args, conds = _inputs("ltxv")
    rows = []
    rope = ltxv.apply_rope1
    monkeypatch.setattr(ltxv, "apply_rope1", lambda x, freqs: rows.append(freqs) or rope(x, freqs))
    guides = dict(conds, keyframe_idxs=torch.zeros(2, 3, 64))
    plain_q = _ltxv_qkv(model, args, guides)
    plain = rows[0]
    rows.clear()
    patched = tome(model)
    with tomesd.observe(patched) as seen:
        merged_q = _ltxv_qkv(patched, args, guides)
    assert seen.calls[0].blocks[0].tokens("attn") == [(192, 128)]  # 128 target tokens -> 64, and 64 guide tokens
    assert torch.equal(merged_q[:, 64:], plain_q[:, 128:])
    reps = seen.calls[0].blocks[0].merge.representatives
    assert torch.equal(reps[:, 64:], torch.arange(128, 192).expand(2, 64)) and not torch.equal(reps[0], reps[1])
    for b in range(2):
        assert torch.equal(rows[0][b, :, :], plain[b, :, reps[b]])
    with pytest.raises(ValueError, match="keyframe_idxs of shape \\[2, 3, 40\\].*whole frames"):
        comfy_host.run(patched, *args, **dict(conds, keyframe_idxs=torch.zeros(2, 3, 40)))


def _sample(model, latent, conds: dict) -> torch.Tensor:
    import nodes

    gen = torch.Generator().manual_seed(100)
    positive = [[torch.randn(1, 7, 32, generator=gen), dict(conds)]]
    negative = [[torch.zeros(1, 7, 32), dict(conds)]]
    return nodes.KSampler().sample(model, 0, 4, 2.0, "euler", "normal", positive, negative, latent)[0]["samples"]


@pytest.mark.parametrize("name", ["lumina2", "zimage", "ltxv"])
def test_runs_in_a_sampler_and_leaves_its_input_model_alone(name):
    model = _model(name)
    shape = {"ltxv": (1, 4, 3, 8, 8), "zimage": (1, 4, 12, 12)}.get(name, (1, 4, 16, 16))
    latent = {"samples": torch.randn(shape, generator=torch.Generator().manual_seed(3))}
    conds = {"attention_mask": torch.ones(1, 7, dtype=torch.long)} if name == "ltxv" else {}
    plain = _sample(model, latent, conds)
    patched = tome(model, crossattn=0.5 if name == "ltxv" else 0.0, mlp=0.5)
    with tomesd.observe(patched) as seen:
        out = _sample(patched, latent, conds)
    assert torch.isfinite(out).all() and (out - plain).abs().max() > 1e-3
    assert len(seen.calls) == 4 and all(call.merged_blocks("mlp") == [0, 1, 2][:len(call.blocks)]
                                        for call in seen.calls)
    if name == "ltxv":  # the text cross-attention's queries merge too; its mask addresses the text keys only
        assert all(call.merged_blocks("crossattn") == [0, 1] for call in seen.calls)
    assert torch.equal(_sample(model, latent, conds), plain)  # bit for bit after


@pytest.mark.parametrize("name, family", [("lumina2", "Lumina 2 / Z-Image"), ("ltxv", "LTX-Video")])
def test_todo_is_refused_at_the_node(name, family):
    """No seam takes these models' image keys alone (NextDiT: one fused qkv, rotated inside; LTX-Video: keys rotated
    by rows for every token inside attn1); LTX-Video's block shares the UNets' class name, whose ToDo it must not
    get."""
    with pytest.raises(ValueError, match=f"ToDo node: .*Use the ToMe node on this model \\({family}\\)"):
        todo(_model(name))


@pytest.mark.parametrize("name", ["zimage", "ltxv"])
def test_proportional_attention_weighs_the_merged_keys_under_pytorch_attention(name, monkeypatch):
    """Under ComfyUI's pytorch attention (--use-pytorch-cross-attention) each merged self-attention weighs its keys,
    the caption's and pads' as one token each; the output moves. (Every other attention of ComfyUI's:
    test_comfyui_attention_kernels.py.)"""
    import comfy.ldm.lumina.model as lumina
    import comfy.ldm.modules.attention as attention
    from tomesd.backends import torch_sdpa
    from tomesd.comfyui.nodes import ToMe

    for module, attr in ((lumina, "optimized_attention_masked"), (attention, "optimized_attention")):
        monkeypatch.setattr(module, attr, attention.attention_pytorch)
    model = _model(name)
    args, conds = _inputs(name)
    node = ToMe()
    settings = (model, 0.5, 0.0, 0.0, "auto", "", True, 1, 0.0, 1.0, "")
    plain = comfy_host.run(node.patch(*settings, False)[0], *args, **conds)
    weighed = []
    weigh = torch_sdpa.KeyWeights.widened_for_default_scale  # at ComfyUI's attention override
    monkeypatch.setattr(torch_sdpa.KeyWeights, "widened_for_default_scale",
                        lambda self, *a: weighed.append(self.log_sizes) or weigh(self, *a))
    out = comfy_host.run(node.patch(*settings, True)[0], *args, **conds)
    assert len(weighed) == (3 if name == "zimage" else 2)  # every merged block's self-attention
    if name == "zimage":  # the main layers' caption (32) and pads (28) weigh as one token each: log 1 = 0
        assert weighed[1].shape[-1] == 32 + 18 + 28
        assert not weighed[1][..., :32].any() and not weighed[1][..., -28:].any()
        assert weighed[1][..., 32:50].max() > 0
    assert (out - plain).abs().max() > 1e-3


# ---- Cosmos Predict2 (MiniTrainDIT): blocks on the grid [B, T, H, W, D] ----

def test_cosmos_rotary_rows_follow_each_samples_merged_tokens(monkeypatch):
    """The self-attention's rows [1, L, 1, 1, ...] (one table for the batch) reach its rotation as each sample's
    merged rows' representatives' rows; the block's grid comes back whole ([B, T, H, W, D]) for its MLP."""
    import comfy.ldm.cosmos.predict2 as cosmos

    model = _model("cosmos")
    args, conds = _inputs("cosmos")
    rows, grids = [], []
    rope = cosmos.apply_rotary_pos_emb
    monkeypatch.setattr(cosmos, "apply_rotary_pos_emb", lambda t, freqs: rows.append(freqs) or rope(t, freqs))
    block = model.model.diffusion_model.blocks[0]
    handle = block.mlp.register_forward_pre_hook(lambda m, a: grids.append(a[0].shape))
    try:
        comfy_host.run(model, *args, **conds)
        plain = rows[0]
        rows.clear()
        patched = tome(model)
        with tomesd.observe(patched) as seen:
            comfy_host.run(patched, *args, **conds)
    finally:
        handle.remove()
    assert plain.shape[:2] == (1, 48) and grids[0] == grids[-1] == (2, 3, 4, 4, 32)
    reps = seen.calls[0].blocks[0].merge.representatives  # [B, M]: one matching per sample
    assert reps.shape == (2, 24) and not torch.equal(reps[0], reps[1])
    for b in range(2):
        assert torch.equal(rows[0][b], plain[0, reps[b]])


def test_cosmos_runs_in_a_sampler_and_refuses_todo_and_an_mlp_ratio():
    model = _model("cosmos")
    latent = {"samples": torch.randn(1, 16, 3, 8, 8, generator=torch.Generator().manual_seed(3))}
    plain = _sample(model, latent, {})
    patched = tome(model, crossattn=0.5)
    with tomesd.observe(patched) as seen:
        out = _sample(patched, latent, {})
    assert torch.isfinite(out).all() and (out - plain).abs().max() > 1e-3
    assert len(seen.calls) == 4 and all(call.merged_blocks("crossattn") == [0, 1] for call in seen.calls)
    assert torch.equal(_sample(model, latent, {}), plain)  # bit for bit after
    with pytest.raises(ValueError, match=r"ToDo node: .*Use the ToMe node on this model \(Cosmos Predict2\)"):
        todo(model)
    with pytest.raises(ValueError, match="ToMe node: mlp_ratio 0.5 would change nothing: .*MLP run on the token grid"):
        tome(model, mlp=0.5)
