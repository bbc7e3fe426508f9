"""Diffusion transformers (SD3, SD3.5, PixArt, DiT) under ToMe: image tokens merge or give downsampled
keys, text tokens never change, and everything the UNets keep holds (compile, meta, copies, threads,
checkpointing, reversibility, refusals)."""
import copy
import pickle

import pytest
import torch
import torch.nn.functional as F

import tiny_torch as T
import tomesd
from probes import (
    OpCounter, assert_checkpointing_keeps_loss_and_gradients, assert_loop_compiles_once_and_equals_eager,
    assert_patch_equals_hooks_by_hand,
)
from threads import concurrent_calls
from tome_core import bipartite_soft_matching_random2d
from tomesd.runtime.tome_patch import PATCH_ATTR

TOL = 1e-5
KINDS = ("sd3", "sd35", "pixart", "dit")
JOINT = ("sd3", "sd35")


@pytest.fixture(scope="module")
def models():
    return {kind: T.transformer(kind) for kind in KINDS}


def run(model, inputs):
    return T.run_transformer(model, inputs)


def block_list(model):
    return [m for m in model.modules() if type(m).__name__ in ("JointTransformerBlock", "BasicTransformerBlock")]


def token_probe(model):
    """Records the tokens entering each image projection (queries, keys) and each text projection."""
    seen, handles = {"q": [], "k": [], "text_q": [], "text_k": []}, []
    for block in block_list(model):
        for name in ("attn", "attn1", "attn2"):
            attn = getattr(block, name, None)
            if attn is None or (name == "attn2" and type(block).__name__ == "BasicTransformerBlock"):
                continue  # PixArt's attn2 is cross-attention: its keys are the text
            for layer, key in (("to_q", "q"), ("to_k", "k"), ("add_q_proj", "text_q"), ("add_k_proj", "text_k")):
                module = getattr(attn, layer, None)
                if module is not None:
                    handles.append(module.register_forward_pre_hook(lambda m, a, key=key: seen[key].append(a[0].shape[1])))
    return seen, handles


def probe(model, inputs):
    seen, handles = token_probe(model)
    out = run(model, inputs)
    for handle in handles:
        handle.remove()
    return out, seen


@pytest.mark.parametrize("mode", ["merge", "downsample"])
@pytest.mark.parametrize("kind", KINDS)
def test_image_tokens_reduce_in_every_block_and_text_tokens_never(models, kind, mode):
    model, inputs = models[kind], T.transformer_inputs(kind)
    n = 8 * 8  # a 16x16 latent in 2x2 patches
    base, plain = probe(model, inputs)
    kwargs = dict(ratio=0.5) if mode == "merge" else dict(mode="downsample")
    tomesd.apply_patch(model, **kwargs)
    tomesd.apply_patch(model, **kwargs)  # twice equals once
    try:
        out, seen = probe(model, inputs)
    finally:
        tomesd.remove_patch(model)
    assert (out - base).abs().max().item() > 1000 * TOL
    assert plain["q"] == plain["k"] == [n] * len(plain["q"]) and len(plain["q"]) >= 3
    if mode == "merge":
        assert seen["q"] == seen["k"] == [n // 2] * len(plain["q"])
    else:
        assert seen["q"] == plain["q"] and seen["k"] == [n // 4] * len(plain["k"])
    assert seen["text_q"] == plain["text_q"] and seen["text_k"] == plain["text_k"]  # text untouched
    if kind in JOINT:
        assert plain["text_k"] == [5] * 3
    assert torch.equal(run(model, inputs), base)  # removed: bit-identical again


def hand_merge(model, kind, h=8, w=8):
    """Hooks placed by hand: the merge computed from each block's image input (top-left dst, as
    tomesd's function gives it), self-attention's image tokens merged and its image output unmerged.
    The reference shares tome_core's matching (bipartite_soft_matching_random2d) with the code under test,
    so it checks where the hooks sit; the matching's arithmetic is checked independently in
    tests/core/test_matching_by_loop.py (and against tomesd 0.1.3 in test_core_vs_tomesd.py)."""
    handles, state = [], {}
    for block in block_list(model):
        def enter(m, args, kwargs):
            x = kwargs.get("hidden_states", args[0] if args else None)
            b, n, _ = x.shape
            state["merge"], state["unmerge"] = bipartite_soft_matching_random2d(x, w, h, 2, 2, n // 2, no_rand=True)

        def merge_in(m, args, kwargs):
            if "hidden_states" in kwargs:
                return args, {**kwargs, "hidden_states": state["merge"](kwargs["hidden_states"])}
            return (state["merge"](args[0]),) + args[1:], kwargs

        def unmerge_out(m, args, out):
            if isinstance(out, tuple):  # SD3's joint attention: (image, text)
                return (state["unmerge"](out[0]),) + out[1:]
            return state["unmerge"](out)

        handles.append(block.register_forward_pre_hook(enter, with_kwargs=True))
        names = ("attn", "attn2") if kind in JOINT else ("attn1",)
        for name in names:
            sub = getattr(block, name, None)
            if sub is not None:
                handles.append(sub.register_forward_pre_hook(merge_in, with_kwargs=True))
                handles.append(sub.register_forward_hook(unmerge_out))
    return handles


@pytest.mark.parametrize("kind", KINDS)
def test_merge_equals_the_hosts_own_blocks_with_merges_placed_by_hand(models, kind):
    gw = 8 if kind == "dit" else 10  # an 8x10 grid (DiT unpatchifies square grids only)
    model, inputs = models[kind], T.transformer_inputs(kind, h=16, w=2 * gw)
    base = run(model, inputs)
    handles = hand_merge(model, kind, 8, gw)
    assert_patch_equals_hooks_by_hand(model, lambda: run(model, inputs), base, handles, TOL, ratio=0.5, use_rand=False)


def pooled(x, h, w, factor, method):
    b, n, c = x.shape
    img = x.transpose(1, 2).reshape(b, c, h, w)
    small = F.avg_pool2d(img, factor, ceil_mode=True, count_include_pad=False) if method == "avg" else img[:, :, ::factor, ::factor]
    return small.flatten(2).transpose(1, 2)


@pytest.mark.parametrize("method", ["nearest", "avg"])
@pytest.mark.parametrize("kind", KINDS)
def test_downsample_equals_keys_and_values_from_the_grid_pooled_by_hand(models, kind, method):
    """SD3: the key and value projections of the image take the pooled grid (text keys stay whole);
    PixArt and DiT: self-attention takes the pooled grid as its context."""
    gw = 8 if kind == "dit" else 10  # an 8x10 grid (DiT unpatchifies square grids only)
    model, inputs = models[kind], T.transformer_inputs(kind, h=16, w=2 * gw)
    base = run(model, inputs)
    handles = []
    for block in block_list(model):
        if kind in JOINT:
            for name in ("attn", "attn2"):
                attn = getattr(block, name, None)
                for proj in (attn.to_k, attn.to_v) if attn is not None else ():
                    handles.append(proj.register_forward_pre_hook(lambda m, a: (pooled(a[0], 8, gw, 2, method),)))
        else:
            handles.append(block.attn1.register_forward_pre_hook(
                lambda m, a, k: (a, {**k, "encoder_hidden_states": pooled(a[0], 8, gw, 2, method)}), with_kwargs=True))
    assert_patch_equals_hooks_by_hand(model, lambda: run(model, inputs), base, handles, TOL, mode="downsample",
                                      downsample_method=method)


def test_blocks_chooses_which_blocks_reduce(models):
    model, inputs = models["sd3"], T.transformer_inputs("sd3")
    for picked, expected in (([1], [64, 32, 64]), ([0, 2], [32, 64, 32]), (None, [32, 32, 32])):
        tomesd.apply_patch(model, ratio=0.5, blocks=picked)
        try:
            _, seen = probe(model, inputs)
        finally:
            tomesd.remove_patch(model)
        assert seen["q"] == expected, picked


@pytest.mark.parametrize("h,w", [(16, 24), (18, 14), (14, 14)])
@pytest.mark.parametrize("kind", ["sd3", "pixart"])
def test_non_square_and_odd_grids_merge(models, kind, h, w):
    model, inputs = models[kind], T.transformer_inputs(kind, h=h, w=w)
    n = (h // 2) * (w // 2)
    base = run(model, inputs)
    tomesd.apply_patch(model, ratio=0.5)
    try:
        out, seen = probe(model, inputs)
    finally:
        tomesd.remove_patch(model)
    assert seen["q"] == [n - n // 2] * len(seen["q"])
    assert (out - base).abs().max().item() > 1000 * TOL


@pytest.mark.parametrize(
    "kind,kwargs,name",
    [("sd3", dict(max_downsample=1), "max_downsample"), ("pixart", dict(max_downsample=2), "max_downsample"),
     ("sd3", dict(blocks=[3]), "blocks"), ("sd3", dict(blocks=[]), "blocks"), ("sd3", dict(blocks=[-1]), "blocks"),
     ("sd3", dict(blocks="0"), "blocks"), ("unet", dict(blocks=[0]), "blocks"),
     ("sd3-pag", dict(mode="downsample"), "PAG")],
)
def test_arguments_transformers_cannot_use_are_refused_before_any_change(models, kind, kwargs, name):
    model = T.unet() if kind == "unet" else T.transformer("sd3") if kind == "sd3-pag" else models[kind]
    if kind == "sd3-pag":
        from diffusers.models.attention_processor import PAGJointAttnProcessor2_0

        model.set_attn_processor(PAGJointAttnProcessor2_0())
    with pytest.raises(ValueError, match=rf"^{name}\b" if name != "PAG" else name):
        tomesd.apply_patch(model, **kwargs)
    assert not any(PATCH_ATTR in m.__dict__ for m in model.modules())
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())


MODES = {"merge": dict(ratio=0.5), "downsample": dict(mode="downsample"),
         "downsample-avg": dict(mode="downsample", downsample_method="avg")}


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("kind", KINDS)
def test_denoising_loop_is_one_graph_without_recompiles_and_equals_eager(kind, mode):
    steps = [T.transformer_inputs(kind, t=t) for t in (999.0, 500.0, 21.0)]
    assert_loop_compiles_once_and_equals_eager(T.transformer(kind), run, steps, **MODES[mode])


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("kind", KINDS)
def test_forward_on_the_meta_device_reads_no_tensor_value(kind, mode):
    from diffusers import DiTTransformer2DModel, PixArtTransformer2DModel, SD3Transformer2DModel

    cls, config = {"sd3": (SD3Transformer2DModel, T.SD3), "sd35": (SD3Transformer2DModel, T.SD35),
                   "pixart": (PixArtTransformer2DModel, T.PIXART), "dit": (DiTTransformer2DModel, T.DIT)}[kind]
    with torch.device("meta"):
        model = cls(**config).eval()
    inputs = {k: (v.to("meta") if isinstance(v, torch.Tensor) else v) for k, v in T.transformer_inputs(kind).items()}
    tomesd.apply_patch(model, **MODES[mode])
    out, seen = probe(model, inputs)
    assert out.shape[-2:] == (16, 16) and out.device.type == "meta"
    assert seen["k"][0] == {"merge": 32, "downsample": 16, "downsample-avg": 16}[mode]  # reduced, not skipped


@pytest.mark.parametrize("kind", ["sd3", "pixart"])
def test_copies_run_alike_and_apart(models, kind):
    model, inputs = models[kind], T.transformer_inputs(kind)
    base = run(model, inputs)
    tomesd.apply_patch(model, ratio=0.5)
    try:
        patched = run(model, inputs)
        for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
            assert torch.equal(run(twin, inputs), patched)
            tomesd.remove_patch(twin)
            assert torch.equal(run(twin, inputs), base)
        assert torch.equal(run(model, inputs), patched)  # the original keeps its patch
    finally:
        tomesd.remove_patch(model)
    assert (patched - base).abs().max().item() > 1000 * TOL


def test_concurrent_calls_at_two_resolutions_equal_serial_ones(models):
    model = models["sd3"]
    jobs = [T.transformer_inputs("sd3", h=16, w=16, seed=5), T.transformer_inputs("sd3", h=16, w=24, seed=6)]
    base = [run(model, job) for job in jobs]
    tomesd.apply_patch(model, ratio=0.5)
    try:
        expected = [run(model, job) for job in jobs]
        results = concurrent_calls(model, lambda job: run(model, job), jobs)
    finally:
        tomesd.remove_patch(model)
    for e, b in zip(expected, base):
        assert (e - b).abs().max().item() > 1000 * TOL
    for i, outs in results.items():
        assert all(torch.equal(out, expected[i % 2]) for out in outs)


@pytest.mark.parametrize("kind", ["sd3", "sd35", "pixart"])
def test_gradient_checkpointing_gives_the_same_loss_and_gradients(kind):
    assert_checkpointing_keeps_loss_and_gradients(lambda: T.transformer(kind), lambda: T.transformer_inputs(kind),
                                                  dict(ratio=0.5))


def test_reuse_steps_and_share_across_blocks_on_sd3(models):
    model = models["sd3"]
    steps = [T.transformer_inputs("sd3", t=t, seed=s) for s, t in enumerate([900, 900, 700, 500, 300])]
    tomesd.apply_patch(model, ratio=0.5, reuse_steps=3)
    try:
        merged = []
        with tomesd.observe(model) as seen:
            for inputs in steps:
                out, tokens = probe(model, inputs)
                merged.append(tokens["q"])
        assert [call.computed for call in seen.calls] == [3, 0, 0, 0, 3]  # 900 (twice), 700, 500 reuse; 300 anew
        assert merged == [[32, 32, 32]] * 5  # every call merges, reusing ones included
        tomesd.apply_patch(model, ratio=0.5, share_across_blocks=True)
        with tomesd.observe(model) as seen:
            out, tokens = probe(model, steps[0])
        assert (seen.calls[0].computed, seen.calls[0].reused) == (1, 2)  # one matching serves every block
        assert tokens["q"] == [32, 32, 32]
    finally:
        tomesd.remove_patch(model)


def test_sd3_controlnet_merges_its_blocks_and_text_stays():
    from diffusers import SD3ControlNetModel

    controlnet = T.randomize_(SD3ControlNetModel(
        sample_size=16, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=16, caption_projection_dim=16, pooled_projection_dim=8, out_channels=4,
        pos_embed_max_size=16), 2)
    inputs = T.transformer_inputs("sd3")
    inputs["controlnet_cond"] = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(3))

    def go():
        seen, handles = token_probe(controlnet)
        with torch.no_grad():
            out = controlnet(**inputs, return_dict=False)[0]
        for handle in handles:
            handle.remove()
        return torch.stack(list(out)), seen

    base, plain = go()
    tomesd.apply_patch(controlnet, ratio=0.5)
    merged, seen = go()
    tomesd.remove_patch(controlnet)
    assert plain["q"] == [64, 64] and seen["q"] == [32, 32] and seen["text_q"] == plain["text_q"] == [5, 5]
    assert (merged - base).abs().max().item() > 1000 * TOL
    assert torch.equal(go()[0], base)


def test_sd3_pipeline_patches_its_transformer_and_nothing_else(tmp_path):
    pipe = T.sd3_pipeline(tmp_path)
    base = T.run_sd3_pipeline(pipe)
    seen, handles = token_probe(pipe.transformer)
    tomesd.apply_patch(pipe, ratio=0.5)
    patched_models = [name for name, c in pipe.components.items()
                      if isinstance(c, torch.nn.Module) and any(PATCH_ATTR in m.__dict__ for m in c.modules())]
    merged = T.run_sd3_pipeline(pipe)
    for handle in handles:
        handle.remove()
    tomesd.remove_patch(pipe)
    assert patched_models == ["transformer"]  # never the VAE or the text encoders
    # 2 steps x 3 blocks; a 32-pixel image is a 16x16 latent (this VAE halves once), an 8x8 patch grid.
    assert seen["q"] == [32] * 6 and seen["text_q"] == [seen["text_q"][0]] * 6 and seen["text_q"][0] >= 77
    assert abs(merged - base).max() > 1e-2
    assert (T.run_sd3_pipeline(pipe) == base).all()


@pytest.mark.parametrize("mode", sorted(MODES))
def test_kernels_added_per_block_are_the_same_on_sd3_as_on_pixart(models, mode):
    """Ops dispatched (each a kernel launch on a GPU) that the patch adds to a forward, per block: SD3's
    joint attention (image keys and values downsampled at two projections, from one downsampling) costs
    what PixArt's self-attention does."""
    added = {}
    for kind in ("sd3", "pixart"):
        model, inputs = models[kind], T.transformer_inputs(kind)

        def count():
            with torch.no_grad(), OpCounter() as counter:
                model(**inputs)
            return counter.total

        base = count()
        tomesd.apply_patch(model, **MODES[mode])
        try:
            added[kind] = (count() - base) / len(block_list(model))
        finally:
            tomesd.remove_patch(model)
    print(f"{mode}: ops added per block: {added}")
    assert 0 < added["sd3"] == added["pixart"]


def test_blocks_count_each_models_own_blocks_when_a_controlnet_has_fewer(tmp_path):
    from diffusers import SD3ControlNetModel

    controlnet = T.randomize_(SD3ControlNetModel(**dict(T.SD3, num_layers=2, joint_attention_dim=64,
                                                        pooled_projection_dim=64)), 2)  # 2 blocks; the transformer 3
    pipe = T.sd3_pipeline(tmp_path, controlnet=controlnet)
    tomesd.apply_patch(pipe, ratio=0.5, blocks=[2])
    try:
        _, seen = probe(pipe.transformer, dict(T.transformer_inputs("sd3"), encoder_hidden_states=torch.randn(2, 5, 64),
                                               pooled_projections=torch.randn(2, 64)))
        assert hasattr(pipe.controlnet, PATCH_ATTR)  # patched, with no block index 2 to reduce
    finally:
        tomesd.remove_patch(pipe)
    assert seen["q"] == [64, 64, 32]
    with pytest.raises(ValueError, match="^blocks"):
        tomesd.apply_patch(pipe, ratio=0.5, blocks=[3])


def test_downsample_refuses_a_fused_processor_it_does_not_know_at_the_next_call(models):
    from diffusers.models.attention_processor import FusedJointAttnProcessor2_0

    class FusedOwnJointAttnProcessor(FusedJointAttnProcessor2_0):  # ToMe cannot see its SDPA call
        pass

    model = T.transformer("sd3")
    tomesd.apply_patch(model, mode="downsample")
    model.fuse_qkv_projections()  # to_k / to_v would no longer run: nothing would shrink, silently
    model.set_attn_processor(FusedOwnJointAttnProcessor())
    with pytest.raises(ValueError, match="unfuse_qkv_projections"):
        run(model, T.transformer_inputs("sd3"))
    model.unfuse_qkv_projections()
    tomesd.remove_patch(model)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_sd35_controlnet_single_blocks_reduce(mode):
    """SD3.5's ControlNets (no joint_attention_dim) run image-only SD3SingleTransformerBlocks: their
    self-attention merges (or takes downsampled keys) like a joint block's."""
    from diffusers import SD3ControlNetModel

    controlnet = T.randomize_(SD3ControlNetModel(
        sample_size=16, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=None, caption_projection_dim=16, pooled_projection_dim=8, out_channels=4,
        pos_embed_max_size=16), 2)
    assert {type(b).__name__ for b in controlnet.transformer_blocks} == {"SD3SingleTransformerBlock"}
    inputs = T.transformer_inputs("sd3")
    del inputs["encoder_hidden_states"]  # no text: these blocks see the image alone
    inputs["controlnet_cond"] = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(3))

    def go():
        pairs, handles = [], []  # hooked after the patch's pre-hooks, so they see what the layers get
        for block in controlnet.transformer_blocks:
            pending = []
            handles.append(block.attn.to_q.register_forward_pre_hook(lambda m, a, p=pending: p.append(a[0].shape[1])))
            handles.append(block.attn.to_k.register_forward_pre_hook(
                lambda m, a, p=pending: pairs.append((p.pop(), a[0].shape[1]))))
        with torch.no_grad():
            out = controlnet(**inputs, return_dict=False)[0]
        for handle in handles:
            handle.remove()
        return torch.stack(list(out)), pairs

    base, plain = go()
    tomesd.apply_patch(controlnet, **MODES[mode])
    reduced, seen = go()
    tomesd.remove_patch(controlnet)
    assert plain == [(64, 64)] * 2
    assert seen == ([(32, 32)] * 2 if mode == "merge" else [(64, 16)] * 2)
    assert (reduced - base).abs().max().item() > 1000 * TOL
    assert torch.equal(go()[0], base)
