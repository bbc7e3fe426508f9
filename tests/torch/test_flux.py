"""Flux under ToMe: image tokens merge in double- and single-stream blocks, their rotary positions follow
them, text tokens never merge (single blocks keep their text rows bit for bit); reuse and grids. What every
family keeps (batch order under one matching per batch, copies, threads, the random pattern, host reads)
is in test_family_contract.py."""
import pytest
import torch

import tiny_torch as T
import tomesd
from probes import (
    around_the_patch, assert_checkpointing_keeps_loss_and_gradients, assert_loop_compiles_once_and_equals_eager,
    assert_patch_equals_hooks_by_hand,
)
from tome_core import compute_coordinate_merges, compute_shared_merge, coordinate_partition, get_backend, grid_partition, rng

TOL = 1e-5


@pytest.fixture(scope="module")
def model():
    return T.flux()


def run(model, inputs):
    with torch.no_grad():
        return model(**inputs).sample


def probe(model, inputs):
    """Tokens entering each block's attention queries (image queries of double blocks, the joined
    sequence of single blocks), text queries of double blocks, and single blocks' MLP."""
    seen = {"double_q": [], "text_q": [], "single_q": [], "single_mlp": []}
    handles = []
    for block in model.transformer_blocks:
        handles.append(block.attn.to_q.register_forward_pre_hook(lambda m, a: seen["double_q"].append(a[0].shape[1])))
        handles.append(block.attn.add_q_proj.register_forward_pre_hook(lambda m, a: seen["text_q"].append(a[0].shape[1])))
    for block in model.single_transformer_blocks:
        handles.append(block.attn.to_q.register_forward_pre_hook(lambda m, a: seen["single_q"].append(a[0].shape[1])))
        handles.append(block.proj_mlp.register_forward_pre_hook(lambda m, a: seen["single_mlp"].append(a[0].shape[1])))
    out = run(model, inputs)
    for handle in handles:
        handle.remove()
    return out, seen


@pytest.mark.parametrize("h,w", [(8, 8), (6, 10), (7, 9), (5, 5)])
def test_image_tokens_merge_in_double_and_single_blocks_and_text_never(model, h, w):
    inputs = T.flux_inputs(h=h, w=w)
    n, text = h * w, 5
    base, plain = probe(model, inputs)
    tomesd.apply_patch(model, ratio=0.5)
    try:
        out, seen = probe(model, inputs)
    finally:
        tomesd.remove_patch(model)
    merged = n - n // 2
    assert plain["double_q"] == [n, n] and plain["single_q"] == [text + n] * 2
    assert seen["double_q"] == [merged] * 2 and seen["text_q"] == plain["text_q"] == [text] * 2
    assert seen["single_q"] == seen["single_mlp"] == [text + merged] * 2  # the MLP runs on the merged sequence too
    assert (out - base).abs().max().item() > 1000 * TOL
    assert torch.equal(run(model, inputs), base)


def test_single_blocks_keep_the_text_rows_of_the_joined_sequence_as_they_are(model):
    """A single block's norm output is [text, image]: after the merge its text rows are those rows bit for
    bit (not merged, averaged or reordered) and only the image part shrinks."""
    inputs = T.flux_inputs(h=6, w=10)
    try:
        befores, afters = around_the_patch([block.norm for block in model.single_transformer_blocks],
                                           lambda: tomesd.apply_patch(model, ratio=0.5), lambda: run(model, inputs),
                                           output=True)
    finally:
        tomesd.remove_patch(model)
    assert len(befores) == len(afters) == 2
    for before, after in zip(befores, afters):
        assert before.shape[1] == 5 + 60 and after.shape[1] == 5 + 30
        assert torch.equal(after[:, :5], before[:, :5])
        assert (after[:, 5:].mean(1) - before[:, 5:].mean(1)).abs().max() > 1e-3  # the image part did merge


def test_merged_tokens_take_their_representatives_rotary_rows_as_placed_by_hand(model):
    """Hooks placed by hand on the host's own modules: the merge (top-left dst), the rotary rows [text, image]
    with each merged image token given its representative's row, the double blocks' attention and
    feed-forward image tokens merged, and single blocks merged from norm's output to proj_out's. A batch of
    one: the rows [S, D] have no batch axis (a larger batch matched per sample is rotated at the attention
    dispatch, test_split_batches.py). The reference shares tome_core's matching (compute_coordinate_merges)
    with the code under test, so it checks where the hooks sit; the matching's arithmetic is checked
    independently in tests/core/test_matching_by_loop.py (and against tomesd 0.1.3 in test_core_vs_tomesd.py)."""
    inputs = T.flux_inputs(batch=1, h=6, w=10)
    n = 60
    base = run(model, inputs)
    rows, cols = inputs["img_ids"][:, 1].long(), inputs["img_ids"][:, 2].long()
    state, handles = {}, []

    def enter(m, args, kwargs):
        x = kwargs["hidden_states"]
        state["m"] = compute_coordinate_merges(get_backend(x), x[:, -n:], (rows, cols), (2, 2), [n // 2])[n // 2]

    def rotary(kwargs):
        m = state["m"]
        return tuple(torch.cat([t[:-n], t[-n:][m.representatives[0]]]) for t in kwargs["image_rotary_emb"])

    for block in model.transformer_blocks:
        handles += [block.register_forward_pre_hook(enter, with_kwargs=True),
                    block.attn.register_forward_pre_hook(lambda m, a, k: (a, {**k, "hidden_states": state["m"].merge(
                        k["hidden_states"]), "image_rotary_emb": rotary(k)}), with_kwargs=True),
                    block.attn.register_forward_hook(lambda m, a, out: (state["m"].unmerge(out[0]),) + out[1:])]
    for block in model.single_transformer_blocks:
        def merge_norm(m, a, out):
            x = out[0]
            return (torch.cat([x[:, :-n], state["m"].merge(x[:, -n:])], 1),) + out[1:]

        def unmerge_out(m, a, out):
            k = state["m"].num_merged
            return torch.cat([out[:, :-k], state["m"].unmerge(out[:, -k:])], 1)

        handles += [block.register_forward_pre_hook(enter, with_kwargs=True),
                    block.norm.register_forward_hook(merge_norm), block.proj_out.register_forward_hook(unmerge_out),
                    block.attn.register_forward_pre_hook(lambda m, a, k: (a, {**k, "image_rotary_emb": rotary(k)}),
                                                         with_kwargs=True)]
    assert_patch_equals_hooks_by_hand(model, lambda: run(model, inputs), base, handles, TOL, ratio=0.5, use_rand=False)


@pytest.mark.parametrize("offsets", [False, True])
@pytest.mark.parametrize("h,w", [(8, 8), (6, 10), (4, 12)])
def test_coordinate_partition_equals_the_grid_partition_on_even_grids(h, w, offsets):
    xp = get_backend(torch.zeros(1))
    ids = T.flux_inputs(h=h, w=w)["img_ids"]
    cells = (h // 2) * (w // 2)
    table = rng.randint(xp, ids, [cells], 4, rng.call_key(xp, 0, None)) if offsets else None
    by_coords = coordinate_partition(xp, (ids[:, 1].long(), ids[:, 2].long()), (2, 2), table)
    by_grid = grid_partition(xp, ids, w, h, 2, 2, table)
    assert by_coords[2] == cells
    assert torch.equal(by_coords[0], by_grid[0]) and torch.equal(by_coords[1], by_grid[1])


def test_representatives_are_the_dst_token_of_each_merged_row_or_the_token_itself():
    xp = get_backend(torch.zeros(1))
    ids = T.flux_inputs(h=6, w=10)["img_ids"]
    metric = torch.randn(3, 60, 8, generator=torch.Generator().manual_seed(0))
    m = compute_shared_merge(xp, metric, (ids[:, 1].long(), ids[:, 2].long()), (2, 2), 30)
    rows_of = m.merge(torch.arange(60.0).reshape(1, 60, 1).expand(3, 60, 1), mode="amax")  # a row's largest id
    counts = m.merge(torch.ones(3, 60, 1), mode="sum")
    dst = set(coordinate_partition(xp, (ids[:, 1].long(), ids[:, 2].long()), (2, 2), None)[0][-15:].tolist())
    assert m.representatives.shape == (30,) and len(set(m.representatives.tolist())) == 30
    token_row = m.unmerge(torch.arange(30.0).reshape(1, 30, 1).expand(3, 30, 1))[0, :, 0].long()
    for row, token in enumerate(m.representatives.tolist()):
        assert token_row[token] == row  # the representative belongs to its row
        assert token in dst or counts[0, row, 0] == 1  # a row that merged several tokens stands for its dst
    assert torch.equal(rows_of[0], rows_of[2])  # one map for the whole batch


def test_blocks_index_double_then_single_blocks(model):
    inputs = T.flux_inputs()
    tomesd.apply_patch(model, ratio=0.5, blocks=[1, 2])  # the second double block, the first single one
    try:
        _, seen = probe(model, inputs)
    finally:
        tomesd.remove_patch(model)
    assert seen["double_q"] == [64, 32] and seen["single_q"] == [5 + 32, 5 + 64]


@pytest.mark.parametrize("kwargs,message", [(dict(max_downsample=1), "^max_downsample"), (dict(blocks=[4]), "^blocks")])
def test_flux_refuses_what_it_cannot_run_before_any_change(model, kwargs, message):
    with pytest.raises(ValueError, match=message):
        tomesd.apply_patch(model, **kwargs)
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())


def test_downsampling_runs_where_diffusers_dispatches_attention_and_is_refused_by_name_where_not(model):
    """diffusers 0.35 and later hand rotated keys to an attention dispatch, where they are downsampled
    (test_downsample_dispatch.py); older processors call attention themselves, so nothing could shrink."""
    from tomesd.backends import torch_dispatch

    inputs = T.flux_inputs()
    if torch_dispatch.available():
        base = run(model, inputs)
        tomesd.apply_patch(model, mode="downsample")
        try:
            assert (run(model, inputs) - base).abs().max().item() > 1e-2
        finally:
            tomesd.remove_patch(model)
    else:
        with pytest.raises(ValueError, match="diffusers older than 0.35.*use mode='merge'"):
            tomesd.apply_patch(model, mode="downsample")
        assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())


def test_ids_of_other_tokens_than_the_latents_are_refused_clearly(model):
    """(Kontext's reference tokens come with ids rows of their own: tests/torch/test_kontext.py.)"""
    inputs = T.flux_inputs()
    inputs["img_ids"] = torch.cat([inputs["img_ids"], inputs["img_ids"][:4]])  # ids of more tokens than the latent
    tomesd.apply_patch(model, ratio=0.5)
    try:
        with pytest.raises(ValueError, match="img_ids has 68 rows for 64 latent tokens"):
            run(model, inputs)
    finally:
        tomesd.remove_patch(model)


def test_denoising_loop_is_one_graph_without_recompiles_and_equals_eager():
    steps = [T.flux_inputs(t=t, seed=i) for i, t in enumerate((1.0, 0.6, 0.2))]
    assert_loop_compiles_once_and_equals_eager(T.flux(), run, steps, ratio=0.5)


def test_forward_on_the_meta_device_reads_no_tensor_value():
    from diffusers import FluxTransformer2DModel

    with torch.device("meta"):
        model = FluxTransformer2DModel(**T.FLUX).eval()
    inputs = {k: v.to("meta") for k, v in T.flux_inputs(h=6, w=10).items()}
    tomesd.apply_patch(model, ratio=0.5)
    try:
        out, seen = probe(model, inputs)
    finally:
        tomesd.remove_patch(model)
    assert out.device.type == "meta" and seen["double_q"] == [30, 30]


def test_gradient_checkpointing_gives_the_same_loss_and_gradients():
    assert_checkpointing_keeps_loss_and_gradients(T.flux, T.flux_inputs, dict(ratio=0.5))


def test_reuse_steps_on_flux_merges_on_every_call_and_matches_once_per_window(model):
    """reuse_steps=2 over timesteps 0.9, 0.9, 0.7, 0.5: the first call of a window matches in every block, the
    later calls reuse those matchings, and every call, reusing ones included, merges the image tokens."""
    steps = [T.flux_inputs(t=t, seed=i) for i, t in enumerate([0.9, 0.9, 0.7, 0.5])]
    for inputs in steps[1:]:  # one ids tensor for the whole loop, as a pipeline builds it once per generation
        inputs["img_ids"] = steps[0]["img_ids"]
    tomesd.apply_patch(model, ratio=0.5, reuse_steps=2)
    try:
        with tomesd.observe(model) as seen:
            for inputs in steps:
                _, tokens = probe(model, inputs)
                assert tokens["double_q"] == [32, 32] and tokens["single_q"] == [5 + 32] * 2
    finally:
        tomesd.remove_patch(model)
    assert [(call.computed, call.reused) for call in seen.calls] == [(4, 0), (0, 4), (0, 4), (4, 0)]
    for call in seen.calls:  # 4 blocks: 64 image tokens merged to 32 in each, text (5) kept
        assert [call.blocks[i].tokens("attn") for i in range(4)] == [[(64, 32)]] * 2 + [[(69, 37)]] * 2


def test_flux_controlnet_merges_its_blocks():
    from diffusers import FluxControlNetModel

    controlnet = T.randomize_(FluxControlNetModel(**{k: v for k, v in T.FLUX.items()}), 2)
    inputs = T.flux_inputs()
    inputs["controlnet_cond"] = torch.randn(2, 64, 16, generator=torch.Generator().manual_seed(3))

    def go():
        with torch.no_grad():
            blocks, singles = controlnet(**inputs, return_dict=False)
        return torch.cat([torch.stack(list(blocks)).flatten(), torch.stack(list(singles)).flatten()])

    base = go()
    tomesd.apply_patch(controlnet, ratio=0.5)
    merged = go()
    tomesd.remove_patch(controlnet)
    assert (merged - base).abs().max().item() > 1000 * TOL
    assert torch.equal(go(), base)


def test_reuse_matches_anew_on_another_grid_of_the_same_token_count(model):
    wide, tall = T.flux_inputs(h=4, w=16, t=0.9), T.flux_inputs(h=16, w=4, t=0.8)  # 64 tokens each
    tomesd.apply_patch(model, ratio=0.5, reuse_steps=3)
    try:
        with tomesd.observe(model) as seen:
            run(model, wide)
            ours = run(model, tall)  # a lower timestep within reuse_steps, but another grid
    finally:
        tomesd.remove_patch(model)
    assert [(call.computed, call.reused) for call in seen.calls] == [(4, 0), (4, 0)]
    tomesd.apply_patch(model, ratio=0.5)
    try:
        assert torch.equal(ours, run(model, tall))  # as a fresh match on that grid
    finally:
        tomesd.remove_patch(model)


@pytest.mark.parametrize("h,w", [(7, 9), (5, 8), (6, 7)])
def test_coordinate_partition_on_odd_grids_keeps_complete_cells_and_fills_n_over_4_dst(h, w):
    xp = get_backend(torch.zeros(1))
    ids = T.flux_inputs(h=h, w=w)["img_ids"]
    rows, cols = ids[:, 1].long(), ids[:, 2].long()
    order, position, num_dst = coordinate_partition(xp, (rows, cols), (2, 2), None)
    dst = set(order[-num_dst:].tolist())
    top_left = {r * w + c for r in range(0, h // 2 * 2, 2) for c in range(0, w // 2 * 2, 2)}
    assert num_dst == h * w // 4 and top_left <= dst  # every complete cell's dst, then fillers
    assert torch.equal(order[position], torch.arange(h * w))
    # ids that start elsewhere than 0 partition alike
    shifted = coordinate_partition(xp, (rows + 3, cols + 5), (2, 2), None)
    assert torch.equal(shifted[0], order)
