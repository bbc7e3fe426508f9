"""Proportional attention (apply_patch(proportional_attention=True)): a merged key weighs as the tokens it holds.

The exact property: attention over merged rows with proportional weights equals attention over every token when
the tokens merged together are identical copies. Then, on every family: each merged self- or joint attention
weighs its image keys by their sizes (which sum to the tokens merged) and its text keys by one, through the same
fused SDPA kernel as unpatched and with no mask; no graph breaks under torch.compile; refusals by name."""
import copy

import pytest
import torch
import torch.nn.functional as F

import tomesd
from families import FAMILIES, missing_host
from probes import CountingBackend, assert_compiled_equals_eager
from probes import OpCounter
from tomesd.backends import torch_dispatch, torch_sdpa

NAMES = [pytest.param(name, marks=pytest.mark.skipif(bool(missing_host(family)), reason=missing_host(family)))
         for name, family in FAMILIES.items()]
SDPA = F.scaled_dot_product_attention


def _groups(tokens, rows, generator):
    """An index map of `tokens` tokens onto `rows` rows, every row holding at least one token."""
    rest = torch.randint(0, rows, (tokens - rows,), generator=generator)
    return torch.cat([torch.arange(rows), rest])[torch.randperm(tokens, generator=generator)]


@pytest.mark.parametrize("head", [40, 64, 72])
@pytest.mark.parametrize("text, first", [(0, False), (5, False), (5, True)])
def test_weighted_attention_over_merged_copies_equals_attention_over_every_token(head, text, first):
    g = torch.Generator().manual_seed(head + text)
    batch, heads, tokens, rows = 2, 3, 24, 9
    index = torch.stack([_groups(tokens, rows, g) for _ in range(batch)])  # [B, N]: each token's merged row
    q_rows, k_rows, v_rows = (torch.randn(batch, heads, rows, head, generator=g) for _ in range(3))
    q_text, k_text, v_text = (torch.randn(batch, heads, text, head, generator=g) for _ in range(3))
    copies = lambda x: torch.gather(x, 2, index[:, None, :, None].expand(batch, heads, tokens, head))

    def joined(image, words):
        return torch.cat([image, words] if first else [words, image], 2)

    full = SDPA(joined(copies(q_rows), q_text), joined(copies(k_rows), k_text), joined(copies(v_rows), v_text))
    sizes = torch.zeros(batch, rows).scatter_add_(1, index, torch.ones(batch, tokens))
    weights = torch_sdpa.KeyWeights(sizes.log(), first)
    merged = weights(SDPA, joined(q_rows, q_text), joined(k_rows, k_text), joined(v_rows, v_text))
    plain = SDPA(joined(q_rows, q_text), joined(k_rows, k_text), joined(v_rows, v_text))
    # Each merged row's query stands for its copies: its output equals theirs in the full attention.
    image = slice(0, rows) if first else slice(text, text + rows)
    full_image = full[:, :, :tokens] if first else full[:, :, text:]
    expected = torch.gather(merged[:, :, image], 2, index[:, None, :, None].expand(batch, heads, tokens, head))
    assert (torch.gather(plain[:, :, image], 2, index[:, None, :, None].expand(batch, heads, tokens, head))
            - full_image).abs().max() > 1e-2  # unweighted merging is far off
    torch.testing.assert_close(expected, full_image, atol=1e-5, rtol=1e-5)
    text_rows = slice(rows, None) if first else slice(0, text)
    torch.testing.assert_close(merged[:, :, text_rows], full[:, :, tokens:] if first else full[:, :, :text],
                               atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module", params=NAMES)
def family(request):
    family = FAMILIES[request.param]
    return family, family.build().eval()


def _patched(family, model, **extra):
    base = {} if extra.get("mode") == "downsample" else (family.patch or dict(ratio=0.5))
    return tomesd.apply_patch(model, **{**base, **extra})


def _refuses_weights(family, model, setting=None):
    """A kind whose attention has no softmax (Sana's linear attention) refuses the weights before patching."""
    from tomesd.families import block_kind

    if not any(block_kind(m) is not None and block_kind(m).no_weights for m in model.modules()):
        return False
    with pytest.raises(ValueError, match="proportional_attention cannot run on .*proportional_attention=False"):
        _patched(family, model, proportional_attention=True, **(setting or {}))
    assert not hasattr(model, "_tome_patch")
    return True


def _silent_text(inputs):
    """Text that is all zeros: its keys are one row repeated in every attention (image keys differ)."""
    return {k: (torch.zeros_like(v) if k == "encoder_hidden_states" else v) for k, v in inputs.items()}


class _Recorder:
    """The calls of torch's SDPA under the seam's wrapper: (query, key, scale) of each weighed call."""

    def __init__(self, fn):
        self.fn, self.weighed = fn, []

    def __call__(self, query, key, value, *args, **kwargs):  # (HunyuanDiT passes the mask and the rest by position)
        if kwargs.get("scale") is not None and (query == 1).all(dim=(0, 1, 2)).any():  # the seam's channel of ones
            self.weighed.append((query, key, kwargs["scale"]))
        return self.fn(query, key, value, *args, **kwargs)


@pytest.mark.parametrize("mode", ["merge", "downsample"])
def test_each_merged_attention_weighs_its_image_keys_by_size_and_its_text_keys_by_one(family, mode, unpatch):
    family, model = family
    inputs = _silent_text(family.inputs(model, batch=2, seed=3))
    setting = {} if mode == "merge" else dict(mode="downsample")  # (the family's merge arguments left out)
    if _refuses_weights(family, model, setting):
        return
    try:
        plain = (_patched(family, model, **setting), family.run(model, inputs), tomesd.remove_patch(model))[1]
    except ValueError as refusal:  # what refuses downsampling (CogVideoX; a reference's tokens) refuses it weighed too
        assert mode == "downsample" and "use mode='merge'" in str(refusal)
        tomesd.remove_patch(model)
        with pytest.raises(ValueError, match="use mode='merge'"):  # at apply time, or at the call that reveals it
            _patched(family, model, proportional_attention=True, **setting)
            unpatch(model)
            family.run(model, inputs)
        return
    _patched(family, model, proportional_attention=True, **setting)
    unpatch(model)
    # Under the SDPA seam's wrapper, or (weights joined at diffusers' dispatch: Flux, Wan) torch's SDPA itself
    wrapper = F.scaled_dot_product_attention
    own = getattr(wrapper, "fn", None)
    recorder = _Recorder(own if own is not None else wrapper)
    if own is not None:
        wrapper.fn = recorder
    else:
        F.scaled_dot_product_attention = recorder
    try:
        with tomesd.observe(model) as seen:
            out = family.run(model, inputs)
    finally:
        if own is not None:
            wrapper.fn = own
        else:
            F.scaled_dot_product_attention = wrapper
    if mode == "merge" or recorder.weighed:  # (whole downsampling cells over image keys alone weigh alike: no call)
        assert (out - plain).abs().max() > 1e-4  # the weights change the output
    # Tokens merged away at each merged attention site (a span's record counts its text too).
    site = "attn" if mode == "merge" else "downsample"
    sites = sorted(n - m for call in seen.calls for block in call.blocks.values()
                   for n, m in block.sites.get(site, []) if m < n)
    weighed = []
    for query, key, scale in recorder.weighed:
        head = int((query == 1).all(dim=(0, 1, 2)).nonzero()[-1])  # the channel of ones the seam added
        bias, rows = key[0, 0, :, head] * scale, key[0, 0, :, :head]  # log of each key's tokens; the keys
        text = torch.zeros(len(rows), dtype=torch.bool)
        for end in (0, -1):  # the text: one row repeated at either end of the keys
            same = (rows - rows[end]).abs().amax(-1) < 1e-4 * rows.abs().max()
            if same.sum() > 1:
                text = same
        assert not text.any() or bias[text].abs().max().item() == 0  # text keys weigh one
        sizes = bias[~text].exp()
        assert torch.allclose(sizes, sizes.round(), atol=1e-4) and sizes.min() >= 1 - 1e-4
        weighed.append(int(sizes.sum().round()) - len(sizes))
    if mode == "downsample" and family.name in ("sd1-unet", "controlnet-xs", "pixart", "unet3d", "wan", "chronoedit",
                                                  "skyreels-v2", "wan-vace", "wan-animate", "cosmos", "latte",
                                                  "ltx-video", "ltx2", "anyflow"):
        assert weighed == []  # image keys alone, in whole cells: the weights would cancel, SDPA runs as it came
        return
    assert sorted(weighed) == sites  # one weighed SDPA per merged attention: its image keys hold every token


class _MaskSeen(OpCounter):
    """Counts ops, and the attention ops that were handed a mask."""

    def __init__(self):
        super().__init__()
        self.masked = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "attention" in str(func) and (kwargs or {}).get("attn_mask") is not None:
            self.masked.append(str(func))
        return super().__torch_dispatch__(func, types, args, kwargs)


def test_the_fused_kernel_runs_as_unpatched_with_no_mask(family, unpatch):
    family, model = family
    if _refuses_weights(family, model):
        return
    inputs = family.inputs(model, batch=2, seed=3)
    given = []  # the masked attention ops of the unpatched model (LTX-Video's and LTX-2's cross-attentions take the text's mask)

    def attention_ops():
        with _MaskSeen() as ops:
            family.run(model, inputs)
        assert ops.masked == given  # no attention op got a mask (or bias) tensor the unpatched model did not give
        return {op: n for op, n in ops.ops.items() if "attention" in op}

    with _MaskSeen() as ops:
        family.run(model, inputs)
    given.extend(op for op in ops.masked if family.name in ("ltx-video", "ltx2"))  # their text cross-attentions
    unpatched = attention_ops()
    _patched(family, model)
    merged = attention_ops()
    tomesd.remove_patch(model)
    _patched(family, model, proportional_attention=True)
    unpatch(model)
    assert unpatched and any("flash" in op for op in unpatched)
    assert attention_ops() == merged == unpatched


def test_removal_restores_torch_sdpa_and_copies_carry_the_weights(family):
    family, model = family
    if _refuses_weights(family, model):
        return
    inputs = family.inputs(model, batch=2, seed=4)
    _patched(family, model, proportional_attention=True)
    # torch's SDPA wrapped, or where every weighed attention calls diffusers' dispatch, its backends (any kernel)
    seam = torch_dispatch.SEAM if _backends_wrapped() else torch_sdpa.SDPA_SEAM
    assert seam.in_use and (seam is torch_dispatch.SEAM or F.scaled_dot_product_attention is not SDPA)
    out = family.run(model, inputs)
    twin = copy.deepcopy(model)
    tomesd.remove_patch(model)
    assert seam.in_use  # the copy still weighs
    torch.testing.assert_close(family.run(twin, inputs), out, atol=0, rtol=0)
    tomesd.remove_patch(twin)
    assert F.scaled_dot_product_attention is SDPA and not _backends_wrapped()


def _backends_wrapped():
    """Whether some backend of diffusers' attention dispatch is wrapped by ToMe's seam."""
    registry = getattr(torch_dispatch._registry(), "_backends", {}) if torch_dispatch.available() else {}
    return any(isinstance(fn, torch_dispatch._Wrapped) for fn in registry.values())


def test_an_attention_that_does_not_call_sdpa_is_refused_by_name(unpatch):
    from diffusers.models.attention_processor import AttnProcessor

    family = FAMILIES["sd1-unet"]
    model = family.build().eval()
    model.set_attn_processor(AttnProcessor())  # its own softmax
    _patched(family, model, proportional_attention=True)
    unpatch(model)
    with pytest.raises(RuntimeError, match="proportional_attention=False.*|AttnProcessor"):
        family.run(model, family.inputs(model))


def test_compiled_forward_has_no_graph_breaks_and_equals_eager(unpatch):
    family = FAMILIES["flux"]
    model = family.build().eval()
    inputs = family.inputs(model, batch=2, seed=5)
    _patched(family, model, proportional_attention=True)
    unpatch(model)
    eager = family.run(model, inputs)
    torch._dynamo.reset()
    try:
        backend = CountingBackend()
        compiled = torch.compile(lambda: family.run(model, inputs), backend=backend, fullgraph=True)()  # a break raises
    finally:
        torch._dynamo.reset()
    assert backend.graphs == 1
    assert_compiled_equals_eager(compiled, eager)


def test_proportional_attention_is_a_merge_setting():
    with pytest.raises(ValueError, match="proportional_attention must be True or False"):
        tomesd.ToMeConfig(proportional_attention="yes")
    from tome_core import ToMeArgs

    assert ToMeArgs(mode="downsample", proportional_attention=True).proportional_attention
    with pytest.raises(ValueError, match="proportional_attention must be True or False"):
        ToMeArgs(mode="downsample", proportional_attention=1)


def _ldm_output(model, **settings):
    import tiny_torch as T

    x, t, text = T.unet_inputs()
    if settings:
        tomesd.apply_patch(model, ratio=0.5, **settings)
    try:
        with torch.no_grad():
            return model.model.diffusion_model(x, t.expand(2), context=text)
    finally:
        tomesd.remove_patch(model)


def test_the_original_ldm_code_weighs_its_keys_in_its_projections_as_sdpa_would():
    """LDM's CrossAttention forms softmax(q k^T * scale) itself: the weights ride as a channel per head of to_q's and
    to_k's outputs. Its output equals the same weights' where every CrossAttention calls torch's SDPA instead (a
    subclass named elsewhere, so the SDPA seam weighs it), and the weights move it far beyond the round-off."""
    import tiny_torch as T
    from ldm.modules.attention import CrossAttention

    class SdpaCrossAttention(CrossAttention):  # the same attention through torch's SDPA (looked up at the call)
        def forward(self, x, context=None, mask=None):
            context = x if context is None else context
            q, k, v = (t.reshape(t.shape[0], t.shape[1], self.heads, -1).transpose(1, 2)
                       for t in (self.to_q(x), self.to_k(context), self.to_v(context)))
            out = F.scaled_dot_product_attention(q, k, v, scale=self.scale)
            return self.to_out(out.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1))

    own, through_sdpa = T.ldm_model(), T.ldm_model()
    for module in through_sdpa.modules():
        if type(module) is CrossAttention:
            module.__class__ = SdpaCrossAttention
    base, base_sdpa = _ldm_output(own), _ldm_output(through_sdpa)
    plain = _ldm_output(own, use_rand=False)
    weighed = _ldm_output(own, use_rand=False, proportional_attention=True)
    weighed_sdpa = _ldm_output(through_sdpa, use_rand=False, proportional_attention=True)
    tol = 1e-5 * base.abs().max().item()
    assert (base - base_sdpa).abs().max().item() < tol  # the two attentions agree unpatched
    assert (weighed - plain).abs().max().item() > 1000 * tol
    assert (weighed - weighed_sdpa).abs().max().item() < tol
    assert torch.equal(_ldm_output(own), base)  # removed: no hook left on to_q / to_k
    assert not any(m._forward_hooks for name, m in own.named_modules() if name.endswith(("to_q", "to_k")))
    # patched again (as the web UIs do per pass): one channel per head again, not one more per patch before it
    assert torch.equal(_ldm_output(own, use_rand=False, proportional_attention=True), weighed)


def test_the_ldm_code_under_the_web_uis_sdp_optimization_is_weighed_at_sdpa(monkeypatch):
    """A1111 replaces LDM CrossAttention's forward with its optimization's; its SDP one scales by the heads' width, so
    an extra channel in to_q / to_k would change the scale silently. There the weights go to torch's SDPA instead:
    the same output as LDM's own forward with the weights in its projections."""
    import tiny_torch as T
    from ldm.modules.attention import CrossAttention

    weighed = _ldm_output(T.ldm_model(), use_rand=False, proportional_attention=True)
    plain = _ldm_output(T.ldm_model(), use_rand=False)

    def sdp_forward(self, x, context=None, mask=None):  # the shape of A1111's scaled_dot_product_attention_forward
        context = x if context is None else context
        q, k, v = (t.reshape(t.shape[0], t.shape[1], self.heads, -1).transpose(1, 2)
                   for t in (self.to_q(x), self.to_k(context), self.to_v(context)))
        out = F.scaled_dot_product_attention(q, k, v)
        return self.to_out(out.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1))

    monkeypatch.setattr(CrossAttention, "forward", sdp_forward)
    hijacked = _ldm_output(T.ldm_model(), use_rand=False, proportional_attention=True)
    tol = 1e-5 * weighed.abs().max().item()
    assert (weighed - plain).abs().max().item() > 1000 * tol
    assert (hijacked - weighed).abs().max().item() < tol


@pytest.mark.skipif(not torch_dispatch.available(), reason="this diffusers has no attention dispatch, nor context "
                    "parallelism (env (a), current diffusers, runs it)")
def test_under_context_parallelism_the_weights_move_to_the_dispatch_or_are_refused_by_name(unpatch):
    """At the first call that finds a context-parallel split, the weights join the keys at diffusers' attention
    dispatch, before the ranks exchange them (test_context_parallel.py runs it on gloo); a weighed attention whose
    processor does not call the dispatch is refused by name."""
    from tomesd.runtime import key_weights
    from tomesd.runtime.tome_patch import PATCH_ATTR

    family = FAMILIES["flux"]
    model = family.build().eval()
    _patched(family, model, proportional_attention=True)
    unpatch(model)
    patch = getattr(model, PATCH_ATTR)
    key_weights.weigh_at_dispatch(patch)
    assert patch.key_seam is torch_dispatch.SEAM

    class OwnProcessor:  # an attention computed without diffusers' dispatch
        def __call__(self, attn, hidden_states, *args, **kwargs):
            return hidden_states

    model = family.build().eval()
    model.transformer_blocks[0].attn.set_processor(OwnProcessor())
    _patched(family, model, proportional_attention=True)
    unpatch(model)
    with pytest.raises(ValueError, match="OwnProcessor of FluxTransformerBlock does not call it; use a processor "
                                         "that calls dispatch_attention_fn"):
        key_weights.weigh_at_dispatch(getattr(model, PATCH_ATTR))