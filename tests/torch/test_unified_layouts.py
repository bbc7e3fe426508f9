"""Unified sequences (tomesd/layouts/unified.py): Z-Image's and Lumina 2's main layers run on one sequence
joining each sample's image and text, padded under a key-padding mask. ToMe merges the image's tokens only, found
on the device wherever each sample's image starts: checked against the places written by hand (text and padding
pass whole and in place, the mask and rotary rows fit the merged sequence), and against the same samples called
alone with their text padding removed."""
import pytest
import torch

import tomesd
import tiny_unified_families as U
from families import FAMILIES, missing_host

pytestmark = pytest.mark.skipif(bool(missing_host(FAMILIES["z-image"])), reason=missing_host(FAMILIES["z-image"]))

TOL = 1e-5


def _recording(processor, seen):
    """The attention's own processor, recording what it is given (after ToMe's hooks merged it)."""
    base = type(processor)
    if base.__name__ == "OmniGenAttnProcessor2_0":
        class Recording(base):
            def __call__(self, attn, hidden_states, encoder_hidden_states, attention_mask=None, image_rotary_emb=None):
                seen.append((hidden_states, attention_mask, image_rotary_emb))
                return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
    elif base.__name__ == "Lumina2AttnProcessor2_0":
        class Recording(base):
            def __call__(self, attn, hidden_states, encoder_hidden_states, attention_mask=None, image_rotary_emb=None,
                         base_sequence_length=None):
                seen.append((hidden_states, attention_mask, image_rotary_emb))
                return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb,
                                        base_sequence_length)
    else:
        class Recording(base):
            def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, freqs_cis=None):
                seen.append((hidden_states, attention_mask, freqs_cis))
                return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, freqs_cis)
    return Recording()


def _first_joint_attention(model, inputs, run, block=2, **patch):
    """What the first main layer's attention is given, unpatched and patched (ToMe in that layer only, `block`, so
    the image tokens reaching it are the same in both calls), and the patched call's output and the plain one."""
    layer = model.layers[0]
    attn = next(getattr(layer, name) for name in ("attn", "attention", "self_attn") if hasattr(layer, name))
    seen = []
    original = attn.processor
    attn.set_processor(_recording(original, seen))
    try:
        base = run(model, inputs)
        tomesd.apply_patch(model, blocks=[block], **patch)
        try:
            out = run(model, inputs)
        finally:
            tomesd.remove_patch(model)
    finally:
        attn.set_processor(original)
    (plain, merged) = seen
    return plain, merged, base, out


def _is_row_of(rows, table):
    """Each of `rows` [M, D] equals one of `table`'s rows [N, D]."""
    return bool((rows[:, None] == table[None]).all(-1).any(-1).all())


def test_lumina2_merges_each_samples_image_after_its_own_text_and_passes_text_and_padding_whole():
    model = U.lumina2().eval()
    valid = (16, 10)
    inputs = U.lumina2_inputs(model, valid=valid)
    (h, mask, rows), (mh, mmask, mrows), base, out = _first_joint_attention(model, inputs, U.run, ratio=0.5)
    n = 8 * 8
    m = n - n // 2
    s = h.shape[1]
    assert s == max(valid) + n and mh.shape[1] == s - (n - m)
    for b, length in enumerate(valid):
        assert torch.equal(mh[b, :length], h[b, :length])  # the text, in place
        assert torch.equal(mh[b, length + m:], h[b, length + n:])  # the padding after the image
        assert torch.equal(mrows[b, :length], rows[b, :length]) and torch.equal(mrows[b, length + m:], rows[b, length + n:])
        assert _is_row_of(mrows[b, length:length + m], rows[b, length:length + n])  # representatives' rows
        expected = torch.arange(s - (n - m)) < length + m  # every merged image row is a real token
        assert torch.equal(mmask.reshape(2, -1)[b], expected)
    assert (out - base).abs().max().item() > 1000 * TOL


def test_z_image_merges_the_image_first_and_passes_its_padding_and_the_captions_whole():
    model = U.z_image().eval()
    inputs = U.z_image_inputs(model, h=12, w=20, texts=(16, 40), as_list=True)
    (h, mask, rows), (mh, mmask, mrows), base, out = _first_joint_attention(model, inputs, U.z_image_run, ratio=0.5)
    n, m = 6 * 10, 30  # 60 image tokens, padded to 64 by pad tokens that must not merge as image
    assert h.shape[1] == 64 + 64 and mh.shape[1] == h.shape[1] - (n - m)
    assert torch.equal(mh[:, m:], h[:, n:])  # the image's padding, captions, their padding and the batch's, in place
    assert torch.equal(mrows[:, m:], rows[:, n:])
    for b in range(2):
        assert _is_row_of(torch.view_as_real(mrows[b, :m]).flatten(1), torch.view_as_real(rows[b, :n]).flatten(1))
    assert torch.equal(mmask, torch.cat([torch.ones(2, m, dtype=torch.bool), mask[:, n:]], 1))
    assert not mmask[0].all()  # the short caption's sample is padded: the mask is really fitted
    assert (out - base).abs().max().item() > 1000 * TOL


@pytest.mark.parametrize("name", ["lumina2", "z-image"])
def test_each_sample_merges_as_it_would_alone_with_its_text_padding_removed(name):
    """Prompts of different lengths in one batch (the pipelines' guidance halves, or several prompts): each sample's
    output equals its own call alone, whose sequence has no padding and no mask."""
    family = FAMILIES[name]
    model = family.build().eval()
    inputs = family.inputs(model)
    if name == "lumina2":
        mask = inputs["encoder_attention_mask"]
        alone = [dict(hidden_states=inputs["hidden_states"][b:b + 1], timestep=inputs["timestep"][b:b + 1],
                      encoder_hidden_states=inputs["encoder_hidden_states"][b:b + 1, :int(mask[b].sum())],
                      encoder_attention_mask=mask[b:b + 1, :int(mask[b].sum())]) for b in range(2)]
    else:
        alone = [dict(x=inputs["x"][b:b + 1], cap_feats=inputs["cap_feats"][b:b + 1], t=inputs["t"][b:b + 1])
                 for b in range(2)]
    base = family.run(model, inputs)
    tomesd.apply_patch(model, ratio=0.5, merge_mlp=True)
    try:
        batch = family.run(model, inputs)
        singles = torch.cat([family.run(model, one) for one in alone])
    finally:
        tomesd.remove_patch(model)
    assert (batch - singles).abs().max().item() < 1e-4
    assert (batch - base).abs().max().item() > 1000 * TOL


def test_z_image_omni_mode_and_mixed_sizes_are_refused_by_name():
    model = U.z_image().eval()
    inputs = U.z_image_inputs(model, as_list=True)
    tomesd.apply_patch(model, ratio=0.5)
    try:
        mixed = dict(inputs, x=[inputs["x"][0], torch.randn(16, 1, 12, 20)])
        with pytest.raises(ValueError, match="latents of different sizes"):
            U.z_image_run(model, mixed)
        omni = dict(inputs, x=[[x] for x in inputs["x"]])
        with pytest.raises(ValueError, match="omni mode"):
            U.z_image_run(model, omni)
    finally:
        tomesd.remove_patch(model)


@pytest.mark.parametrize("name", ["lumina2", "z-image"])
def test_the_text_refiner_never_merges(name):
    family = FAMILIES[name]
    model = family.build().eval()
    tomesd.apply_patch(model, ratio=0.5, merge_mlp=True)
    try:
        with tomesd.observe(model) as seen:
            family.run(model, family.inputs(model))
    finally:
        tomesd.remove_patch(model)
    blocks = seen.calls[0].blocks
    assert 1 not in seen.calls[0].merged_blocks("attn") and not blocks[1].computed  # context_refiner.0
    assert set(seen.calls[0].merged_blocks("mlp")) == set(family.merged_blocks)


@pytest.mark.parametrize("edit", [False, True])
def test_omnigen_merges_the_image_last_and_fits_its_mask_over_query_and_key_pairs(edit):
    """Prompts of different lengths (left-padded), with or without an input image's tokens among the conditions:
    the conditions and the time token pass whole, the mask [B, 1, S, S] keeps its condition rows and columns and
    gives each merged image row and column its representative's (every image row of it is alike, and every column)."""
    model = U.omnigen().eval()
    inputs = U.omnigen_inputs(model, lengths=(24, 15), edit=edit)
    (h, mask, rows), (mh, mmask, mrows), base, out = _first_joint_attention(model, inputs, U.run, block=0, ratio=0.5)
    n, m = 64, 32
    s = h.shape[1]
    front = s - n  # the conditions and the time token
    assert mh.shape[1] == front + m and mmask.shape[-2:] == (front + m, front + m)
    assert torch.equal(mh[:, :front], h[:, :front])
    assert (mask[:, :, front:] == mask[:, :, front:front + 1]).all()  # the precondition: image rows alike
    assert (mask[..., front:] == mask[..., front:front + 1]).all()  # and image columns alike
    assert torch.equal(mmask, mask[:, :, :front + m, :front + m])
    assert (mask[1, 0, front:, :9] < -1e30).all()  # sample 1's padded prompt is masked for the image's queries
    for table, merged in zip(rows, mrows):  # (cos, sin) [S, D]: one matching for the batch
        assert torch.equal(merged[:front], table[:front]) and _is_row_of(merged[front:], table[front:])
    assert (out - base).abs().max().item() > 1000 * TOL


def test_lumina2_trains_under_gradient_checkpointing_as_without():
    """Each sample's image gathered after its own text (the matching's metric) saves nothing for backward, so a
    checkpointed block's recompute (which replays the merge) saves what its forward saved."""
    grads = []
    for checkpointing in (False, True):
        model = U.lumina2().train()
        if checkpointing:
            model.enable_gradient_checkpointing()
        tomesd.apply_patch(model, ratio=0.5, merge_mlp=True)
        try:
            model(**U.lumina2_inputs(model)).sample.square().mean().backward()
        finally:
            tomesd.remove_patch(model)
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert torch.allclose(grads[0], grads[1], atol=1e-6) and grads[0].abs().max() > 0


def test_z_image_controlnet_is_refused_by_name_and_the_transformer_merges_beside_it():
    """ZImageControlNetModel shares the transformer's refiners and runs its control layers on a unified sequence of
    its own: refused by name, with the option that works, patching the transformer alone (the ControlNet's calls of
    the shared refiners, outside the transformer's call, pass unmerged)."""
    transformer = U.z_image().eval()
    controlnet = U.z_image_controlnet(transformer)
    inputs = U.z_image_inputs(transformer, as_list=True)
    control = [torch.randn(16, 1, 16, 16, generator=torch.Generator().manual_seed(9)) for _ in range(2)]

    def run():
        with torch.no_grad():
            samples = controlnet(inputs["x"], inputs["t"], inputs["cap_feats"], control)
            return torch.stack(transformer(**inputs, controlnet_block_samples=samples, return_dict=False)[0])

    with pytest.raises(TypeError, match=r"ZImageControlNetModel.*apply_patch\(pipe.transformer\)"):
        tomesd.apply_patch(controlnet, ratio=0.5)
    base = run()
    tomesd.apply_patch(transformer, ratio=0.5)
    try:
        with tomesd.observe(transformer) as seen:
            out = run()
    finally:
        tomesd.remove_patch(transformer)
    assert [call.merged_blocks("attn") for call in seen.calls] == [[0, 2]]
    assert (out - base).abs().max().item() > 1000 * TOL and torch.equal(run(), base)


def test_an_attention_given_other_context_tokens_than_its_own_is_refused():
    """Lumina 2's attention merges its context input as the same tokens; given another tensor there (a wrapper's
    copy), it refuses rather than attend merged queries over unmerged keys."""
    model = U.lumina2().eval()
    handle = model.layers[0].attn.register_forward_pre_hook(
        lambda module, args, kwargs: (args, {**kwargs, "encoder_hidden_states": kwargs["encoder_hidden_states"] * 1}),
        with_kwargs=True)
    tomesd.apply_patch(model, ratio=0.5)
    try:
        with pytest.raises(ValueError, match="encoder_hidden_states than as its own"):
            U.run(model, U.lumina2_inputs(model))
    finally:
        tomesd.remove_patch(model)
        handle.remove()
