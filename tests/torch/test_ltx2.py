"""LTX-2 (diffusers' LTX2VideoTransformer3DModel; tomesd/families/video/ltx.py): the video stream's tokens merge
around its self-attention, its text cross-attention, its audio-to-video cross-attention (video queries over the
audio) and its feed-forward; the audio stream's sub-layers, and the video-to-audio cross-attention (audio queries
over the video), never see a merged token. Its rotary rows ([B, S, D], or [B, heads, S, D/2] split) follow the
merged tokens per sample. The whole contract: tests/families.py ("ltx2"); mode="downsample" against a reference by
hand: test_downsample_dispatch.py. What cannot merge is refused by name."""
import contextlib
from collections import defaultdict

import pytest
import torch

import tiny_ltx2_family as L2
import tomesd
from families import FAMILIES, flipped, missing_host

TOL = 1e-5
FAMILY = FAMILIES["ltx2"]
pytestmark = pytest.mark.skipif(bool(missing_host(FAMILY)), reason=missing_host(FAMILY))
EVERY_SITE = dict(ratio=0.5, merge_crossattn=True, merge_mlp=True)
AUDIO = ("audio_attn1", "audio_attn2", "video_to_audio_attn")  # the attentions whose queries are the audio's


@contextlib.contextmanager
def attentions_seen(model):
    """What each LTX2Attention's processor is given (inside ToMe's hooks, which sit innermost around the attention's
    forward): {module name: [dict(queries, keys, query_rows, key_rows)]}."""
    from diffusers.models.transformers import transformer_ltx2 as host

    names = {id(module): name.rsplit(".", 1)[-1] for name, module in model.named_modules()}
    seen = defaultdict(list)
    original = host.LTX2AudioVideoAttnProcessor.__call__

    def spy(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, query_rotary_emb=None,
            key_rotary_emb=None):
        keys = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        seen[names[id(attn)]].append(dict(queries=hidden_states, keys=keys, query_rows=query_rotary_emb,
                                          key_rows=key_rotary_emb))
        return original(self, attn, hidden_states, encoder_hidden_states, attention_mask, query_rotary_emb,
                        key_rotary_emb)

    host.LTX2AudioVideoAttnProcessor.__call__ = spy
    try:
        yield seen
    finally:
        host.LTX2AudioVideoAttnProcessor.__call__ = original


def audio_ff_tokens(model, inputs):
    """The token count each block's audio feed-forward is given (a module ToMe never hooks)."""
    counts = []
    handles = [block.audio_ff.register_forward_pre_hook(lambda m, args: counts.append(args[0].shape[1]))
               for block in model.transformer_blocks]
    try:
        L2.run_both(model, inputs)
    finally:
        for handle in handles:
            handle.remove()
    return counts


def test_the_audio_stream_sees_every_audio_token_and_the_video_to_audio_attention_every_video_token():
    model = L2.ltx2().eval()
    inputs = L2.ltx2_inputs(model)
    n, a = inputs["hidden_states"].shape[1], inputs["audio_hidden_states"].shape[1]
    with attentions_seen(model) as plain:
        video, audio = L2.run_both(model, inputs)
    plain_ff = audio_ff_tokens(model, inputs)
    tomesd.apply_patch(model, **EVERY_SITE)
    try:
        with attentions_seen(model) as merged, tomesd.observe(model) as seen:
            merged_video, merged_audio = L2.run_both(model, inputs)
        merged_ff = audio_ff_tokens(model, inputs)
    finally:
        tomesd.remove_patch(model)
    (given, m), = seen.calls[0].blocks[0].tokens("attn")
    assert given == n > m
    # The video's own sub-layers ran on the merged tokens: self-attention (queries and keys), the text's and the
    # audio's cross-attention (queries).
    assert [(s["queries"].shape[1], s["keys"].shape[1]) for s in merged["attn1"]] == [(m, m)]
    assert [s["queries"].shape[1] for s in merged["attn2"] + merged["audio_to_video_attn"]] == [m, m]
    # The audio's: as many tokens as unpatched, every audio token, and the video-to-audio attention's keys are
    # every video token (not the merged ones); the audio-to-video attention's keys are every audio token.
    for name in AUDIO:
        shapes = [(s["queries"].shape[1], s["keys"].shape[1]) for s in merged[name]]
        assert shapes == [(s["queries"].shape[1], s["keys"].shape[1]) for s in plain[name]] and shapes[0][0] == a
    assert [s["keys"].shape[1] for s in merged["video_to_audio_attn"]] == [n]
    assert [s["keys"].shape[1] for s in merged["audio_to_video_attn"]] == [a]
    assert merged_ff == plain_ff == [a]
    # Before the streams meet (block 0's audio self-attention), the audio's tokens are the unpatched model's, bit
    # for bit; after, they differ only through what the audio attends to in the (merged-around) video.
    assert torch.equal(merged["audio_attn1"][0]["queries"], plain["audio_attn1"][0]["queries"])
    assert (merged_video - video).abs().max().item() > 1000 * TOL
    assert merged_audio.shape == audio.shape


def test_ratio_zero_equals_the_unpatched_model_bit_for_bit_video_and_audio():
    model = L2.ltx2().eval()
    inputs = L2.ltx2_inputs(model)
    video, audio = L2.run_both(model, inputs)
    tomesd.apply_patch(model, ratio=0.0, merge_crossattn=True, merge_mlp=True)
    try:
        with tomesd.observe(model) as seen:
            zero_video, zero_audio = L2.run_both(model, inputs)
    finally:
        tomesd.remove_patch(model)
    assert torch.equal(zero_video, video) and torch.equal(zero_audio, audio)
    assert not seen.calls[0].merged_blocks("attn")
    tomesd.apply_patch(model, ratio=0.5)  # the same patch at a ratio that merges moves both outputs
    try:
        merged_video, merged_audio = L2.run_both(model, inputs)
    finally:
        tomesd.remove_patch(model)
    assert (merged_video - video).abs().max().item() > 1000 * TOL
    assert (merged_audio - audio).abs().max().item() > 1000 * TOL  # the audio attends to the video


def _gathered(rows, representatives):
    """Each sample's rows (token axis -2) at its representatives [B, M], by hand."""
    return tuple(torch.stack([table[i].index_select(-2, representatives[i]) for i in range(len(table))])
                 for table in rows)


@pytest.mark.parametrize("rope_type", ["interleaved", "split"])
def test_rotary_rows_follow_each_samples_merged_video_tokens_and_the_audios_rows_stay(rope_type):
    """Rows [B, S, D] ("interleaved") or [B, heads, S, D/2] ("split", LTX-2's checkpoints): the self-attention's
    rows and the audio-to-video attention's query rows are each sample's rows at its representatives; the audio's
    key rows are the unpatched ones. And the batch's order changes no sample's output."""
    model = L2.ltx2(rope_type=rope_type).eval()
    inputs = L2.ltx2_inputs(model)
    with attentions_seen(model) as plain:
        base = L2.run(model, inputs)
    tomesd.apply_patch(model, **EVERY_SITE)
    try:
        with attentions_seen(model) as merged, tomesd.observe(model) as seen:
            out = L2.run(model, inputs)
        backward = L2.run(model, flipped(FAMILY, inputs))
    finally:
        tomesd.remove_patch(model)
    merge = seen.calls[0].blocks[0].merge
    merge = merge if not isinstance(merge, dict) else merge["merge_attn"]
    reps = merge.representatives
    assert reps.ndim == 2 and not torch.equal(reps[0], reps[1])  # a matching per sample, and they differ
    for name in ("attn1", "audio_to_video_attn"):
        (full,), (followed,) = [s["query_rows"] for s in plain[name]], [s["query_rows"] for s in merged[name]]
        assert full[0].ndim == (4 if rope_type == "split" else 3)
        for got, want in zip(followed, _gathered(full, reps)):
            assert torch.equal(got, want)
    for got, want in zip(merged["audio_to_video_attn"][0]["key_rows"], plain["audio_to_video_attn"][0]["key_rows"]):
        assert torch.equal(got, want)
    assert (out - base).abs().max().item() > 1000 * TOL
    assert (out - backward.flip(0)).abs().max().item() < TOL


def test_a_video_self_attention_mask_is_refused_naming_merge_attn_false_which_runs():
    """LTX2InContextPipeline's video_self_attention_mask addresses every video token: merging the self-attention is
    refused at the call; merge_attn=False (the option named) merges the cross-attentions and the feed-forward."""
    model = L2.ltx2().eval()
    inputs = L2.ltx2_inputs(model)
    n = inputs["hidden_states"].shape[1]
    masked = dict(inputs, video_self_attention_mask=torch.ones(2, n, n))
    tomesd.apply_patch(model, ratio=0.5)
    try:
        with pytest.raises(ValueError, match="attention_mask.*merge_attn=False"):
            L2.run(model, masked)
    finally:
        tomesd.remove_patch(model)
    base = L2.run(model, masked)
    tomesd.apply_patch(model, ratio=0.5, merge_attn=False, merge_crossattn=True, merge_mlp=True)
    try:
        with tomesd.observe(model) as seen:
            out = L2.run(model, masked)
    finally:
        tomesd.remove_patch(model)
    assert seen.calls[0].blocks[0].sites.keys() == {"crossattn", "mlp"}
    assert (out - base).abs().max().item() > 1000 * TOL


@pytest.mark.parametrize("call", ["keyframes", "coords"])
def test_calls_with_no_grid_of_the_whole_latent_are_refused_by_name(call):
    """LTX2ConditionPipeline's keyframe tokens (and LTX2InContextPipeline's reference tokens) join the latent after the
    grid's: the grid no longer counts the latent. A call given video_coords alone gives no grid ToMe reads."""
    model = L2.ltx2().eval()
    inputs = L2.ltx2_inputs(model)
    if call == "keyframes":
        joined = torch.cat([inputs["hidden_states"], inputs["hidden_states"][:, :16]], 1)
        coords = model.rope.prepare_video_coords(2, 2, 8, 8, "cpu")
        inputs = dict(inputs, hidden_states=joined, video_coords=torch.cat([coords, coords[:, :, :16]], 2))
        match = "give 128 tokens .* for a latent of 144.*LTX2ConditionPipeline.*without ToMe"
    else:
        inputs = dict(inputs, num_frames=None, height=None, width=None,
                      video_coords=model.rope.prepare_video_coords(2, 2, 8, 8, "cpu"))
        match = "as ints"
    L2.run(model, inputs)  # the host runs it
    tomesd.apply_patch(model, ratio=0.5)
    try:
        with pytest.raises(ValueError, match=match):
            L2.run(model, inputs)
    finally:
        tomesd.remove_patch(model)


def test_pyramid_attention_broadcast_on_all_six_attentions_stacks_and_caches_full_tokens():
    """diffusers' PAB with its default identifiers hooks every attention of the block. The video's merged ones hold
    ToMe's hooks inside the cache (it keeps every video token); the audio's and the video-to-audio attention never
    see a merged token, so a cache on them is no cache inside a merged region: nothing is refused."""
    from diffusers.hooks import PyramidAttentionBroadcastConfig, apply_pyramid_attention_broadcast

    model = L2.ltx2().eval()
    inputs = L2.ltx2_inputs(model)
    n, a = inputs["hidden_states"].shape[1], inputs["audio_hidden_states"].shape[1]
    step = [900]
    apply_pyramid_attention_broadcast(model, PyramidAttentionBroadcastConfig(
        spatial_attention_block_skip_range=2, spatial_attention_timestep_skip_range=(-1, 1000),
        cross_attention_block_skip_range=2, cross_attention_timestep_skip_range=(-1, 1000),
        current_timestep_callback=lambda: step[0]))
    tomesd.apply_patch(model, **EVERY_SITE)
    try:
        with tomesd.observe(model) as seen:
            for t in (900, 800, 700):
                step[0] = t
                L2.run(model, dict(inputs, timestep=torch.full((2,), float(t))))
    finally:
        tomesd.remove_patch(model)
    block = model.transformer_blocks[0]
    kept = {name: getattr(block, name)._diffusers_hook.hooks["pyramid_attention_broadcast"].state.cache.shape[1]
            for name in ("attn1", "attn2", "audio_to_video_attn", "audio_attn1", "audio_attn2", "video_to_audio_attn")}
    assert kept == dict(attn1=n, attn2=n, audio_to_video_attn=n, audio_attn1=a, audio_attn2=a, video_to_audio_attn=a)
    assert seen.calls[0].merged_blocks("attn")


def test_spatio_temporal_guidance_merges_and_what_skips_the_attention_is_refused_by_name():
    """A perturbed-attention model (LTX-2.3's LTX2PerturbedAttnProcessor) in its guidance pass (every sample
    perturbed in the STG blocks: the self-attention gives its values, no attention call) merges in merge mode; the
    options that act inside the attention call, mode="downsample" and proportional attention, are refused at that call
    by name, each naming what runs. A video self-attention mask under mode="downsample" is refused likewise."""
    model = L2.ltx2(perturbed_attn=True).eval()
    inputs = dict(L2.ltx2_inputs(model), spatio_temporal_guidance_blocks=[0])
    base = L2.run(model, inputs)
    tomesd.apply_patch(model, **EVERY_SITE)
    try:
        with tomesd.observe(model) as seen:
            out = L2.run(model, inputs)
    finally:
        tomesd.remove_patch(model)
    assert seen.calls[0].merged_blocks("attn") == [0] and (out - base).abs().max().item() > 1000 * TOL
    n = inputs["hidden_states"].shape[1]
    masked = dict(L2.ltx2_inputs(model), video_self_attention_mask=torch.ones(2, n, n))
    for settings, call, match in ((dict(mode="downsample"), inputs, "no attention call .* use mode='merge'"),
                                  (dict(ratio=0.5, proportional_attention=True), inputs,
                                   "made no call of it.*turn proportional_attention off"),
                                  (dict(mode="downsample"), masked, "attention_mask.*use mode='merge'")):
        tomesd.apply_patch(model, **settings)
        try:
            with pytest.raises((RuntimeError, ValueError), match=match):
                L2.run(model, call)
        finally:
            tomesd.remove_patch(model)
    assert torch.equal(L2.run(model, inputs), base)
