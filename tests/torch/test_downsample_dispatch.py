"""mode="downsample" on Flux and Wan, whose processors rotate keys after projecting them: the keys and values
are downsampled where the processor hands them, rotated, to diffusers' attention dispatch.

The reference is written here independently of the library: a backend wrapper installed by the test keeps the
text rows of every self-attention's keys and values whole and shrinks the image rows by slicing the grid
("nearest") or by average pooling ("avg"), on the unpatched model."""
import contextlib

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F

import step_caches as S
import tiny_ltx2_family as L2
import tiny_packed_families as P
import tiny_torch as T
import tomesd
from diffusers.models.attention_dispatch import _AttentionBackendRegistry as Registry

TOL = 1e-5


def flux_case(h, w):
    return T.flux, T.flux_inputs(h=h, w=w), (1, h, w)


def wan_case(h, w, frames=3):
    return T.wan, T.wan_inputs(frames=frames, h=2 * h, w=2 * w), (frames, h, w)


def ltx_case(frames, h, w):  # a packed latent whose grid is num_frames, height, width (layouts_packed.py)
    return P.ltx, P.ltx_inputs(frames=frames, h=h, w=w), (frames, h, w)


def ltx2_case(frames, h, w):  # LTX-2: the video's self-attention alone shrinks (its audio's keys are fewer than n)
    return L2.ltx2, L2.ltx2_inputs(frames=frames, h=h, w=w), (frames, h, w)


def qwen_case(h, w):  # a packed latent whose grid is img_shapes; keys [text, image] at the dispatch
    return P.qwen, P.qwen_inputs(h=h, w=w), (1, h, w)


CASES = {"flux-8x8": flux_case(8, 8), "flux-7x9": flux_case(7, 9), "wan-3x4x4": wan_case(4, 4),
         "wan-2x5x7": wan_case(5, 7, frames=2), "ltx-2x5x7": ltx_case(2, 5, 7), "qwen-image-7x9": qwen_case(7, 9),
         "ltx2-2x5x7": ltx2_case(2, 5, 7)}


def shrink_by_hand(x, grid, factor, method):
    """[B, S, heads, dim] whose last f*h*w rows are frames of an h x w grid: those rows downsampled per frame."""
    frames, h, w = grid
    n = frames * h * w
    b, s, heads, dim = x.shape
    image = x[:, s - n:].reshape(b, frames, h, w, heads * dim)
    if method == "nearest":
        small = image[:, :, ::factor, ::factor]
    else:  # cells at the far edges averaged over the tokens they hold
        planes = image.permute(0, 1, 4, 2, 3).reshape(b * frames, heads * dim, h, w)
        pooled = F.avg_pool2d(planes, factor, ceil_mode=True)
        small = pooled.reshape(b, frames, heads * dim, *pooled.shape[-2:]).permute(0, 1, 3, 4, 2)
    return torch.cat([x[:, :s - n], small.reshape(b, -1, heads, dim)], 1)


@contextlib.contextmanager
def backend_by_hand(grid, factor, method, seen):
    """The active backend, with every self-attention's image keys and values shrunk by hand."""
    name, fn = Registry.get_active_backend()
    n = grid[0] * grid[1] * grid[2]

    def shrunk(**kwargs):
        if kwargs["query"].shape[1] == kwargs["key"].shape[1] >= n:  # self-attention (Wan's cross keys are text)
            kwargs["key"] = shrink_by_hand(kwargs["key"], grid, factor, method)
            kwargs["value"] = shrink_by_hand(kwargs["value"], grid, factor, method)
        seen.append(kwargs["key"].shape[1])
        return fn(**kwargs)

    Registry._backends[name] = shrunk
    try:
        yield
    finally:
        Registry._backends[name] = fn


@contextlib.contextmanager
def keys_seen(seen):
    name, fn = Registry.get_active_backend()

    def counted(**kwargs):
        seen.append(kwargs["key"].shape[1])
        return fn(**kwargs)

    Registry._backends[name] = counted
    try:
        yield
    finally:
        Registry._backends[name] = fn


def run(model, inputs):
    with torch.no_grad():
        return model(**inputs).sample


@pytest.mark.parametrize("method,factor", [("nearest", 2), ("avg", 2), ("nearest", 3)])
@pytest.mark.parametrize("case", sorted(CASES))
def test_keys_and_values_are_the_rotated_ones_downsampled_text_whole(case, method, factor):
    build, inputs, grid = CASES[case]
    model = build().eval()
    full_keys = []
    with keys_seen(full_keys):
        base = run(model, inputs)
    expected_keys = []
    with backend_by_hand(grid, factor, method, expected_keys):
        expected = run(model, inputs)
    assert (expected - base).abs().max().item() > 1000 * TOL  # downsampling changes the output
    keys = []
    with keys_seen(keys):  # outside the patch's wrapper: it sees what the backend gets
        tomesd.apply_patch(model, mode="downsample", downsample_factor=factor, downsample_method=method)
        try:
            out = run(model, inputs)
        finally:
            tomesd.remove_patch(model)
    assert keys == expected_keys and sum(keys) < sum(full_keys)
    if method == "nearest":
        assert torch.equal(out, expected)
    else:  # means taken in another order than avg_pool2d's
        torch.testing.assert_close(out, expected, rtol=0, atol=TOL)
    assert torch.equal(run(model, inputs), base)


@pytest.mark.parametrize("case", ["flux-7x9", "wan-2x5x7"])
def test_factor_one_equals_the_host_bit_for_bit(case):
    build, inputs, _ = CASES[case]
    model = build().eval()
    base = run(model, inputs)
    tomesd.apply_patch(model, mode="downsample", downsample_factor=1)
    try:
        assert torch.equal(run(model, inputs), base)
    finally:
        tomesd.remove_patch(model)


def test_the_registry_is_restored_when_the_last_patch_goes_and_copies_keep_working():
    import copy
    import gc

    gc.collect()  # patched models earlier tests dropped without remove_patch count until they are collected
    own = dict(Registry._backends)
    assert not any(hasattr(fn, "seam") for fn in own.values())  # no wrapper of ours is left in place
    first, second = T.wan().eval(), T.flux().eval()
    wan_inputs, flux_inputs = T.wan_inputs(), T.flux_inputs()
    wan_base = run(first, wan_inputs)
    tomesd.apply_patch(first, mode="downsample")
    tomesd.apply_patch(second, mode="downsample")
    assert all(Registry._backends[name] is not fn for name, fn in own.items())
    wan_down = run(first, wan_inputs)
    tomesd.remove_patch(second)
    copied = copy.deepcopy(first)
    tomesd.remove_patch(first)
    assert all(Registry._backends[name] is not fn for name, fn in own.items())  # the copy still uses the seam
    assert torch.equal(run(copied, wan_inputs), wan_down) and torch.equal(run(first, wan_inputs), wan_base)
    tomesd.remove_patch(copied)
    assert all(Registry._backends[name] is fn for name, fn in own.items())
    run(second, flux_inputs)


def test_a_dropped_copy_of_a_patched_model_does_not_keep_the_seam():
    """Merge mode on Flux uses the seam too (per-sample rotation): a deep copy of the patched model that is
    dropped without remove_patch stops counting once collected, so the registry comes back with the last
    patch removed."""
    import copy
    import gc

    gc.collect()  # as above
    own = dict(Registry._backends)
    model = T.flux().eval()
    tomesd.apply_patch(model, ratio=0.5)
    copied = copy.deepcopy(model)
    assert all(Registry._backends[name] is not fn for name, fn in own.items())
    del copied
    gc.collect()
    tomesd.remove_patch(model)
    assert all(Registry._backends[name] is fn for name, fn in own.items())


def test_a_function_put_in_a_backends_place_and_taken_out_while_the_seam_is_open_stays_out():
    """Code that wraps the active backend while a patch is applied (a profiler, a test's counter), is wrapped
    in turn at the next root's entry, and then puts back what it found, must not come back when the last
    patch goes: the seam unwraps what holds the place at that moment. (It once restored the function it had
    recorded at wrapping, which left a test's counter in the registry and made later compiled loops recompile
    on its growing list.)"""
    import gc

    gc.collect()
    name, native = Registry.get_active_backend()
    assert not hasattr(native, "seam")
    model = T.flux().eval()
    tomesd.apply_patch(model, ratio=0.5)  # merge mode on Flux opens the seam
    seen = []
    try:
        with keys_seen(seen):
            run(model, T.flux_inputs(batch=2))  # the root's entry wraps the counter
            assert hasattr(Registry._backends[name], "seam") and seen
    finally:
        tomesd.remove_patch(model)
    assert Registry._backends[name] is native


class SelfMadeProcessor:
    """A processor that computes attention itself, not through diffusers' dispatch."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        q, k, v = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        out = F.scaled_dot_product_attention(*(t.unflatten(-1, (attn.heads, -1)).transpose(1, 2) for t in (q, k, v)))
        return attn.to_out[0](out.transpose(1, 2).flatten(2))


def test_a_processor_that_bypasses_the_dispatch_is_refused_at_apply_and_at_the_first_call():
    model = T.wan().eval()
    inputs = T.wan_inputs()
    original = model.blocks[0].attn1.processor
    model.blocks[0].attn1.set_processor(SelfMadeProcessor())
    with pytest.raises(ValueError, match="SelfMadeProcessor does not call it.*mode='merge'"):
        tomesd.apply_patch(model, mode="downsample")
    assert not hasattr(model, "_tome_patch")
    model.blocks[0].attn1.set_processor(original)
    tomesd.apply_patch(model, mode="downsample")
    try:
        model.blocks[1].attn1.set_processor(SelfMadeProcessor())  # swapped after the patch
        with pytest.raises(ValueError, match="SelfMadeProcessor does not call it"):
            run(model, inputs)
    finally:
        tomesd.remove_patch(model)


def test_wan_downsampling_reads_no_tensor_value_and_traces_as_one_graph():
    from diffusers import WanTransformer3DModel

    with torch.device("meta"):
        meta = WanTransformer3DModel(**T.WAN).eval()
    keys = []
    with keys_seen(keys):
        tomesd.apply_patch(meta, mode="downsample")
        out = run(meta, {k: v.to("meta") for k, v in T.wan_inputs(frames=2, h=6, w=10).items()})
        tomesd.remove_patch(meta)
    assert out.device.type == "meta" and keys == [2 * 2 * 3, 6, 2 * 2 * 3, 6]  # 2 frames of 3 x 5 -> 2 x 3; text

    model = T.wan().eval()
    tomesd.apply_patch(model, mode="downsample")
    try:
        torch._dynamo.reset()
        with torch.no_grad():
            explained = torch._dynamo.explain(model)(**T.wan_inputs())
        assert explained.graph_break_count == 0 and explained.graph_count == 1
    finally:
        torch._dynamo.reset()
        tomesd.remove_patch(model)


def test_flux_reads_its_grid_once_per_ids_tensor_and_refuses_a_compiled_first_read():
    model = T.flux().eval()
    inputs = T.flux_inputs(h=7, w=9)
    tomesd.apply_patch(model, mode="downsample")
    try:
        layout = model._tome_patch.layout
        run(model, inputs)
        run(model, inputs)
        assert [grid for _, grid in layout._grids.values()] == [(1, 7, 9)]
        torch._dynamo.reset()
        with pytest.raises(RuntimeError, match="use mode='merge' under torch.compile"):
            torch.compile(model, backend="eager")(**T.flux_inputs(h=7, w=9))
        # A grid from another corner (LongCat-Image's ids start at (512, 512)) is read from there, once more.
        shifted = dict(inputs, img_ids=inputs["img_ids"] + torch.tensor([0.0, 512.0, 512.0]))
        run(model, shifted)
        assert [grid for _, grid in layout._grids.values()] == [(1, 7, 9), (1, 7, 9)]
        transposed = dict(inputs, img_ids=inputs["img_ids"][:, [0, 2, 1]])  # a 9x7 grid in column-major order
        with pytest.raises(ValueError, match="row-major order from its corner"):
            run(model, transposed)
    finally:
        torch._dynamo.reset()
        tomesd.remove_patch(model)


@pytest.mark.parametrize("kind,cache", [(k, c) for k in ("flux", "wan") for c in ("taylorseer", "fastercache", "pab")
                                        if (k, c) not in S.FAILS_IN_DIFFUSERS])
def test_downsampling_stacks_with_a_step_cache_in_either_order(kind, cache):
    """The arming sits innermost in the attention's forward chain: a cached step skips the attention (and
    arms nothing), a computed one downsamples; the pair does not depend on which was applied first, and
    removing the patch leaves the cache as it is alone."""
    def net(patch=True, patch_first=False):
        model = S.model(kind)
        if patch and patch_first:
            tomesd.apply_patch(model, mode="downsample")
        S.apply(model, kind, cache)
        if patch and not patch_first:
            tomesd.apply_patch(model, mode="downsample")
        return model

    keys = []
    with keys_seen(keys):  # entered first: the patch's wrapper hands it the downsampled keys
        both_net = net()
        both, both_q, _ = S.loop(kind, both_net)
        tomesd.remove_patch(both_net)
    S.reset(both_net)
    after, _, _ = S.loop(kind, both_net)  # the cache alone again
    other = net(patch_first=True)
    again, _, _ = S.loop(kind, other)
    tomesd.remove_patch(other)
    full_keys = []
    with keys_seen(full_keys):
        cache_only, cache_q, _ = S.loop(kind, net(patch=False))
    assert [len(step) for step in both_q] == [len(step) for step in cache_q]
    assert sum(len(step) for step in cache_q) < len(cache_q) * len(cache_q[0])  # the cache skips
    assert len(keys) == len(full_keys) and sum(keys) < sum(full_keys)  # every computed attention downsamples
    assert all(torch.equal(a, b) for a, b in zip(both, again))
    assert max((a - b).abs().max().item() for a, b in zip(both, cache_only)) > 1000 * TOL
    assert all(torch.equal(a, b) for a, b in zip(after, cache_only))


def test_an_arming_a_trace_left_behind_never_meets_an_eager_call():
    """The dispatch seam is the process's: while a patch holds it open, every model's attention passes through it. An
    arming made under a trace whose disarm never ran (an aborted trace) stays in the traced slot; an eager call, of
    the patched model or of any other, must not take it."""
    from tomesd.backends.seam import Arming
    from tomesd.backends.torch_dispatch import SEAM

    def bomb(kwargs):
        raise AssertionError("an eager attention took a traced arming")

    model, inputs, _ = flux_case(8, 8)
    patched, other = model(), model()
    expected = run(other, inputs)
    tomesd.apply_patch(patched, mode="downsample")
    try:
        assert any(hasattr(fn, "seam") for fn in Registry._backends.values())  # the seam is open
        SEAM._traced = Arming(bomb, 1)  # as a trace that armed and was cut short leaves it
        assert torch.equal(run(other, inputs), expected)  # an unpatched model's attention, no arming of its own
        run(patched, inputs)
    finally:
        SEAM._traced = None
        tomesd.remove_patch(patched)
