"""The ToMe node's proportional attention under each attention function ComfyUI can run (issue 60, item 2): the merged
keys are weighed at ComfyUI's attention override (tomesd/hosts/comfyui_attention.py), so torch's SDPA, the
sub-quadratic, split and basic attentions (what runs on a CPU), SageAttention and FlashAttention all take the weights,
and each output equals the weights' known path, torch's SDPA seam, to fp32 round-off.

SageAttention, flash-attn and xformers do not install here: ComfyUI's own attention_sage, attention_flash and
attention_xformers run, calling stand-ins for `sageattn`, `flash_attn_func` and `memory_efficient_attention` that keep
those kernels' rules on the head (SageAttention 2: at most 128 channels, padded up to 64 or 128, scaled by the head it
is given; flash-attn: at most 256) and compute exact attention.
A kernel whose ceiling the extra channel would pass is refused by name, before it runs."""
import importlib
import math
import types
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

import comfy_host
import tomesd.hosts.comfyui_patcher as patcher_module

comfy_host.import_comfy()

from test_comfyui import _inputs, _model  # noqa: E402
from test_comfyui_proportional import ATTENTION_USERS, tome  # noqa: E402

SDPA = F.scaled_dot_product_attention  # torch's own: the stand-ins never meet the SDPA seam's wrapper
attention = importlib.import_module("comfy.ldm.modules.attention")
FAMILIES = ("sd1", "flux", "sd3.5", "wan", "qwen")


def use(monkeypatch, function):
    """ComfyUI as started with the switch that picks `function`."""
    for name in ATTENTION_USERS:
        module = importlib.import_module(name)
        for attr in ("optimized_attention", "optimized_attention_masked"):
            if hasattr(module, attr):
                monkeypatch.setattr(module, attr, function)


def sage_stand_in(heads_seen):
    def sageattn(q, k, v, tensor_layout="HND", is_causal=False, sm_scale=None, **_):
        size = q.shape[-1]
        if size > 128:
            raise ValueError(f"Unsupported head_dim: {size}")
        heads_seen.append(size)
        if tensor_layout == "NHD":
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        padded = 64 if size <= 64 else 128
        q, k, v = (F.pad(t, (0, padded - size)) for t in (q, k, v))
        out = SDPA(q, k, v, scale=sm_scale or 1.0 / math.sqrt(size))[..., :size]
        return out.transpose(1, 2) if tensor_layout == "NHD" else out
    return sageattn


def flash_stand_in(heads_seen):
    def flash_attn_wrapper(q, k, v, dropout_p=0.0, causal=False):  # [B, S, heads, D]
        if q.shape[-1] > 256:
            raise RuntimeError("FlashAttention forward only supports head dimension at most 256")
        heads_seen.append(q.shape[-1])
        return SDPA(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
    return flash_attn_wrapper


def xformers_stand_in(heads_seen):
    def memory_efficient_attention(q, k, v, attn_bias=None):  # [B, S, heads, D], scaled by the head it is given
        heads_seen.append(q.shape[-1])
        return SDPA(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=attn_bias).transpose(1, 2)
    return types.SimpleNamespace(ops=types.SimpleNamespace(memory_efficient_attention=memory_efficient_attention))


KERNELS = ("pytorch", "sub_quad", "split", "basic", "sage", "flash", "xformers")


def pick(monkeypatch, kernel):
    """Start ComfyUI's attention as `kernel`; the head sizes a stand-in kernel was given (None for ComfyUI's own)."""
    seen = None
    if kernel == "sage":
        seen = []
        monkeypatch.setattr(attention, "sageattn", sage_stand_in(seen), raising=False)
    if kernel == "flash":
        seen = []
        monkeypatch.setattr(attention, "flash_attn_wrapper", flash_stand_in(seen))
    if kernel == "xformers":
        seen = []
        monkeypatch.setattr(attention, "xformers", xformers_stand_in(seen), raising=False)
        monkeypatch.setattr(attention, "BROKEN_XFORMERS", False)
    use(monkeypatch, getattr(attention, f"attention_{kernel}"))
    return seen


def at_sdpa_seam(model, args, conds, monkeypatch):
    """The weights' known path: ComfyUI's torch SDPA attention, the weights joining in torch's SDPA call."""
    with monkeypatch.context() as m:
        use(m, attention.attention_pytorch)
        m.setattr(patcher_module, "with_override", lambda options, seam: options)
        return comfy_host.run(tome(model, True), *args, **conds)


@pytest.fixture(scope="module")
def references():
    """family -> (model, inputs, output without weights, output weighed at the SDPA seam)."""
    found = {}
    for family in FAMILIES:
        model = _model(family)
        args, conds = _inputs(family)
        with pytest.MonkeyPatch.context() as m:
            use(m, attention.attention_pytorch)
            plain = comfy_host.run(tome(model, False), *args, **conds)
            weighed = at_sdpa_seam(model, args, conds, m)
        found[family] = (model, args, conds, plain, weighed)
    return found


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("family", FAMILIES)
def test_each_attention_function_weighs_as_the_sdpa_seam(family, kernel, references, monkeypatch):
    model, args, conds, plain, reference = references[family]
    assert torch.isfinite(reference).all()
    scale = reference.abs().max()
    assert (reference - plain).abs().max() > 1e-3 * scale  # the weights move the output far past the tolerance
    seen = pick(monkeypatch, kernel)
    out = comfy_host.run(tome(model, True), *args, **conds)
    torch.testing.assert_close(out, reference, rtol=0, atol=2e-5 * scale)
    if seen is not None:  # the stand-in ran, on heads one channel wider where weighed
        assert seen and any(size % 8 for size in seen) and max(seen) <= 256
    assert F.scaled_dot_product_attention is SDPA


def test_sage_refuses_a_head_the_channel_would_widen_past_128(monkeypatch):
    config = dict(comfy_host.FLUX_COMFY, hidden_size=256, num_heads=2, axes_dim=[32, 48, 48])  # heads of 128
    model = comfy_host.model_patcher("Flux", config)
    args, conds = _inputs("flux")
    seen = pick(monkeypatch, "sage")
    with pytest.raises(ValueError, match=r"SageAttention \(ComfyUI's --use-sage-attention\) takes heads of at most "
                                         r"128 channels: this model's have 128.*proportional_attention off"):
        comfy_host.run(tome(model, True), *args, **conds)
    assert seen == [] and F.scaled_dot_product_attention is SDPA
    comfy_host.run(tome(model, False), *args, **conds)  # without the weights sage runs it
    assert seen and max(seen) == 128
    seen = pick(monkeypatch, "flash")  # flash-attn takes up to 256: the weighed call runs there
    comfy_host.run(tome(model, True), *args, **conds)
    assert max(seen) > 128


def test_another_nodes_override_still_runs_and_sees_the_weighed_heads(references, monkeypatch):
    model, args, conds, _, reference = references["flux"]
    calls = []

    def other(func, *a, **k):  # a node that routes ComfyUI's attention itself (KJNodes' sage patch does)
        calls.append(a[0].shape[-1] if k.get("skip_reshape") else None)
        return func(*a, **k)

    pick(monkeypatch, "sub_quad")
    clone = model.clone()
    clone.model_options.setdefault("transformer_options", {})["optimized_attention_override"] = other
    out = comfy_host.run(tome(clone, True), *args, **conds)
    torch.testing.assert_close(out, reference, rtol=0, atol=2e-5 * reference.abs().max())
    head = 32 // 2  # FLUX_COMFY: hidden 32, 2 heads
    assert calls == [head + 1] * 4  # each attention of the 2 double and 2 single blocks, merged and weighed
    assert clone.model_options["transformer_options"]["optimized_attention_override"] is other


def test_the_callers_options_are_left_as_they_were(references, monkeypatch):
    model, args, conds, _, _ = references["wan"]
    pick(monkeypatch, "sub_quad")
    patched = tome(model, True)
    options = {"wrappers": patched.wrappers}
    with torch.no_grad():
        patched.model.apply_model(args[0], args[1], c_crossattn=args[2], transformer_options=options, **conds)
    assert set(options) == {"wrappers"}
    assert "optimized_attention_override" not in patched.model_options.get("transformer_options", {})


def test_compiled_as_comfyuis_compile_node_does_one_graph_equal_to_eager(references, monkeypatch):
    """ComfyUI's TorchCompileModel node (set_torch_compile_wrapper) with fullgraph=True: the override traces into the
    graph, the second call reuses it, and both equal eager ToMe."""
    from comfy_api.torch_helpers.torch_compile import set_torch_compile_wrapper
    from torch._dynamo.testing import CompileCounter

    model, args, conds, _, reference = references["flux"]
    pick(monkeypatch, "pytorch")  # ComfyUI's default on NVIDIA GPUs (its sub-quadratic attention opens a file)
    patched = tome(model, True)
    counter = CompileCounter()
    torch._dynamo.reset()
    try:
        set_torch_compile_wrapper(patched, backend=counter, fullgraph=True)
        outs = [comfy_host.run(patched, *args, **conds) for _ in range(2)]
    finally:
        torch._dynamo.reset()
    assert counter.frame_count == 1
    for out in outs:
        torch.testing.assert_close(out, reference, rtol=0, atol=2e-5 * reference.abs().max())


@pytest.mark.parametrize("kernel", ["pytorch", "sage", "flash"])
@pytest.mark.parametrize("family", ["sd1", "flux", "sd3.5"])
def test_heads_padded_as_on_cuda_weigh_alike(family, kernel, references, monkeypatch):
    """CUDA's rule (torch_sdpa.channels: the bias channel and zeros up to a multiple of 8), taken on this CPU."""
    import tomesd.hosts.comfyui_attention as seam

    model, args, conds, _, reference = references[family]
    monkeypatch.setattr(seam, "channels", lambda size, device: 8 - size % 8)
    seen = pick(monkeypatch, kernel)
    comfy_host.run(tome(model, False), *args, **conds)
    natural = Counter(seen or ())  # the head sizes of one call unweighed
    out = comfy_host.run(tome(model, True), *args, **conds)
    torch.testing.assert_close(out, reference, rtol=0, atol=2e-5 * reference.abs().max())
    if seen is not None:  # the weighed calls' heads, each a multiple of 8 (4 -> 8, 8 -> 16, ...)
        widened = Counter(seen) - natural - natural
        assert widened and all(size % 8 == 0 for size in widened), (natural, widened)


def test_the_override_takes_each_form_of_comfyuis_attention_call():
    """Heads by position or keyword, split or already [B, heads, S, D], the output gathered or not, and a function that
    gathers the heads although asked not to (attention_pytorch past its batch limit): each call weighs as the formula."""
    from tomesd.backends.seam import Arming
    from tomesd.backends.torch_sdpa import KeyWeights
    from tomesd.hosts.comfyui_attention import WeighingOverride

    class Seam:
        def __init__(self, weights):
            self.arming = Arming(weights, 1)

        def armed(self):
            return self.arming

    gen = torch.Generator().manual_seed(0)
    b, heads, s, d = 2, 3, 6, 8
    q, k, v = (torch.randn(b, heads, s, d, generator=gen) for _ in range(3))
    log_sizes = torch.rand(b, s - 2, generator=gen) * 2  # the merged keys after 2 text keys
    bias = torch.cat([torch.zeros(b, 2), log_sizes], 1)[:, None, None, :]
    expected = ((q @ k.transpose(-1, -2)) / math.sqrt(d) + bias).softmax(-1) @ v  # [B, heads, S, D]
    basic = attention.attention_basic.__wrapped__

    def gathers_anyway(q, k, v, heads, skip_reshape=False, skip_output_reshape=False, **kwargs):
        return basic(q, k, v, heads, skip_reshape=skip_reshape, skip_output_reshape=False, **kwargs)

    def gathered(t):
        return t.transpose(1, 2).reshape(b, s, heads * d)

    for func in (basic, gathers_anyway):
        for split in (False, True):
            for keep_heads in (False, True):
                for by_name in (False, True):
                    qkv = (gathered(q), gathered(k), gathered(v)) if split else (q, k, v)
                    args, kwargs = (qkv, {"heads": heads}) if by_name else (qkv + (heads, None), {})
                    override = WeighingOverride(Seam(KeyWeights(log_sizes, False)))
                    out = override(func, *args, skip_reshape=not split, skip_output_reshape=keep_heads, **kwargs)
                    want = expected if keep_heads else gathered(expected)
                    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    override = WeighingOverride(Seam(KeyWeights(log_sizes, False)))
    with pytest.raises(ValueError, match="got an attention mask; turn proportional_attention off"):
        override(basic, q, k, v, heads, mask=torch.zeros(s, s), skip_reshape=True)
