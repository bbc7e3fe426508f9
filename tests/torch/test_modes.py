"""mode="downsample" (ToDo) and reuse_steps / share_across_blocks on torch models."""
import contextlib
import copy
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F

import tiny_torch as T
import tomesd
from threads import Overlap, run_in_threads
from tomesd.runtime.tome_patch import PATCH_ATTR

TOL = 1e-5


def forward(model, inputs):
    x, t, c = inputs
    with torch.no_grad():
        return model(x, t, c).sample


def blocks(model):
    return [m for m in model.modules() if type(m).__name__ == "BasicTransformerBlock"]


def downsample_by_hand(x, h, w, factor, method):
    """The reference: torch's own pooling/interpolation on the [B, C, h, w] image of the tokens."""
    b, n, c = x.shape
    img = x.transpose(1, 2).reshape(b, c, h, w)
    if method == "avg":
        small = F.avg_pool2d(img, factor, ceil_mode=True, count_include_pad=False)
    elif h % factor == 0 and w % factor == 0:
        small = F.interpolate(img, scale_factor=1 / factor, mode="nearest")
    else:
        small = img[:, :, ::factor, ::factor]
    return small.flatten(2).transpose(1, 2)


def hand_patch(model, h, w, factor, method):
    """Downsampled keys/values for the blocks at the finest level, placed by hand (no tomesd code)."""
    handles = []
    for block in blocks(model):
        def pre(module, args, kwargs):
            x = args[0] if args else kwargs["hidden_states"]
            if x.shape[1] != h * w:
                return None
            return args, {**kwargs, "encoder_hidden_states": downsample_by_hand(x, h, w, factor, method)}

        handles.append(block.attn1.register_forward_pre_hook(pre, with_kwargs=True))
    return handles


@contextlib.contextmanager
def self_attention_pairs(model):
    """Yields a list that fills with (query tokens, key tokens) of every self-attention (attn1)
    call inside the block, each query paired with the keys of the same call (every processor
    projects queries before keys)."""
    pairs, handles = [], []
    for block in blocks(model):
        pending = []
        handles.append(block.attn1.to_q.register_forward_pre_hook(lambda m, a, p=pending: p.append(a[0].shape[1])))
        handles.append(block.attn1.to_k.register_forward_pre_hook(
            lambda m, a, p=pending: pairs.append((p.pop(), a[0].shape[1]))))
    try:
        yield pairs
    finally:
        for handle in handles:
            handle.remove()


def assert_keys_quartered_only_at(base_pairs, pairs, queries):
    """Against the same model's unpatched call: queries never change; keys of a self-attention whose
    query count is in `queries` drop to a quarter (factor 2 on even grids); every other key stays."""
    assert len(pairs) == len(base_pairs) > 0
    assert [q for q, _ in pairs] == [q for q, _ in base_pairs]
    hits = 0
    for (q, k_base), (_, k) in zip(base_pairs, pairs):
        if q in queries and k_base == q:
            assert k == q // 4, (q, k)
            hits += 1
        else:
            assert k == k_base, (q, k_base, k)
    assert hits > 0


def merged_queries(pairs, tokens, ratio=0.5):
    """How many self-attentions over a `tokens` grid saw it merged (queries and keys both)."""
    merged = tokens - int(tokens * ratio)
    assert not any(q == tokens for q, _ in pairs), "a block at that level did not merge"
    return sum(1 for q, k in pairs if q == k == merged)


@pytest.fixture(scope="module")
def sd1_unet():
    return T.unet()


@pytest.mark.parametrize("method", ["nearest", "avg"])
@pytest.mark.parametrize("factor", [2, 3])
@pytest.mark.parametrize("h,w", [(16, 16), (15, 17)])
def test_downsample_equals_attention_over_keys_downsampled_by_hand(sd1_unet, method, factor, h, w):
    inputs = T.unet_inputs(2, h, w)
    base = forward(sd1_unet, inputs)
    handles = hand_patch(sd1_unet, h, w, factor, method)
    try:
        expected = forward(sd1_unet, inputs)
    finally:
        for handle in handles:
            handle.remove()
    tomesd.apply_patch(sd1_unet, mode="downsample", downsample_factor=factor, downsample_method=method)
    try:
        ours = forward(sd1_unet, inputs)
    finally:
        tomesd.remove_patch(sd1_unet)
    effect = (expected - base).abs().max().item()
    assert effect > 1000 * TOL, effect
    assert (ours - expected).abs().max().item() < TOL
    assert torch.equal(forward(sd1_unet, inputs), base)  # removed: bit-identical again


def test_downsample_keeps_queries_full_and_shrinks_keys_at_the_default_levels():
    for config, level in ((T.SD1_UNET, 1), (T.SDXL_UNET, 2)):
        unet = T.unet(config)
        with self_attention_pairs(unet) as base:
            forward(unet, T.unet_inputs(2, 16, 16))
        tomesd.apply_patch(unet, mode="downsample")
        with self_attention_pairs(unet) as pairs:
            forward(unet, T.unet_inputs(2, 16, 16))
        tomesd.remove_patch(unet)
        # the level of the default rule gets a quarter of the keys; every other level is untouched
        assert_keys_quartered_only_at(base, pairs, {(16 // level) ** 2})


def test_downsample_on_ldm_and_controlnet_models(tmp_path):
    # SD2's level-1 blocks here take keys from the text (disable_self_attn): nothing to downsample
    # there, so level 2 is reached with max_downsample=2.
    # Level 1 is 16x16 = 256 tokens, level 2 (and LDM's middle block) 8x8 = 64.
    for sd2, max_downsample, quartered in ((False, None, {256}), (True, 1, set()), (True, 2, {64})):
        model = T.ldm_model(sd2=sd2)
        x, t, c = T.unet_inputs()
        run = lambda: model.model.diffusion_model(x, t.expand(2), c)
        with torch.no_grad(), self_attention_pairs(model.model.diffusion_model) as base_pairs:
            base = run()
        tomesd.apply_patch(model, mode="downsample", downsample_method="avg", max_downsample=max_downsample)
        with torch.no_grad(), self_attention_pairs(model.model.diffusion_model) as pairs:
            down = run()
        tomesd.remove_patch(model)
        with torch.no_grad():
            again = run()
        effect = (down - base).abs().max().item()
        if quartered:
            assert effect > 1000 * TOL
            assert_keys_quartered_only_at(base_pairs, pairs, quartered)
        else:  # SD2's level-1 self-attention takes its keys from the text: nothing changes at all
            assert effect == 0 and pairs == base_pairs
        assert torch.equal(again, base)
    from diffusers import ControlNetModel

    controlnet = T.randomize_(ControlNetModel.from_unet(T.unet(), conditioning_embedding_out_channels=(8, 16)), 3)
    x, t, c = T.unet_inputs()
    cond = torch.randn(2, 3, 32, 32)
    with torch.no_grad(), self_attention_pairs(controlnet) as base_pairs:
        base = controlnet(x, t, c, cond, return_dict=False)[1]
    tomesd.apply_patch(controlnet, mode="downsample")
    with torch.no_grad(), self_attention_pairs(controlnet) as pairs:  # the patched call alone
        down = controlnet(x, t, c, cond, return_dict=False)[1]
    tomesd.remove_patch(controlnet)
    assert_keys_quartered_only_at(base_pairs, pairs, {16 * 16})
    assert (down - base).abs().max().item() > 1000 * TOL


# (arguments, the name the error must give). Under mode="downsample", every argument the README
# lists as refused; then bad values of the modes' own arguments.
REFUSED = [
    (dict(mode="downsample", ratio=0.5), "ratio"),
    (dict(mode="downsample", sx=2), "sx"),
    (dict(mode="downsample", sy=2), "sy"),
    (dict(mode="downsample", use_rand=False), "use_rand"),
    (dict(mode="downsample", merge_attn=True), "merge_attn"),
    (dict(mode="downsample", merge_crossattn=True), "merge_crossattn"),
    (dict(mode="downsample", merge_mlp=False), "merge_mlp"),
    (dict(mode="downsample", seed=1), "seed"),
    (dict(mode="downsample", reuse_steps=2), "reuse_steps"),
    (dict(mode="downsample", share_across_blocks=True), "share_across_blocks"),
    (dict(mode="downsample", downsample_factor=0), "downsample_factor"),
    (dict(mode="downsample", downsample_factor=1.5), "downsample_factor"),
    (dict(mode="downsample", downsample_method="bicubic"), "downsample_method"),
    (dict(mode="merge", downsample_factor=2), "downsample_factor"),
    (dict(downsample_method="avg"), "downsample_method"),
    (dict(mode="todo"), "mode"),
    (dict(reuse_steps=0), "reuse_steps"),
    (dict(reuse_steps=2.0), "reuse_steps"),
    (dict(share_across_blocks="yes"), "share_across_blocks"),
    (dict(merge_attn=False, reuse_steps=2), "reuse_steps"),
]


@pytest.mark.parametrize("kwargs,name", REFUSED, ids=[name + "-" + str(i) for i, (_, name) in enumerate(REFUSED)])
def test_arguments_a_mode_cannot_use_are_refused_and_leave_the_model_alone(sd1_unet, kwargs, name):
    inputs = T.unet_inputs()
    base = forward(sd1_unet, inputs)
    with pytest.raises(ValueError, match=rf"^{name}\b"):  # opens with the name of what was wrong
        tomesd.apply_patch(sd1_unet, **kwargs)
    assert not hasattr(sd1_unet, PATCH_ATTR)
    assert torch.equal(forward(sd1_unet, inputs), base)


def computed_merges(seen):
    """Every matching computed while `seen` (a tomesd.observe record) observed, in call and block order."""
    return [block.merge for call in seen.calls for _, block in sorted(call.blocks.items()) if block.computed]


@contextlib.contextmanager
def merges_placed_by_hand(model, merge_of):
    """Exact ToMe's self-attention merge, placed by hand on the host's modules with no ToMe patch: block i's
    attn1 merges its input with `merge_of(i, tokens)` (None: not at all) and unmerges its output. It shares
    TokenMerge's merge/unmerge with the code under test (checked independently in
    tests/core/test_matching_by_loop.py and against tomesd 0.1.3), so it checks which matching each block
    uses, not that arithmetic."""
    handles = []
    for index, block in enumerate(blocks(model)):
        state = {}

        def pre(module, args, index=index, state=state):
            state["merge"] = merge = merge_of(index, args[0].shape[1])
            return None if merge is None else (merge.merge(args[0]),) + args[1:]

        def post(module, args, out, state=state):
            return None if state["merge"] is None else state["merge"].unmerge(out)

        handles += [block.attn1.register_forward_pre_hook(pre), block.attn1.register_forward_hook(post)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def step_inputs(t, seed, batch=2, h=16, w=16):
    x, _, c = T.unet_inputs(batch, h, w, seed=seed)
    return x, torch.tensor(t), c


MERGING_BLOCKS = 3  # tiny SD1 at the default level: 1 down + 2 up blocks over the 16x16 grid


def test_reuse_steps_recomputes_on_a_new_timestep_not_on_a_second_call(sd1_unet):
    tomesd.apply_patch(sd1_unet, ratio=0.5, reuse_steps=3)
    try:
        counts, merged = [], []
        # Two calls per step (classifier-free guidance as two calls), steps at timesteps 900..400.
        for step, t in enumerate([900, 800, 700, 600, 500, 400]):
            for half in range(2):
                with self_attention_pairs(sd1_unet) as pairs, tomesd.observe(sd1_unet) as seen:
                    forward(sd1_unet, step_inputs(t, seed=10 * step + half))
                counts.append(seen.calls[0].computed)
                merged.append(merged_queries(pairs, 16 * 16))
        # Matched at steps 0 and 3 (first call only); every other call reuses ...
        assert counts == [MERGING_BLOCKS, 0, 0, 0, 0, 0, MERGING_BLOCKS, 0, 0, 0, 0, 0]
        # ... and still merges: every block of the level attends over the merged tokens at every call.
        assert merged == [MERGING_BLOCKS] * 12
        # A new denoising run (the timestep rises again) matches anew, at once.
        with tomesd.observe(sd1_unet) as seen:
            forward(sd1_unet, step_inputs(900, seed=3))
        assert seen.calls[0].computed == MERGING_BLOCKS
        # A different batch or grid matches anew, at once, even with the same token count (16x24 vs 24x16).
        with tomesd.observe(sd1_unet) as seen:
            forward(sd1_unet, step_inputs(800, seed=1, batch=4))
            forward(sd1_unet, step_inputs(700, seed=1, h=16, w=24))
            forward(sd1_unet, step_inputs(600, seed=1, h=24, w=16))
        assert [call.computed for call in seen.calls] == [MERGING_BLOCKS] * 3
        # With gradients on (training), every call matches: each is a new batch of images.
        x, t, c = step_inputs(500, seed=2)
        with tomesd.observe(sd1_unet) as seen:
            sd1_unet(x, t, c)
            sd1_unet(x, torch.tensor(400), c)
        assert [call.computed for call in seen.calls] == [MERGING_BLOCKS] * 2
    finally:
        tomesd.remove_patch(sd1_unet)


def test_a_reusing_step_is_exact_tome_with_the_anchor_steps_matching_replayed(sd1_unet):
    """reuse_steps=3 over 4 steps: steps 1 and 2 run exact ToMe's computation on step 0's matching
    (its random dst pattern included), as merges placed by hand with that matching do; step 3 matches afresh."""
    steps = [step_inputs(t, seed=s) for s, t in enumerate([900, 700, 500, 300])]
    base = [forward(sd1_unet, inputs) for inputs in steps]
    tomesd.apply_patch(sd1_unet, ratio=0.5)
    exact = [forward(sd1_unet, inputs) for inputs in steps]
    tomesd.apply_patch(sd1_unet, ratio=0.5, reuse_steps=3)
    with tomesd.observe(sd1_unet) as seen:
        reused = [forward(sd1_unet, inputs) for inputs in steps]
    tomesd.remove_patch(sd1_unet)
    assert [call.computed for call in seen.calls] == [MERGING_BLOCKS, 0, 0, MERGING_BLOCKS]
    anchor = {index: block.merge for index, block in seen.calls[0].blocks.items() if block.computed}
    replays = []
    for i in (1, 2):
        with merges_placed_by_hand(sd1_unet, lambda index, n: anchor.get(index)):
            replays.append(forward(sd1_unet, steps[i]))
    for i in range(4):
        assert (exact[i] - base[i]).abs().max().item() > 1000 * TOL  # merging matters at every step
    assert torch.equal(reused[0], exact[0]) and torch.equal(reused[3], exact[3])  # matched afresh
    for i, replay in ((1, replays[0]), (2, replays[1])):
        assert (reused[i] - exact[i]).abs().max().item() > 100 * TOL  # not this step's own matching ...
        assert torch.equal(reused[i], replay)  # ... but step 0's, merged and unmerged as exact ToMe does


def fresh_tome(model, inputs, **kwargs):
    """Exact ToMe on one call, from a patch applied just for it: nothing can be reused."""
    tomesd.apply_patch(model, ratio=0.5, **kwargs)
    try:
        return forward(model, inputs)
    finally:
        tomesd.remove_patch(model)


def test_reuse_steps_one_is_exact_tome_at_every_step(sd1_unet):
    steps = [step_inputs(t, seed=s) for s, t in enumerate([900, 900, 700, 500, 300])]
    base = [forward(sd1_unet, inputs) for inputs in steps]
    exact = [fresh_tome(sd1_unet, inputs) for inputs in steps]
    tomesd.apply_patch(sd1_unet, ratio=0.5, reuse_steps=1)
    try:
        ours = [forward(sd1_unet, inputs) for inputs in steps]
    finally:
        tomesd.remove_patch(sd1_unet)
    for b, e, o in zip(base, exact, ours):
        assert (e - b).abs().max().item() > 1000 * TOL
        assert torch.equal(o, e)


def test_share_across_blocks_later_blocks_merge_with_their_levels_first_matching(sd1_unet):
    inputs = T.unet_inputs()
    tomesd.apply_patch(sd1_unet, ratio=0.5, max_downsample=2)
    exact = forward(sd1_unet, inputs)
    tomesd.apply_patch(sd1_unet, ratio=0.5, max_downsample=2, share_across_blocks=True)
    try:
        with self_attention_pairs(sd1_unet) as pairs, tomesd.observe(sd1_unet) as seen:
            shared = forward(sd1_unet, inputs)
            forward(sd1_unet, T.unet_inputs(seed=7))
    finally:
        tomesd.remove_patch(sd1_unet)
    # levels 1 and 2: one matching each, and again at the next call: nothing kept across calls
    assert [(call.computed, call.reused) for call in seen.calls] == [(2, 4), (2, 4)]
    # Every block of both levels still merges (3 blocks over 16x16, 3 over 8x8) ...
    assert merged_queries(pairs, 16 * 16) == 6 and merged_queries(pairs, 8 * 8) == 6
    # ... with its level's first matching: exact ToMe given that matching in every block gives the same.
    first = {merge.num_tokens: merge for merge in computed_merges(seen)[:2]}
    with merges_placed_by_hand(sd1_unet, lambda index, n: first.get(n)):
        replay = forward(sd1_unet, inputs)
    assert (shared - exact).abs().max().item() > 100 * TOL  # later blocks did not match on their own
    assert torch.equal(shared, replay)


def test_kept_matches_live_across_calls_and_are_dropped_by_remove_patch(sd1_unet):
    tomesd.apply_patch(sd1_unet, ratio=0.5, reuse_steps=3)
    try:
        with tomesd.observe(sd1_unet) as seen:
            forward(sd1_unet, step_inputs(900, seed=1))
            forward(sd1_unet, step_inputs(700, seed=2))
    finally:
        kept = [weakref.ref(merge) for merge in computed_merges(seen)]
        seen.clear()  # the record's own references
        gc.collect()
        alive_between_calls = sum(ref() is not None for ref in kept)
        tomesd.remove_patch(sd1_unet)
    gc.collect()
    assert alive_between_calls == MERGING_BLOCKS  # kept for the next steps ...
    assert all(ref() is None for ref in kept)  # ... and gone with the patch, the model still alive


def loop(model, seed, sync=lambda: None):
    outs = []
    for t in (900, 900, 700, 700, 500, 300, 100):
        sync()
        outs.append(forward(model, step_inputs(t, seed=seed + t)))
    return outs


@pytest.mark.parametrize("kwargs", [dict(ratio=0.5, reuse_steps=2), dict(mode="downsample", downsample_method="avg")])
def test_concurrent_denoising_loops_equal_serial_ones(sd1_unet, kwargs):
    tomesd.apply_patch(sd1_unet, **kwargs)
    try:
        expected = [loop(sd1_unet, seed) for seed in (1, 2)]
        overlap = Overlap(sd1_unet)
        results = run_in_threads(lambda i, sync: loop(sd1_unet, 1 + i % 2, sync))
        overlap.remove()
        assert overlap.most > 1  # the loops' calls really ran at the same time
        for i, outs in results.items():
            for out, exp in zip(outs, expected[i % 2]):
                assert torch.equal(out, exp)
    finally:
        tomesd.remove_patch(sd1_unet)


@pytest.mark.parametrize("kwargs", [dict(ratio=0.5, reuse_steps=3), dict(mode="downsample")])
def test_deepcopy_of_a_patched_model_runs_alike_and_apart(kwargs):
    unet = T.unet()
    tomesd.apply_patch(unet, **kwargs)
    first = loop(unet, 3)
    twin = copy.deepcopy(unet)
    assert [torch.equal(a, b) for a, b in zip(loop(twin, 3), first)] == [True] * len(first)
    tomesd.remove_patch(twin)
    assert not hasattr(twin, PATCH_ATTR)
    assert hasattr(unet, PATCH_ATTR)


def test_a_copy_made_mid_loop_keeps_no_matches_and_leaves_the_original_alone():
    steps = [step_inputs(t, seed=s) for s, t in enumerate([900, 700, 500])]
    unet, twin_of_fresh = T.unet(), T.unet()  # same seed: the same weights
    for model in (unet, twin_of_fresh):
        tomesd.apply_patch(model, ratio=0.5, reuse_steps=3)
    expected = [forward(twin_of_fresh, inputs) for inputs in steps]  # an uncopied run of the same loop
    tomesd.apply_patch(twin_of_fresh, ratio=0.5)
    exact_at_step_2 = forward(twin_of_fresh, steps[2])
    forward(unet, steps[0])
    forward(unet, steps[1])  # mid-loop: the original holds step 0's matches
    twin = copy.deepcopy(unet)
    with tomesd.observe(twin) as seen:
        twin_out = forward(twin, steps[2])  # the next lower timestep: would reuse, had matches been copied
    assert seen.calls[0].computed == MERGING_BLOCKS  # matched afresh
    assert torch.equal(twin_out, exact_at_step_2)
    tomesd.remove_patch(twin)
    with tomesd.observe(unet) as seen:
        out = forward(unet, steps[2])  # the original goes on reusing its own step 0 matches
    assert (seen.calls[0].computed, seen.calls[0].reused) == (0, MERGING_BLOCKS)
    assert (expected[2] - exact_at_step_2).abs().max().item() > 100 * TOL
    assert torch.equal(out, expected[2])


def test_reuse_steps_refuses_a_compiled_graph_clearly(sd1_unet):
    compiled = torch.compile(sd1_unet, backend="eager")
    with pytest.raises(ValueError, match="reuse_steps"):  # at apply time when already compiled
        tomesd.apply_patch(compiled, ratio=0.5, reuse_steps=2)
    assert not hasattr(sd1_unet, PATCH_ATTR)
    tomesd.apply_patch(sd1_unet, ratio=0.5, reuse_steps=2)
    try:
        compiled = torch.compile(sd1_unet, backend="eager", fullgraph=True)
        with pytest.raises(Exception, match="reuse_steps"):
            forward(compiled, T.unet_inputs())
    finally:
        tomesd.remove_patch(sd1_unet)
        torch.compiler.reset()


def test_downsample_refuses_a_fused_processor_it_does_not_know_clearly():
    from diffusers.models.attention_processor import FusedAttnProcessor2_0

    class FusedOwnAttnProcessor(FusedAttnProcessor2_0):  # a fused processor ToMe cannot see the SDPA call of
        pass

    unet = T.unet()
    unet.fuse_qkv_projections()
    unet.set_attn_processor(FusedOwnAttnProcessor())
    with pytest.raises(ValueError, match="unfuse_qkv_projections"):  # at apply time
        tomesd.apply_patch(unet, mode="downsample")
    assert not hasattr(unet, PATCH_ATTR)
    unet.unfuse_qkv_projections()
    tomesd.apply_patch(unet, mode="downsample")
    unet.fuse_qkv_projections()
    unet.set_attn_processor(FusedOwnAttnProcessor())  # fused after apply: refused by name, not deep inside
    with pytest.raises(ValueError, match="unfuse_qkv_projections"):
        forward(unet, T.unet_inputs())
    unet.unfuse_qkv_projections()
    assert forward(unet, T.unet_inputs()).shape == (2, 4, 16, 16)
    tomesd.remove_patch(unet)


def test_downsample_refuses_a_self_attention_without_a_context_argument():
    unet = T.unet()
    attn = blocks(unet)[0].attn1

    class NoContext(type(attn)):  # an attention class whose forward declares no context argument
        def forward(self, hidden_states, **kwargs):
            return super().forward(hidden_states, **kwargs)

    attn.__class__ = NoContext
    with pytest.raises(ValueError, match="context argument"):
        tomesd.apply_patch(unet, mode="downsample")
    assert not hasattr(unet, PATCH_ATTR)


@pytest.mark.parametrize("name", ["sdxl", "controlnet"])
def test_reuse_steps_on_sdxl_layout_and_controlnet(name):
    """SDXL's default level (2) and a ControlNet (a root of its own) reuse alike, and remove_patch
    restores the exact outputs."""
    from diffusers import ControlNetModel

    if name == "sdxl":
        model = T.unet(T.SDXL_UNET)
        run = lambda inputs: forward(model, inputs)  # noqa: E731
    else:
        model = T.randomize_(ControlNetModel.from_unet(T.unet(), conditioning_embedding_out_channels=(8, 16)), 3)
        cond = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(4))

        def run(inputs):
            x, t, c = inputs
            with torch.no_grad():
                return model(x, t, c, cond, return_dict=False)[1]

    steps = [step_inputs(t, seed=s) for s, t in enumerate([900, 900, 700, 500])]  # two calls at 900
    base = [run(inputs) for inputs in steps]
    tomesd.apply_patch(model, ratio=0.5, reuse_steps=2)
    with tomesd.observe(model) as seen:
        for inputs in steps:
            out = run(inputs)
    tomesd.remove_patch(model)
    counts = [call.computed for call in seen.calls]
    assert counts[0] > 0 and counts == [counts[0], 0, 0, counts[0]]  # matched at steps 1 and 3 only
    merging = seen.calls[0].merged_blocks("attn")
    assert all(call.merged_blocks("attn") == merging for call in seen.calls)  # reusing calls merge too
    assert (out - base[-1]).abs().max().item() > 1000 * TOL
    assert all(torch.equal(run(inputs), b) for inputs, b in zip(steps, base))
