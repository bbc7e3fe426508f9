"""Wan, a video transformer: every frame's image tokens in one sequence, merged on a space-time grid
(frames x rows x columns, a dst stride per axis); their rotary rows follow them; text never merges; what every family keeps (batch order under one
matching per batch, copies, threads, the random pattern, host reads) is in test_family_contract.py."""
import pytest
import torch

import tiny_torch as T
import tomesd
from probes import (
    OpCounter, assert_checkpointing_keeps_loss_and_gradients, assert_loop_compiles_once_and_equals_eager,
    assert_patch_equals_hooks_by_hand,
)
from tome_core import compute_coordinate_merges, compute_shared_merge, coordinate_partition, get_backend, rng
from tomesd.runtime.tome_patch import PATCH_ATTR

TOL = 1e-5


@pytest.fixture(scope="module")
def model():
    return T.wan()


def probe(model, inputs):
    """Tokens entering each block's self-attention queries, cross-attention queries and keys (the text),
    and feed-forward (at its first layer: ToMe merges inside the feed-forward's own forward chain)."""
    seen = {"self_q": [], "cross_q": [], "cross_k": [], "ffn": []}
    handles = []
    for block in model.blocks:
        for name, module in (("self_q", block.attn1.to_q), ("cross_q", block.attn2.to_q),
                             ("cross_k", block.attn2.to_k), ("ffn", block.ffn.net[0])):
            handles.append(module.register_forward_pre_hook(lambda m, a, name=name: seen[name].append(a[0].shape[1])))
    out = T.run_wan(model, inputs)
    for handle in handles:
        handle.remove()
    return out, seen


def grid_coords(f, h, w):
    token = torch.arange(f * h * w)
    return token // (h * w), (token // w) % h, token % w


@pytest.mark.parametrize("frames,h,w", [(3, 8, 8), (2, 6, 10), (5, 10, 6), (1, 8, 8)])
def test_image_tokens_merge_on_the_space_time_grid_and_text_never(model, frames, h, w):
    inputs = T.wan_inputs(frames=frames, h=h, w=w)
    n = frames * (h // 2) * (w // 2)
    base, plain = probe(model, inputs)
    tomesd.apply_patch(model, ratio=0.5, merge_crossattn=True, merge_mlp=True)
    try:
        out, seen = probe(model, inputs)
    finally:
        tomesd.remove_patch(model)
    merged = n - n // 2
    assert plain["self_q"] == plain["cross_q"] == plain["ffn"] == [n, n]
    assert seen["self_q"] == seen["cross_q"] == seen["ffn"] == [merged, merged]
    assert seen["cross_k"] == plain["cross_k"] == [6, 6]  # the text stays whole
    assert (out - base).abs().max().item() > 1000 * TOL
    assert torch.equal(T.run_wan(model, inputs), base)


def test_defaults_merge_self_attention_only(model):
    inputs = T.wan_inputs()
    tomesd.apply_patch(model, ratio=0.5)
    try:
        _, seen = probe(model, inputs)
    finally:
        tomesd.remove_patch(model)
    assert seen["self_q"] == [24, 24] and seen["cross_q"] == seen["ffn"] == [48, 48]


@pytest.mark.parametrize("st", [1, 2])
def test_merged_tokens_take_their_representatives_rotary_rows_as_placed_by_hand(model, st):
    """Hooks placed by hand on the host's own modules: each sample merged on its own on the (frame, row, col)
    coordinates (top-left dst of each st x 2 x 2 cell), the self-attention's rotary rows [1, S, 1, D] becoming
    [B, M, 1, D], each sample's merged token given its representative's row, its output unmerged. The reference
    shares tome_core's matching (compute_coordinate_merges) with the code under test, so it checks where the
    hooks sit; the
    matching's arithmetic is checked independently in tests/core/test_matching_by_loop.py (and against
    tomesd 0.1.3 in test_core_vs_tomesd.py)."""
    inputs = T.wan_inputs(frames=4, h=8, w=12)
    n = 4 * 4 * 6
    coords = grid_coords(4, 4, 6)
    base = T.run_wan(model, inputs)
    state, handles = {}, []

    def enter(m, args):
        x = args[0]
        state["m"] = compute_coordinate_merges(get_backend(x), x, coords, (st, 2, 2), [n // 2])[n // 2]

    def merge_attn(m, args):
        reps = state["m"].representatives  # [B, M]
        assert not torch.equal(reps[0], reps[1])  # the samples merge apart
        rows = tuple(torch.stack([t[0, sample] for sample in reps]) for t in args[3])
        return (state["m"].merge(args[0]),) + args[1:3] + (rows,) + args[4:]

    for block in model.blocks:
        handles += [block.register_forward_pre_hook(enter), block.attn1.register_forward_pre_hook(merge_attn),
                    block.attn1.register_forward_hook(lambda m, a, out: state["m"].unmerge(out))]
    assert_patch_equals_hooks_by_hand(model, lambda: T.run_wan(model, inputs), base, handles, TOL, ratio=0.5,
                                      use_rand=False, st=st)


@pytest.mark.parametrize("strides", [(1, 2, 2), (2, 2, 2), (3, 1, 2)])
@pytest.mark.parametrize("random", [False, True])
def test_space_time_partition_puts_one_dst_in_each_cell(strides, random):
    """The core's rank-agnostic partition on a 6 x 4 x 6 grid: each st x sy x sx cell holds exactly one dst,
    at the cell's place drawn for it (row-major within the cell)."""
    xp = get_backend(torch.zeros(1))
    f, h, w = 6, 4, 6
    st, sy, sx = strides
    cells = (f // st) * (h // sy) * (w // sx)
    offsets = rng.randint(xp, torch.zeros(1), [cells], st * sy * sx, rng.call_key(xp, 3, None)) if random else None
    order, position, num_dst = coordinate_partition(xp, grid_coords(f, h, w), strides, offsets)
    assert num_dst == cells and torch.equal(order[position], torch.arange(f * h * w))
    by_hand = set()
    for cell in range(cells):
        cf, rest = divmod(cell, (h // sy) * (w // sx))
        cy, cx = divmod(rest, w // sx)
        place = 0 if offsets is None else int(offsets[cell])
        pf, rest = divmod(place, sy * sx)
        py, px = divmod(rest, sx)
        by_hand.add(((cf * st + pf) * h + cy * sy + py) * w + cx * sx + px)
    assert set(order[-num_dst:].tolist()) == by_hand


def test_time_stride_two_merges_tokens_across_neighbouring_frames(model):
    """st=1 puts a dst in every frame; st=2 (top-left dst) only in frames 0 and 2, so the tokens of frames
    1 and 3 that merge go into a neighbour's dst: merged rows hold tokens of two frames. The patched
    output differs from st=1's."""
    x = torch.randn(2, 4 * 16, 8, generator=torch.Generator().manual_seed(0))
    frames = grid_coords(4, 4, 4)[0]
    xp = get_backend(x)
    dst_frames = {}
    for st in (1, 2):
        m = compute_shared_merge(xp, x, grid_coords(4, 4, 4), (st, 2, 2), 32)
        num_dst = 64 // (st * 4)  # one per cell; the merged rows end with them
        dst_frames[st] = set(frames[m.representatives[-num_dst:]].tolist())
        spans = [set(frames[m._rows == row].tolist()) for row in range(m.num_merged)]
    assert dst_frames == {1: {0, 1, 2, 3}, 2: {0, 2}}
    assert any(len(span) == 2 for span in spans)
    inputs = T.wan_inputs(frames=4)
    outs = {}
    for st in (1, 2):
        tomesd.apply_patch(model, ratio=0.5, st=st)
        try:
            outs[st] = T.run_wan(model, inputs)
        finally:
            tomesd.remove_patch(model)
    assert (outs[1] - outs[2]).abs().max().item() > 1000 * TOL


def test_random_dst_places_span_the_frames_of_a_space_time_cell(model):
    """With use_rand (the default) each st x 2 x 2 cell draws its dst among all of its st * 4 places, so at
    st=2 dsts land in every frame, not only in each cell's first (which would leave odd frames holding no dst
    and score them systematically worse than even ones). Asserted per block: each block draws its own."""
    inputs = T.wan_inputs(frames=4, h=8, w=8)
    frames = grid_coords(4, 4, 4)[0]
    dst_frames = {}
    for st in (1, 2):
        tomesd.apply_patch(model, ratio=0.5, st=st)
        try:
            with tomesd.observe(model) as seen:
                T.run_wan(model, inputs)
        finally:
            tomesd.remove_patch(model)
        num_dst = 64 // (st * 4)  # one per cell; the merged rows end with them
        merges = [seen.calls[0].blocks[i].merge for i in range(len(model.blocks))]
        dst_frames[st] = [sorted(set(frames[m.representatives[0, -num_dst:]].tolist())) for m in merges]  # sample 0's
    # Control: at st=1 a cell lies in one frame, so every frame holds dsts in every block by construction.
    assert dst_frames[1] == [[0, 1, 2, 3]] * len(model.blocks), dst_frames
    # At st=2 each block's 8 dsts each fall in a cell's second frame with probability 1/2: a block with none
    # in an odd frame is a 2**-8 draw (the seed is fixed), and it was every block's draw before the fix.
    assert all(any(f % 2 for f in block) for block in dst_frames[2]), dst_frames


def test_blocks_by_index(model):
    tomesd.apply_patch(model, ratio=0.5, blocks=[1])
    try:
        _, seen = probe(model, T.wan_inputs())
    finally:
        tomesd.remove_patch(model)
    assert seen["self_q"] == [48, 24]


@pytest.mark.parametrize("kwargs,message", [(dict(max_downsample=1), "^max_downsample"), (dict(blocks=[2]), "^blocks"),
                                            (dict(st=0), "^st must be"), (dict(st=1.5), "^st must be")])
def test_wan_refuses_what_it_cannot_run_before_any_change(model, kwargs, message):
    with pytest.raises(ValueError, match=message):
        tomesd.apply_patch(model, **kwargs)
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())


def test_a_time_stride_is_refused_on_models_whose_blocks_see_one_frame():
    for model in (T.unet(), T.video_unet("unet3d"), T.flux()):
        with pytest.raises(ValueError, match="st .*no meaning on"):
            tomesd.apply_patch(model, ratio=0.5, st=2)
        assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())


def test_denoising_loop_is_one_graph_without_recompiles_and_equals_eager():
    steps = [T.wan_inputs(t=t, seed=i) for i, t in enumerate((900.0, 500.0, 100.0))]
    assert_loop_compiles_once_and_equals_eager(T.wan(), T.run_wan, steps, ratio=0.5, st=2)


def test_forward_on_the_meta_device_reads_no_tensor_value():
    from diffusers import WanTransformer3DModel

    with torch.device("meta"):
        model = WanTransformer3DModel(**T.WAN).eval()
    inputs = {k: v.to("meta") for k, v in T.wan_inputs(frames=2, h=6, w=10).items()}
    tomesd.apply_patch(model, ratio=0.5, st=2)
    out, seen = probe(model, inputs)
    assert out.device.type == "meta" and seen["self_q"] == [15, 15]


def test_gradient_checkpointing_gives_the_same_loss_and_gradients():
    assert_checkpointing_keeps_loss_and_gradients(T.wan, T.wan_inputs, dict(ratio=0.5, st=2))


def test_apply_twice_equals_once(model):
    inputs = T.wan_inputs()
    tomesd.apply_patch(model, ratio=0.5, st=2)
    once = T.run_wan(model, inputs)
    tomesd.apply_patch(model, ratio=0.5, st=2)
    try:
        assert torch.equal(T.run_wan(model, inputs), once)
    finally:
        tomesd.remove_patch(model)


def test_reuse_across_steps_and_a_new_grid_of_the_same_token_count(model):
    """reuse_steps=2 matches once per two timesteps and every call merges, reusing ones included; a grid of
    the same token count (2 x 4 x 6 against 3 x 4 x 4) matches anew, as a fresh patch would."""
    steps = [T.wan_inputs(t=t, seed=i) for i, t in enumerate([900.0, 900.0, 700.0, 500.0])]
    other = T.wan_inputs(frames=2, h=8, w=12, t=400.0)  # 48 tokens, as the 3 x 4 x 4 grid
    tomesd.apply_patch(model, ratio=0.5, reuse_steps=2)
    try:
        with tomesd.observe(model) as seen:
            for inputs in steps + [other]:
                _, tokens = probe(model, inputs)
                assert tokens["self_q"] == [24, 24]
        ours = T.run_wan(model, other)
    finally:
        tomesd.remove_patch(model)
    assert [(call.computed, call.reused) for call in seen.calls] == [(2, 0), (0, 2), (0, 2), (2, 0), (2, 0)]
    assert all(call.blocks[i].tokens("attn") == [(48, 24)] for call in seen.calls for i in (0, 1))
    tomesd.apply_patch(model, ratio=0.5)
    try:
        assert torch.equal(ours, T.run_wan(model, other))
    finally:
        tomesd.remove_patch(model)


@pytest.mark.parametrize("st", [1, 2])
def test_kernels_added_per_forward_do_not_grow_with_frames(model, st):
    """Ops dispatched (each a kernel launch on a GPU) that the patch adds to a forward: the space-time grid
    is one partition of the whole sequence, with no per-frame loop, so 2 and 6 frames cost the same ops."""
    added = {}
    for frames in (2, 6):
        inputs = T.wan_inputs(frames=frames)

        def count():
            with torch.no_grad(), OpCounter() as counter:
                model(**inputs)
            return counter.total

        base = count()
        tomesd.apply_patch(model, ratio=0.5, st=st)
        try:
            added[frames] = count() - base
        finally:
            tomesd.remove_patch(model)
    print(f"st={st}: ops added per forward of {len(model.blocks)} blocks: {added}")
    assert 0 < added[2] == added[6]


def _patched_components(pipe):
    return sorted(n for n, c in pipe.components.items()
                  if isinstance(c, torch.nn.Module) and any(PATCH_ATTR in m.__dict__ for m in c.modules()))


def test_a_wan_22_pipeline_patches_both_experts_and_nothing_else():
    """Wan 2.2's layout: `transformer` for the high-noise steps, `transformer_2` for the low-noise ones;
    both are patched (never the VAE) and every self-attention of both sees merged tokens."""
    pipe = T.wan_pipeline(two_experts=True)
    base = T.run_wan_pipeline(pipe, steps=4)
    seen, handles = [], []
    tomesd.apply_patch(pipe, ratio=0.5)
    for name in ("transformer", "transformer_2"):
        for block in getattr(pipe, name).blocks:
            handles.append(block.attn1.to_q.register_forward_pre_hook(
                lambda m, a, name=name: seen.append((name, a[0].shape[1]))))
    merged = T.run_wan_pipeline(pipe, steps=4)
    for handle in handles:
        handle.remove()
    assert _patched_components(pipe) == ["transformer", "transformer_2"]
    # 5 frames -> 2 latent frames of 4 x 4 tokens: 32, merged to 16; each expert runs 2 steps x 2 guidance calls.
    assert sorted(set(seen)) == [("transformer", 16), ("transformer_2", 16)]
    assert len(seen) == 2 * 2 * 2 * 2
    assert abs(merged - base).max() > 1e-2
    tomesd.remove_patch(pipe)
    assert (T.run_wan_pipeline(pipe, steps=4) == base).all()


def test_reuse_on_a_wan_pipeline_shares_one_matching_per_window_and_equals_the_timestep_rule():
    """Wan's pipeline runs the guidance halves as two calls per step. With reuse_steps=2 the pipeline's loop
    counts the steps: the window's first call matches, the step's second call and the next step reuse it,
    and every call merges; each expert keeps its own matches. The images equal those of the bare-model
    timestep rule."""
    pipe = T.wan_pipeline(two_experts=True)
    tomesd.apply_patch(pipe, ratio=0.5, reuse_steps=2)
    with tomesd.observe(pipe.transformer) as high, tomesd.observe(pipe.transformer_2) as low:
        clocked = T.run_wan_pipeline(pipe, steps=6)
    assert [(call.computed, call.reused) for call in high.calls] == ([(2, 0)] + [(0, 2)] * 3) * 2
    assert [(call.computed, call.reused) for call in low.calls] == [(2, 0)] + [(0, 2)] * 3
    # 5 frames -> 2 latent frames of 4 x 4 tokens: 32 merged to 16 in both blocks of every call.
    assert all(call.blocks[i].tokens("attn") == [(32, 16)] for call in high.calls + low.calls for i in (0, 1))
    tomesd.remove_patch(pipe)
    tomesd.apply_patch(pipe.transformer, ratio=0.5, reuse_steps=2)  # bare models: the timestep rule
    tomesd.apply_patch(pipe.transformer_2, ratio=0.5, reuse_steps=2)
    try:
        assert (T.run_wan_pipeline(pipe, steps=6) == clocked).all()
    finally:
        tomesd.remove_patch(pipe)


def test_wan_vaces_control_tokens_never_merge(unpatch):
    """Wan VACE: the main blocks merge the video's tokens; the VACE blocks' self-attention keeps every control token
    (its own sequence, added back to the video's as hints), and their output is what the unpatched model gives them."""
    import families

    family = families.FAMILIES["wan-vace"]
    model = family.build()
    inputs = family.inputs(model)
    tokens = 3 * 4 * 4  # frames x (h / 2) x (w / 2)
    seen = {"main": [], "vace": []}
    hooks = [block.attn1.to_q.register_forward_hook(lambda m, a, o, key=key: seen[key].append(a[0].shape[1]))
             for key, blocks in (("main", model.blocks), ("vace", model.vace_blocks)) for block in blocks]
    vace_out = []
    hooks += [block.register_forward_hook(lambda m, a, o: vace_out.append(o[1])) for block in model.vace_blocks]
    try:
        family.run(model, inputs)
        base_vace = list(vace_out)
        seen = {"main": [], "vace": []}
        vace_out.clear()
        tomesd.apply_patch(model, ratio=0.5)
        unpatch(model)
        family.run(model, inputs)
    finally:
        for hook in hooks:
            hook.remove()
    assert seen["vace"] == [tokens] * 2 and all(n < tokens for n in seen["main"])
    # The VACE blocks run before the video's blocks, on its unmerged tokens: their hints are the unpatched ones.
    assert len(vace_out) == 2 and all(torch.equal(a, b) for a, b in zip(vace_out, base_vace))


def test_wan_animates_pose_and_face_conditions_never_merge(unpatch):
    """Wan Animate: no condition token joins the blocks' sequence (its pose latents are added to the target's
    tokens before the blocks, its face features are keys of face adapters between blocks), so the blocks merge the
    target's tokens alone, and each face adapter sees every token, unmerged, between merged blocks."""
    import families

    family = families.FAMILIES["wan-animate"]
    model = family.build()
    inputs = family.inputs(model)
    tokens = 3 * 4 * 4  # frames (the reference frame's and the pose frames') x (h / 2) x (w / 2)
    seen = {"blocks": [], "faces": []}
    hooks = [block.attn1.to_q.register_forward_hook(lambda m, a, o: seen["blocks"].append(a[0].shape[1]))
             for block in model.blocks]
    hooks += [face.register_forward_hook(lambda m, a, o: seen["faces"].append((a[0].shape[1], o.shape[1])))
              for face in model.face_adapter]
    try:
        tomesd.apply_patch(model, ratio=0.5)
        unpatch(model)
        family.run(model, inputs)
    finally:
        for hook in hooks:
            hook.remove()
    assert len(seen["blocks"]) == 2 and all(n < tokens for n in seen["blocks"])
    assert seen["faces"] == [(tokens, tokens)] * len(model.face_adapter)


def test_reuse_steps_on_a_bare_model_refuses_a_timestep_per_frame():
    """Cosmos Video2World passes a timestep per latent frame, [B, 1, T, 1, 1], whose first is the clean condition
    frame's (the same at every step): read as the step's value, the step would never advance and the first step's
    matching would serve the whole run. Refused at the first call, naming the pipeline; a timestep per sample runs."""
    import tiny_video_families as V

    model = V.cosmos().eval()
    inputs = V.cosmos_inputs(model)
    per_frame = torch.full((2, 1, 3, 1, 1), 0.5)
    per_frame[:, :, 0] = 0.0  # the condition frame
    tomesd.apply_patch(model, ratio=0.5, reuse_steps=3)
    try:
        with torch.no_grad():
            model(**inputs)  # a timestep per sample: runs
            with pytest.raises(ValueError, match="timestep has shape \\[2, 1, 3, 1, 1\\].*Patch the pipeline"):
                model(**dict(inputs, timestep=per_frame))
    finally:
        tomesd.remove_patch(model)
