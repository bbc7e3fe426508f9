"""CogVideoX, a video transformer with joint [text, image] attention: image tokens of every frame merge on
the space-time grid (CogVideoX 1.5 patches two frames per token), the rotary rows of 1.5 follow them, the
text never merges (also where the feed-forward sees [text, image] joined); what the other models keep holds."""
import pytest
import torch

import tiny_torch as T
import tomesd
from probes import (
    OpCounter, around_the_patch, assert_checkpointing_keeps_loss_and_gradients,
    assert_loop_compiles_once_and_equals_eager, assert_patch_equals_hooks_by_hand,
)
from tome_core import compute_shared_merge, get_backend

TOL = 1e-5
VERSIONS = ("1.0", "1.5")


@pytest.fixture(scope="module")
def models():
    return {version: T.cogvideox(version) for version in VERSIONS}


def probe(model, inputs):
    """Tokens entering each block's attention queries ([text, image] joined in the processor, so counted at
    to_q), the text stream's output length, and the feed-forward's input ([text, image])."""
    seen = {"q": [], "ff": [], "text_out": []}
    handles = []
    for block in model.transformer_blocks:
        handles += [block.attn1.to_q.register_forward_pre_hook(lambda m, a: seen["q"].append(a[0].shape[1])),
                    block.ff.net[0].register_forward_pre_hook(lambda m, a: seen["ff"].append(a[0].shape[1])),
                    block.register_forward_hook(lambda m, a, out: seen["text_out"].append(out[1].shape[1]))]
    out = T.run_cogvideox(model, inputs)
    for handle in handles:
        handle.remove()
    return out, seen


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("frames,h,w", [(4, 8, 8), (2, 6, 10), (4, 10, 6)])
def test_image_tokens_merge_on_the_space_time_grid_and_text_never(models, version, frames, h, w):
    model = models[version]
    inputs = T.cogvideox_inputs(model, frames=frames, h=h, w=w)
    n = (frames // (2 if version == "1.5" else 1)) * (h // 2) * (w // 2)
    base, plain = probe(model, inputs)
    tomesd.apply_patch(model, ratio=0.5, merge_mlp=True)
    try:
        out, seen = probe(model, inputs)
    finally:
        tomesd.remove_patch(model)
    merged = n - n // 2
    assert plain["q"] == plain["ff"] == [6 + n] * 2
    assert seen["q"] == seen["ff"] == [6 + merged] * 2  # the 6 text tokens stay
    assert seen["text_out"] == [6, 6]
    assert (out - base).abs().max().item() > 1000 * TOL
    assert torch.equal(T.run_cogvideox(model, inputs), base)


@pytest.mark.parametrize("version", VERSIONS)
def test_the_feed_forward_keeps_the_text_rows_of_its_joined_input_as_they_are(models, version):
    """The feed-forward sees [text, image] joined: with merge_mlp its text rows are the rows it is given
    before the merge, bit for bit (not merged, averaged or reordered), and only the image part shrinks."""
    model = models[version]
    inputs = T.cogvideox_inputs(model)
    n = (4 // (2 if version == "1.5" else 1)) * 16
    try:
        befores, afters = around_the_patch([block.ff for block in model.transformer_blocks],
                                           lambda: tomesd.apply_patch(model, ratio=0.5, merge_mlp=True),
                                           lambda: T.run_cogvideox(model, inputs))
    finally:
        tomesd.remove_patch(model)
    assert len(befores) == len(afters) == 2
    for before, after in zip(befores, afters):
        assert before.shape[1] == 6 + n and after.shape[1] == 6 + n - n // 2
        assert torch.equal(after[:, :6], before[:, :6])


@pytest.mark.parametrize("st", [1, 2])
def test_cogvideox_15_rotary_rows_follow_their_tokens_as_placed_by_hand(models, st):
    """Hooks placed by hand on the host's own modules: one merge for the batch on (frame, row, col), each
    merged token given its representative's rotary row, attention's image output unmerged. The reference
    shares tome_core's matching (compute_shared_merge) with the code under test, so it checks where the
    hooks sit; the matching's arithmetic is checked independently in tests/core/test_matching_by_loop.py
    (and against tomesd 0.1.3 in test_core_vs_tomesd.py)."""
    model = models["1.5"]
    inputs = T.cogvideox_inputs(model, frames=8, h=8, w=12)
    f, h, w = 4, 4, 6
    n = f * h * w
    token = torch.arange(n)
    coords = (token // (h * w), (token // w) % h, token % w)
    base = T.run_cogvideox(model, inputs)
    state, handles = {}, []

    def enter(m, args, kwargs):
        x = kwargs["hidden_states"]
        state["m"] = compute_shared_merge(get_backend(x), x, coords, (st, 2, 2), n // 2)

    def merge_attn(m, args, kwargs):
        rows = tuple(t[state["m"].representatives] for t in kwargs["image_rotary_emb"])
        return args, {**kwargs, "hidden_states": state["m"].merge(kwargs["hidden_states"]), "image_rotary_emb": rows}

    for block in model.transformer_blocks:
        handles += [block.register_forward_pre_hook(enter, with_kwargs=True),
                    block.attn1.register_forward_pre_hook(merge_attn, with_kwargs=True),
                    block.attn1.register_forward_hook(lambda m, a, out: (state["m"].unmerge(out[0]),) + out[1:])]
    assert_patch_equals_hooks_by_hand(model, lambda: T.run_cogvideox(model, inputs), base, handles, TOL, ratio=0.5,
                                      use_rand=False, st=st)


@pytest.mark.parametrize("kwargs,message", [(dict(mode="downsample"), "joins text and image"),
                                            (dict(max_downsample=1), "^max_downsample"), (dict(blocks=[2]), "^blocks")])
def test_cogvideox_refuses_what_it_cannot_run_before_any_change(models, kwargs, message):
    model = models["1.5"]
    with pytest.raises(ValueError, match=message):
        tomesd.apply_patch(model, **kwargs)
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())


@pytest.mark.parametrize("version", VERSIONS)
def test_denoising_loop_is_one_graph_without_recompiles_and_equals_eager(version):
    model = T.cogvideox(version)
    steps = [T.cogvideox_inputs(model, t=t, seed=i) for i, t in enumerate((900.0, 500.0, 100.0))]
    assert_loop_compiles_once_and_equals_eager(model, T.run_cogvideox, steps, ratio=0.5, st=2, merge_mlp=True)


def test_forward_on_the_meta_device_reads_no_tensor_value():
    from diffusers import CogVideoXTransformer3DModel

    with torch.device("meta"):
        model = CogVideoXTransformer3DModel(**T.COGVIDEOX, patch_size_t=2, use_rotary_positional_embeddings=True).eval()
    inputs = {k: v.to("meta") if torch.is_tensor(v) else tuple(t.to("meta") for t in v)
              for k, v in T.cogvideox_inputs(model, frames=4, h=6, w=10).items()}
    tomesd.apply_patch(model, ratio=0.5, st=2)
    out, seen = probe(model, inputs)
    assert out.device.type == "meta" and seen["q"] == [6 + 15, 6 + 15]


@pytest.mark.parametrize("version", VERSIONS)
def test_gradient_checkpointing_gives_the_same_loss_and_gradients(version):
    assert_checkpointing_keeps_loss_and_gradients(lambda: T.cogvideox(version),
                                                  lambda **k: T.cogvideox_inputs(T.cogvideox(version), **k),
                                                  dict(ratio=0.5, merge_mlp=True))


def test_kernels_added_per_forward_do_not_grow_with_frames(models):
    model = models["1.5"]
    added = {}
    for frames in (2, 6):
        inputs = T.cogvideox_inputs(model, frames=frames)

        def count():
            with torch.no_grad(), OpCounter() as counter:
                model(**inputs)
            return counter.total

        base = count()
        tomesd.apply_patch(model, ratio=0.5)
        try:
            added[frames] = count() - base
        finally:
            tomesd.remove_patch(model)
    print(f"ops added per forward of {len(model.transformer_blocks)} blocks: {added}")
    assert 0 < added[2] == added[6]
