"""A batch run as several calls (CFG parallelism runs the guidance halves on two processes; a user loops over
prompts) gives what one call gives, in the default configuration: the random dst pattern is keyed by (seed,
timestep, block), so every call of a step draws alike, odd batches included (tomesd turned random dst off for
them), and every sample is matched on its own. Flux's rotary rows [S, D] have no batch axis: in a batch, its
processor gets identity rows and diffusers' attention dispatch rotates each sample by its own rows; Wan's
rows [1, S, 1, D] take a batch axis as they are. mode="downsample" reads no token values and splits too."""
import pytest
import torch

import tiny_torch as T
import tomesd

TOL = 1e-4  # a batch of one and a batch of two differ by round-off in the host's own matrix products (~1e-5)


def sd1():
    x, t, c = T.unet_inputs(batch=2)
    return T.unet(), dict(sample=x, timestep=t, encoder_hidden_states=c)


def sdxl():
    x, t, c = T.unet_inputs(batch=2)
    model = T.unet(T.SDXL_UNET)
    return model, dict(sample=x, timestep=t, encoder_hidden_states=c)


def transformer(kind):
    return lambda: (T.transformer(kind), T.transformer_inputs(kind, batch=2))


MODELS = {"sd1": (sd1, {}), "sdxl": (sdxl, {}), "sd3": (transformer("sd3"), {}), "pixart": (transformer("pixart"), {}),
          "flux": (lambda: (T.flux(), T.flux_inputs(h=7, w=9)), {}),
          "wan": (lambda: (T.wan(), T.wan_inputs(h=10, w=14)), {}),
          "flux-downsample": (lambda: (T.flux(), T.flux_inputs(h=7, w=9)), dict(mode="downsample")),
          "wan-downsample": (lambda: (T.wan(), T.wan_inputs(h=10, w=14)), dict(mode="downsample"))}


def halves(inputs, i):
    """Sample i of every batched input (the ids and other per-call tensors stay whole)."""
    out = {}
    for name, value in inputs.items():
        batched = isinstance(value, torch.Tensor) and value.ndim > 0 and value.shape[0] == 2 and not name.endswith("_ids")
        out[name] = value[i:i + 1] if batched else value
    return out


def forward(model, inputs):
    with torch.no_grad():
        return model(**inputs).sample


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_batch_split_over_calls_equals_one_call(name):
    build, settings = MODELS[name]
    model, inputs = build()
    base = forward(model, inputs)
    host_split = torch.cat([forward(model, halves(inputs, i)) for i in range(2)])
    assert (host_split - base).abs().max().item() < TOL
    tomesd.apply_patch(model, **(settings or dict(ratio=0.5)))  # otherwise the defaults (use_rand on)
    try:
        joint = forward(model, inputs)
        split = torch.cat([forward(model, halves(inputs, i)) for i in range(2)])
    finally:
        tomesd.remove_patch(model)
    assert (joint - base).abs().max().item() > 100 * TOL  # ToMe acts
    torch.testing.assert_close(split, joint, rtol=0, atol=TOL)


def test_rotation_at_the_dispatch_is_the_hosts_own_per_sample():
    """Identity rows leave the processor's queries as they are, bit for bit, and the dispatch's rewrite
    rotates each sample exactly as diffusers' apply_rotary_emb rotates it with that sample's rows."""
    from diffusers.models.embeddings import apply_rotary_emb
    from tomesd.backends.torch_dispatch import rotation_at_dispatch

    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 2, 7, 3, 8, generator=gen)  # [B, S, heads, dim] each
    rows = torch.randn(2, 7, 8, generator=gen), torch.randn(2, 7, 8, generator=gen)  # per-sample (cos, sin)
    identity, rotate = rotation_at_dispatch("cos_sin", rows)
    assert torch.equal(apply_rotary_emb(q, identity, sequence_dim=1), q)
    out = rotate(dict(query=q, key=k, value=q))
    for i in range(2):
        mine = (rows[0][i], rows[1][i])
        assert torch.equal(out["query"][i:i + 1], apply_rotary_emb(q[i:i + 1], mine, sequence_dim=1))
        assert torch.equal(out["key"][i:i + 1], apply_rotary_emb(k[i:i + 1], mine, sequence_dim=1))
    assert out["value"] is q


class Undispatched:
    """Flux's own processor calling attention without diffusers' dispatch (as diffusers before 0.35 did)."""

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, *args, **kwargs):
        import sys

        module = sys.modules[type(self.inner).__module__]
        dispatch = module.dispatch_attention_fn
        module.dispatch_attention_fn = lambda q, k, v, **_: torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
        try:
            return self.inner(*args, **kwargs)
        finally:
            module.dispatch_attention_fn = dispatch


def test_a_processor_that_does_not_dispatch_matches_the_batch_at_once_or_is_refused_when_set_later():
    model, inputs = T.flux(), T.flux_inputs()
    blocks = list(model.transformer_blocks) + list(model.single_transformer_blocks)
    own = [block.attn.processor for block in blocks]
    blocks[0].attn.set_processor(Undispatched(own[0]))
    tomesd.apply_patch(model, ratio=0.5)  # set before: that block's rows cannot follow each sample
    try:
        assert model._tome_patch.per_sample is False
        forward(model, inputs)
    finally:
        tomesd.remove_patch(model)
    blocks[0].attn.set_processor(own[0])
    tomesd.apply_patch(model, ratio=0.5)
    try:
        assert model._tome_patch.per_sample is True
        blocks[1].attn.set_processor(Undispatched(own[1]))  # set after: refused, naming what to do
        forward(model, halves(inputs, 0))  # a batch of one takes its rows in the processor
        with pytest.raises(RuntimeError, match="call apply_patch again after changing processors"):
            forward(model, inputs)
    finally:
        tomesd.remove_patch(model)
        blocks[1].attn.set_processor(own[1])
