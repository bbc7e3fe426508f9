"""A patched model keeps the promises diffusers makes of every UNet2DConditionModel / ControlNetModel
(issue 13), with tokens still merged.

Every check patches with default arguments (`apply_patch(model, ratio=0.5)`: random dst on, default
seed; a few variants add `seed`, `use_rand=False` or `merge_crossattn=True`), and confirms the merge is still there: fewer tokens reach the self-attention's query projection
than unpatched (counted by forward pre-hooks on `attn1.to_q` / `attn1.to_qkv`), and the output differs
from the unpatched model's under the same host feature by far more than the tolerance.
"""
import copy
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import tiny_torch as T
import tomesd
from tomesd.runtime.tome_patch import PATCH_ATTR

TOL = 1e-5
EFFECT = 0.05  # the least change ToMe must make to an output for a check to count as "still merging"
MODELS = ["sd1", "sdxl", "controlnet"]
UNETS = ["sd1", "sdxl"]


# ---------------------------------------------------------------- models, inputs, probes

@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models gain nothing from intra-op threads, and a shared CPU makes them stall."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def bases():
    """The unpatched models, built once; tests work on deep copies."""
    from diffusers import ControlNetModel

    sd1 = T.unet(T.SD1_UNET)
    controlnet = T.randomize_(
        ControlNetModel.from_unet(sd1, conditioning_embedding_out_channels=(8, 16)), seed=10
    )
    models = {"sd1": sd1, "sdxl": T.unet(T.SDXL_UNET), "controlnet": controlnet}
    for model in models.values():
        model._host_contract_base = True  # never patched nor changed: its runs are cached
    yield models
    _UNPATCHED_RUNS.clear()


def fresh(bases, name, patch=True, **kwargs):
    model = copy.deepcopy(bases[name])
    model.__dict__.pop("_host_contract_base", None)
    if patch:
        tomesd.apply_patch(model, ratio=0.5, **kwargs)
    return model


def inputs(batch=2, t=10):
    x, _, c = T.unet_inputs(batch, 16, 16)
    cond = torch.rand(batch, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    return dict(sample=x, timestep=torch.tensor(t), encoder_hidden_states=c, controlnet_cond=cond)


def is_controlnet(model):
    return type(model).__name__ == "ControlNetModel"


def flat(out):
    """One tensor from a UNet's or a ControlNet's output (dict or tuple)."""
    if hasattr(out, "sample"):
        return out.sample
    if hasattr(out, "down_block_res_samples"):
        out = (*out.down_block_res_samples, out.mid_block_res_sample)
    if isinstance(out, (tuple, list)) and len(out) == 1:
        return out[0]
    if isinstance(out, (tuple, list)):
        parts = []
        for o in out:
            parts.extend(o if isinstance(o, (tuple, list)) else [o])
        return torch.cat([p.reshape(-1) for p in parts])
    return out


def run(model, inp=None, grad=False, **kwargs):
    inp = dict(inputs() if inp is None else inp)
    if not is_controlnet(model):
        inp.pop("controlnet_cond")
    with torch.set_grad_enabled(grad):
        return flat(model(**inp, **kwargs))


def blocks(model):
    return [m for m in model.modules() if type(m).__name__ == "BasicTransformerBlock"]


class QueryTokens:
    """Counts the tokens entering every self-attention's query projection (fused or not)."""

    def __init__(self, model):
        self.model, self.total, self.handles = model, 0, []

    def _hook(self, module, args):
        self.total += args[0].shape[-2]

    def __enter__(self):
        for block in blocks(self.model):
            for name in ("to_q", "to_qkv"):
                leaf = getattr(block.attn1, name, None)
                if leaf is not None:
                    self.handles.append(leaf.register_forward_pre_hook(self._hook))
        assert self.handles
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


def run_counting(model, inp=None, **kwargs):
    with QueryTokens(model) as counter:
        out = run(model, inp, **kwargs)
    return out, counter.total


def fingerprint(inp):
    return tuple((k, v.dtype, tuple(v.shape), v.double().sum().item(), v.double().square().sum().item())
                 for k, v in sorted(inp.items()))


_UNPATCHED_RUNS = {}  # (id of a module-scoped unpatched model, timestep) -> (output, tokens)


def assert_merges(patched, unpatched, inp=None, effect=EFFECT, **kwargs):
    """Run both; the patched one must see fewer query tokens and give an output far from the
    unpatched one's. Returns the patched output."""
    out, tokens = run_counting(patched, inp, **kwargs)
    assert not hasattr(unpatched, PATCH_ATTR)
    if getattr(unpatched, "_host_contract_base", False) and not kwargs:
        key = (id(unpatched), fingerprint(inputs() if inp is None else inp))
        if key not in _UNPATCHED_RUNS:
            _UNPATCHED_RUNS[key] = run_counting(unpatched, inp)
        ref, ref_tokens = _UNPATCHED_RUNS[key]
    else:
        ref, ref_tokens = run_counting(unpatched, inp, **kwargs)
    assert ref_tokens > 0 and tokens < ref_tokens, (tokens, ref_tokens)
    assert torch.isfinite(out).all()
    diff = (out.float() - ref.float()).abs().max().item()
    assert diff > effect, f"the patch changed the output by only {diff}"
    return out


def max_diff(a, b):
    return (a.float() - b.float()).abs().max().item()


# ---------------------------------------------------------------- 1. determinism

@pytest.mark.parametrize("name", MODELS)
def test_repeat_calls_identical_and_global_rng_untouched(bases, name):
    """Same weights and inputs give bit-identical outputs across calls, the merge is on, and a
    patched forward neither reads nor advances torch's global RNG."""
    model = fresh(bases, name)
    first = assert_merges(model, bases[name])
    state = torch.get_rng_state()
    second = run(model)
    assert torch.equal(torch.get_rng_state(), state)
    torch.manual_seed(12345)
    torch.rand(100)
    third = run(model)
    assert torch.equal(first, second) and torch.equal(first, third)


@pytest.mark.parametrize("name", MODELS)
def test_save_pretrained_roundtrip_into_fresh_patched_model(bases, name, tmp_path):
    """A patched model saves like any other (no ToMe state in weights or config); loading into a fresh
    model and patching it the same way gives bit-identical outputs, even after the global RNG moved."""
    from diffusers import ControlNetModel, UNet2DConditionModel

    model = fresh(bases, name)
    expected = run(model)
    model.save_pretrained(tmp_path)
    assert "tome" not in json.dumps(json.loads((tmp_path / "config.json").read_text())).lower()
    torch.manual_seed(777)
    torch.rand(100)
    cls = ControlNetModel if name == "controlnet" else UNet2DConditionModel
    loaded = cls.from_pretrained(tmp_path).eval()
    assert not hasattr(loaded, PATCH_ATTR)
    assert torch.equal(run(loaded), run(bases[name]))  # the weights, unpatched
    torch.rand(100)
    tomesd.apply_patch(loaded, ratio=0.5)
    got = assert_merges(loaded, bases[name])
    assert torch.equal(got, expected)


@pytest.mark.parametrize("name", MODELS)
def test_dict_and_tuple_outputs_equal(bases, name):
    model = fresh(bases, name)
    as_dict = assert_merges(model, bases[name])
    as_tuple = run(model, return_dict=False)
    assert torch.equal(as_dict, as_tuple)


_OTHER_PROCESS = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, sys.argv[1])
    import torch
    from safetensors.torch import load_file
    from diffusers import UNet2DConditionModel
    import tiny_torch as T
    import tomesd

    torch.manual_seed(4242)  # another global RNG state than the parent's
    torch.rand(1000)
    data = torch.load(sys.argv[3])
    outs = {}
    for name, config in (("sd1", T.SD1_UNET), ("sdxl", T.SDXL_UNET)):
        model = UNet2DConditionModel(**config).eval()
        model.load_state_dict(load_file(f"{sys.argv[2]}/{name}.safetensors"))
        tomesd.apply_patch(model, ratio=0.5)
        with torch.no_grad():
            outs[name] = model(data["x"], data["t"], data["c"]).sample
    torch.save(outs, sys.argv[4])
    """
)


def test_outputs_equal_in_another_process(bases, tmp_path):
    """Same safetensors weights and inputs, patched with default arguments in a fresh process with
    another global RNG state: bit-identical outputs (the default random pattern is not per process)."""
    from safetensors.torch import save_file

    inp = inputs()
    expected = {}
    for name in UNETS:
        save_file(bases[name].state_dict(), str(tmp_path / f"{name}.safetensors"))
        expected[name] = assert_merges(fresh(bases, name), bases[name])
    torch.save(dict(x=inp["sample"], t=inp["timestep"], c=inp["encoder_hidden_states"]), tmp_path / "in.pt")
    script = tmp_path / "other.py"
    script.write_text(_OTHER_PROCESS)
    tests_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    repo = os.path.dirname(tests_dir)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, str(script), tests_dir, str(tmp_path), str(tmp_path / "in.pt"), str(tmp_path / "out.pt")],
        capture_output=True, text=True, cwd=repo, env=env, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.load(tmp_path / "out.pt")
    for name in UNETS:
        assert torch.equal(got[name], expected[name]), name


@pytest.mark.parametrize("name", UNETS)
def test_seed_selects_the_pattern(bases, name):
    """seed=None is the documented default seed 0; another seed gives another output (still merged)."""
    default = assert_merges(fresh(bases, name), bases[name])  # ToMe acts, far beyond the tolerance
    assert torch.equal(run(fresh(bases, name, seed=0)), default)
    other = assert_merges(fresh(bases, name, seed=1), bases[name])
    assert max_diff(other, default) > EFFECT


def test_random_pattern_changes_with_the_timestep(bases, monkeypatch):
    """The dst offsets drawn per merging block differ between t=10 and t=20, and repeat exactly for the
    same t; with use_rand=False no offsets are drawn. A call draws every block's pattern at once (one row a block)
    and partitions them in one go, at its first block on each grid."""
    import tomesd.runtime.matcher as matcher

    calls = []
    original = matcher.grid_partitions

    def recording(xp, metric, w, h, sx, sy, offsets=None):
        calls.append(None if offsets is None else offsets.detach().clone())
        return original(xp, metric, w, h, sx, sy, offsets)

    monkeypatch.setattr(matcher, "grid_partitions", recording)
    model = fresh(bases, "sd1")

    def offsets_at(t):
        calls.clear()
        assert_merges(model, bases["sd1"], inputs(t=t))
        assert calls and all(c is not None for c in calls)
        return list(calls)

    at10, at20, again10 = offsets_at(10), offsets_at(20), offsets_at(10)
    assert len(at10) == len(at20) == len(again10)
    assert all(torch.equal(a, b) for a, b in zip(at10, again10))
    assert all(not torch.equal(a, b) for a, b in zip(at10, at20))
    # and the pattern differs between blocks of one call (a row per block)
    table = at10[0]
    assert table.shape[0] > 1 and not all(torch.equal(table[0], row) for row in table[1:])
    calls.clear()
    assert_merges(fresh(bases, "sd1", use_rand=False), bases["sd1"])
    assert calls and all(c is None for c in calls)


# ---------------------------------------------------------------- 3. attention processors

def custom_diffusion_processors(model):
    """As diffusers' own tests build them: trained k/v (+1) on cross-attention, plain on self-attention."""
    from diffusers.models.attention_processor import CustomDiffusionAttnProcessor

    procs, state = {}, model.state_dict()
    for name in model.attn_processors:
        layer = name[: -len(".processor")]
        hidden = hidden_size(model, name)
        if name.endswith("attn1.processor"):
            procs[name] = CustomDiffusionAttnProcessor(train_kv=False, train_q_out=False, hidden_size=hidden)
            continue
        proc = CustomDiffusionAttnProcessor(
            train_kv=True, train_q_out=True, hidden_size=hidden, cross_attention_dim=model.config.cross_attention_dim
        )
        proc.load_state_dict({
            "to_k_custom_diffusion.weight": state[layer + ".to_k.weight"] + 1,
            "to_v_custom_diffusion.weight": state[layer + ".to_v.weight"] + 1,
            "to_q_custom_diffusion.weight": state[layer + ".to_q.weight"],
            "to_out_custom_diffusion.0.weight": state[layer + ".to_out.0.weight"],
            "to_out_custom_diffusion.0.bias": state[layer + ".to_out.0.bias"],
        })
        procs[name] = proc
    return procs


def hidden_size(model, name):
    channels = model.config.block_out_channels
    if name.startswith("mid_block"):
        return channels[-1]
    block_id = int(name.split(".")[1])
    return list(reversed(channels))[block_id] if name.startswith("up_blocks") else channels[block_id]


CLIP_DIM = 16


def ip_adapter_state_dict(model, seed=5):
    """A tiny IP-Adapter (plain, 4 image tokens) in the layout `_load_ip_adapter_weights` reads."""
    gen = torch.Generator().manual_seed(seed)
    cross = model.config.cross_attention_dim
    ip, key_id = {}, 1
    for name in model.attn_processors:
        if name.endswith("attn1.processor"):
            continue
        hidden = hidden_size(model, name)
        ip[f"{key_id}.to_k_ip.weight"] = torch.randn(hidden, cross, generator=gen) / cross ** 0.5
        ip[f"{key_id}.to_v_ip.weight"] = torch.randn(hidden, cross, generator=gen) / cross ** 0.5
        key_id += 2
    image_proj = {
        "proj.weight": torch.randn(4 * cross, CLIP_DIM, generator=gen) / CLIP_DIM ** 0.5,
        "proj.bias": 0.1 * torch.randn(4 * cross, generator=gen),
        "norm.weight": torch.ones(cross),
        "norm.bias": torch.zeros(cross),
    }
    return {"image_proj": image_proj, "ip_adapter": ip}


def image_embeds(batch=2):
    return [torch.randn(batch, 1, CLIP_DIM, generator=torch.Generator().manual_seed(6))]


def set_processor(model, kind):
    from diffusers.models.attention_processor import AttnProcessor

    if kind == "AttnProcessor":
        model.set_attn_processor(AttnProcessor())
    elif kind == "default":
        model.set_default_attn_processor()
    elif kind == "custom_diffusion":
        model.set_attn_processor(custom_diffusion_processors(model))
    elif kind == "fused_qkv":
        model.fuse_qkv_projections()
        assert all(hasattr(b.attn1, "to_qkv") for b in blocks(model))
    elif kind == "unfused_qkv":
        model.fuse_qkv_projections()
        model.unfuse_qkv_projections()
        assert not any("Fused" in type(b.attn1.processor).__name__ for b in blocks(model))
    elif kind == "ip_adapter":
        model._load_ip_adapter_weights(ip_adapter_state_dict(model))
    elif kind == "sliced_auto":
        model.set_attention_slice("auto")
    elif kind == "sliced_1":
        model.set_attention_slice(1)
    else:
        raise AssertionError(kind)


# Processors whose math equals the default's: the patched output must not move.
EQUIVALENT = ("AttnProcessor", "default", "fused_qkv", "unfused_qkv", "sliced_auto", "sliced_1")
UNET_PROCESSORS = EQUIVALENT + ("custom_diffusion", "ip_adapter")
# diffusers 0.42's ControlNetModel.fuse_qkv_projections fuses nothing (its attention layers are not
# AttentionModuleMixin), so fusing is checked on UNets only.
CONTROLNET_PROCESSORS = ("AttnProcessor", "default", "sliced_auto", "custom_diffusion")


def _check_processor(bases, name, kind, tol):
    kwargs = {"added_cond_kwargs": {"image_embeds": image_embeds()}} if kind == "ip_adapter" else {}
    default_patched = run(fresh(bases, name))
    unpatched = fresh(bases, name, patch=False)
    set_processor(unpatched, kind)
    patched = fresh(bases, name)
    set_processor(patched, kind)  # after apply_patch
    assert hasattr(patched, PATCH_ATTR)
    out = assert_merges(patched, unpatched, **kwargs)
    if kind in EQUIVALENT:
        assert max_diff(out, default_patched) < tol * (1 + default_patched.abs().max().item()), kind
    else:  # the processor's own weights act on the output
        assert max_diff(out, default_patched) > EFFECT, kind
    assert torch.equal(run(patched, **kwargs), out)


@pytest.mark.parametrize("kind", UNET_PROCESSORS)
@pytest.mark.parametrize("name", UNETS)
def test_unet_attention_processors_after_patch(bases, name, kind):
    """set_attn_processor(AttnProcessor()), set_default_attn_processor(), custom-diffusion and IP-Adapter
    processors, fuse/unfuse_qkv_projections and attention slicing, each set after apply_patch: the model
    still merges, the output moves away from the unpatched model under the same processor, and
    processors that compute the same attention give the default processor's patched output."""
    _check_processor(bases, name, kind, tol=1e-5)


@pytest.mark.parametrize("kind", CONTROLNET_PROCESSORS)
def test_controlnet_attention_processors_after_patch(bases, kind):
    _check_processor(bases, "controlnet", kind, tol=1e-5)


def test_ip_adapter_with_merged_cross_attention(bases):
    """IP-Adapter's decoupled cross-attention runs on merged tokens too (merge_crossattn=True)."""
    kwargs = {"added_cond_kwargs": {"image_embeds": image_embeds()}}
    unpatched = fresh(bases, "sd1", patch=False)
    set_processor(unpatched, "ip_adapter")
    attn1_only = fresh(bases, "sd1")
    set_processor(attn1_only, "ip_adapter")
    both = fresh(bases, "sd1", merge_crossattn=True)
    set_processor(both, "ip_adapter")
    def attn2_tokens(model):
        seen = []
        handles = [b.attn2.to_q.register_forward_pre_hook(lambda m, a: seen.append(a[0].shape[-2])) for b in blocks(model)]
        try:
            return run(model, **kwargs), sum(seen)
        finally:
            for h in handles:
                h.remove()

    out = assert_merges(both, unpatched, **kwargs)
    again, merged_attn2 = attn2_tokens(both)
    assert torch.equal(again, out)
    assert 0 < merged_attn2 < attn2_tokens(unpatched)[1]
    assert max_diff(out, run(attn1_only, **kwargs)) > EFFECT
    # the image embeddings reach the output
    other = [e * 0 for e in image_embeds()]
    assert max_diff(run(both, added_cond_kwargs={"image_embeds": other}), out) > EFFECT


# ---------------------------------------------------------------- 4. masks

@pytest.mark.parametrize("merge_crossattn", [False, True], ids=["default", "merge_crossattn"])
@pytest.mark.parametrize("name", UNETS)  # ControlNetModel.forward takes no encoder_attention_mask
def test_encoder_attention_mask(bases, name, merge_crossattn):
    """A cross-attention mask [B, seq] with zeros works under the patch (also when the cross-attention's
    queries are merged), still merges, changes the output; an all-ones mask equals no mask."""
    mask = torch.ones(2, 7)
    mask[:, 4:] = 0
    mask[1, 2] = 0
    model = fresh(bases, name, **({"merge_crossattn": True} if merge_crossattn else {}))
    no_mask = assert_merges(model, bases[name])
    masked = assert_merges(model, bases[name], encoder_attention_mask=mask)
    assert max_diff(masked, no_mask) > EFFECT
    ones = assert_merges(model, bases[name], encoder_attention_mask=torch.ones(2, 7))  # ToMe acts, far beyond 1e-4
    assert max_diff(ones, no_mask) < 1e-4


def test_self_attention_mask_is_refused_clearly(bases):
    """The UNet's `attention_mask` reaches the self-attention, whose merged tokens it cannot address:
    refused with a ValueError that names the way out, not a shape error deep in the attention."""
    model = fresh(bases, "sd1")
    with pytest.raises(ValueError, match="merge_attn=False"):
        run(model, attention_mask=torch.ones(2, 7))
    # the failed call left the model usable and still merging
    assert_merges(model, bases["sd1"])


@pytest.mark.parametrize("mode", ["merge", "downsample"])
def test_a_self_attention_mask_passed_by_position_is_refused_as_by_name(bases, mode):
    """A host whose blocks pass the mask to self-attention by position (attn1(x, None, mask)) is refused as
    one passing it by name, never left to reach the attention with mismatched shapes."""
    model = fresh(bases, "sd1", patch=mode == "merge")
    if mode == "downsample":
        tomesd.apply_patch(model, mode="downsample")

    def by_position(module, args, kwargs):
        if kwargs.get("attention_mask") is None:
            return None
        kwargs = dict(kwargs)
        context = kwargs.pop("encoder_hidden_states", None)
        return (args[0] if args else kwargs.pop("hidden_states"), context, kwargs.pop("attention_mask")), kwargs

    for block in model.modules():
        if type(block).__name__ == "BasicTransformerBlock":
            block.attn1.register_forward_pre_hook(by_position, with_kwargs=True, prepend=True)
    with pytest.raises(ValueError, match="merge_attn=False" if mode == "merge" else "attention_mask"):
        run(model, attention_mask=torch.ones(2, 7))


# ---------------------------------------------------------------- 5. LoRA (peft)

def lora_config():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"], init_lora_weights=False)


@pytest.mark.parametrize("name", ["sd1", "controlnet"])
def test_peft_lora_after_patch(bases, name):
    """add_adapter after apply_patch: LoRA acts, tokens merge; disable/enable/delete adapters move
    between the patched LoRA and no-LoRA outputs; the order of patch and adapter does not matter."""
    model = fresh(bases, name)
    no_lora = run(model)
    torch.manual_seed(0)
    model.add_adapter(lora_config())
    unpatched = fresh(bases, name, patch=False)
    torch.manual_seed(0)
    unpatched.add_adapter(lora_config())
    with_lora = assert_merges(model, unpatched)
    assert max_diff(with_lora, no_lora) > EFFECT
    model.disable_adapters()
    assert max_diff(run(model), no_lora) < TOL
    model.enable_adapters()
    assert torch.equal(run(model), with_lora)
    # adapter first, patch second: the same output
    tomesd.apply_patch(unpatched, ratio=0.5)
    assert max_diff(run(unpatched), with_lora) < TOL
    model.delete_adapters("default")
    out = assert_merges(model, bases[name])
    assert max_diff(out, no_lora) < TOL


# ---------------------------------------------------------------- 6. dtypes

def _float8_supported():
    try:
        torch.ones(2).to(torch.float8_e4m3fn).to(torch.float32)
        return True
    except Exception:  # noqa: BLE001
        return False


@pytest.mark.parametrize("name", ["sd1", "sdxl"])
def test_layerwise_casting_after_patch(bases, name):
    """enable_layerwise_casting (float8 storage where this torch has it, else bfloat16) after apply_patch."""
    storage = torch.float8_e4m3fn if _float8_supported() else torch.bfloat16
    model = fresh(bases, name)
    model.enable_layerwise_casting(storage_dtype=storage, compute_dtype=torch.float32)
    unpatched = fresh(bases, name, patch=False)
    unpatched.enable_layerwise_casting(storage_dtype=storage, compute_dtype=torch.float32)
    assert any(p.dtype == storage for p in model.parameters())
    out = assert_merges(model, unpatched)
    assert out.dtype == torch.float32
    assert torch.equal(run(model), out)


@pytest.mark.parametrize("name", MODELS)
def test_bfloat16_model_after_patch(bases, name):
    """unet.to(torch.bfloat16) after apply_patch with bfloat16 inputs: runs, finite, still merges."""
    model = fresh(bases, name).to(torch.bfloat16)
    unpatched = fresh(bases, name, patch=False).to(torch.bfloat16)
    inp = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in inputs().items()}
    out = assert_merges(model, unpatched, inp, effect=0.2)
    assert out.dtype == torch.bfloat16
    fp32 = assert_merges(fresh(bases, name), bases[name])
    # ToMe moves the output far more than bf16 round-off does. Not 100x: in bf16 some merge choices
    # flip, so bf16 strays from fp32 by 1/13 (sdxl) to 1/4.5 (controlnet) of ToMe's own effect; 3x holds.
    assert max_diff(out, fp32) < max_diff(out, run(unpatched, inp)) / 3


# ---------------------------------------------------------------- 7. training and EMA

def _train(model, steps=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(steps):
        inp = inputs()
        inp["timestep"] = torch.randint(0, 1000, (2,), generator=gen)
        target = torch.randn(2, 4, 16, 16, generator=gen)
        loss = torch.nn.functional.mse_loss(run(model, inp, grad=True), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_training_step_with_ema_and_ema_copy_stays_patched(bases):
    """Train mode with the patch on: tokens merge in the training forward, gradients reach the merged
    self-attention, EMA steps; a deepcopy of the patched model (the usual EMA copy) is itself patched
    (its own patch, its own hooks), and after ema.copy_to gives exactly the original's output."""
    from diffusers.training_utils import EMAModel

    model = fresh(bases, "sd1").train()
    ema = EMAModel(model.parameters(), decay=0.5)
    with QueryTokens(model) as counter:
        losses = _train(model, steps=1)
    with QueryTokens(bases["sd1"]) as full:
        run(bases["sd1"])
    assert 0 < counter.total < full.total
    assert all(torch.isfinite(torch.tensor(losses)))
    assert blocks(model)[0].attn1.to_q.weight.grad.abs().sum() > 0
    ema.step(model.parameters())
    losses += _train(model, steps=2, seed=1)
    ema.step(model.parameters())
    model.eval()

    ema_copy = copy.deepcopy(model)
    patch = getattr(ema_copy, PATCH_ATTR)
    assert patch is not getattr(model, PATCH_ATTR) and patch.root is ema_copy
    ema.copy_to(ema_copy.parameters())
    ema.store(model.parameters())
    ema.copy_to(model.parameters())
    expected = run(model)
    unpatched_ema = copy.deepcopy(ema_copy)
    tomesd.remove_patch(unpatched_ema)
    assert not hasattr(unpatched_ema, PATCH_ATTR) and hasattr(ema_copy, PATCH_ATTR)
    got = assert_merges(ema_copy, unpatched_ema)
    assert torch.equal(got, expected)
    ema.restore(model.parameters())
    assert max_diff(run(model), expected) > 0  # restore brought the trained weights back
    # removing the copy's patch left the original patched and merging
    assert_merges(model, bases["sd1"])


def test_gradient_checkpointing_gives_the_same_gradients(bases):
    """enable_gradient_checkpointing() on a patched model: the recomputed blocks merge exactly as the
    forward did, so the loss and gradients equal those without checkpointing."""
    def grads(checkpointing, patch=True):
        model = fresh(bases, "sd1", patch=patch).train()
        if checkpointing:
            model.enable_gradient_checkpointing()
        inp = inputs()
        inp["timestep"] = torch.tensor([10, 500])
        with QueryTokens(model) as counter:
            loss = run(model, inp, grad=True).square().mean()
        loss.backward()
        return loss.item(), counter.total, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    def worst(ga, gb):  # the largest gradient difference, relative to the gradient's size
        return max(max_diff(ga[k], gb[k]) / (ga[k].abs().max().item() + 1e-12) for k in ga)

    loss0, tokens0, g0 = grads(False)
    loss1, tokens1, g1 = grads(True)
    base_loss, full, base_grads = grads(False, patch=False)
    assert tokens1 == tokens0 < full
    # ToMe acts on the loss and the gradients, far beyond the tolerances
    assert abs(loss0 - base_loss) > 100 * 1e-6
    assert base_grads.keys() == g0.keys() and worst(g0, base_grads) > 100 * 1e-4
    assert abs(loss0 - loss1) < 1e-6
    assert g0.keys() == g1.keys() and len(g0) > 0
    assert worst(g0, g1) < 1e-4, worst(g0, g1)


def key_tokens(model, **kwargs):
    """(output, tokens entering every self-attention's key projection) of one call."""
    seen = []
    handles = []
    for block in blocks(model):
        for name in ("to_k", "to_k_custom_diffusion"):
            leaf = getattr(block.attn1, name, None)
            if isinstance(leaf, torch.nn.Module):
                handles.append(leaf.register_forward_pre_hook(lambda m, a: seen.append(a[0].shape[-2])))
    try:
        out = run(model, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return out, sum(seen)


DOWNSAMPLE_PROCESSORS = ("AttnProcessor", "default", "unfused_qkv", "sliced_auto", "sliced_1", "custom_diffusion",
                         "ip_adapter")  # fused QKV is refused in this mode (tests/torch/test_modes.py)


@pytest.mark.parametrize(
    "name,kind",
    [(name, kind) for name in UNETS for kind in DOWNSAMPLE_PROCESSORS]
    + [("controlnet", kind) for kind in DOWNSAMPLE_PROCESSORS if kind in CONTROLNET_PROCESSORS],
)
def test_downsample_mode_under_attention_processors(bases, name, kind):
    """mode='downsample' hands the host's processor its keys: every processor set after apply_patch still
    sees fewer keys, moves the output, and processors computing the same attention agree."""
    kwargs = {"added_cond_kwargs": {"image_embeds": image_embeds()}} if kind == "ip_adapter" else {}
    default_patched = run(_downsampled(bases, name))
    unpatched = fresh(bases, name, patch=False)
    set_processor(unpatched, kind)
    patched = _downsampled(bases, name)
    set_processor(patched, kind)
    out, keys = key_tokens(patched, **kwargs)
    ref, ref_keys = key_tokens(unpatched, **kwargs)
    assert 0 < keys < ref_keys, (keys, ref_keys)
    assert max_diff(out, ref) > EFFECT
    if kind in EQUIVALENT:
        assert max_diff(out, default_patched) < 1e-5 * (1 + default_patched.abs().max().item()), kind
    tomesd.remove_patch(patched)
    assert torch.equal(run(patched, **kwargs), run(unpatched, **kwargs))


def _downsampled(bases, name):
    model = fresh(bases, name, patch=False)
    tomesd.apply_patch(model, mode="downsample")
    return model
