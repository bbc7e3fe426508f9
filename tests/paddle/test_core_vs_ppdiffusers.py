"""Our core on paddle against ppdiffusers' merge functions, and against our torch backend."""
import numpy as np
import paddle
import pytest
import torch

from multiset import assert_same_rows
from shapes import CASES
import tomesd  # noqa: F401  (registers tome_core's torch and paddle backends)
from tome_core import DEFAULT_SEED, bipartite_soft_matching_random2d

from ppdiffusers.patches.tomesd_patch_utils import bipartite_soft_matching_random2d as pp_ref


def f(x):
    """A token-wise non-linear map with kernels for float32 and bfloat16 on paddle's CPU build."""
    return x * x - x


def as_np(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.float().numpy()
    return x.astype("float32").numpy()


@pytest.mark.parametrize("case", CASES, ids=str)
def test_merge_and_unmerge_equal_ppdiffusers(case):
    b, h, w, sx, sy, r = case
    x = paddle.to_tensor(np.random.RandomState(sum(case)).randn(b, h * w, 24).astype("float32"))
    m_ref, u_ref = pp_ref(x, w, h, sx, sy, r, no_rand=True)
    m, u = bipartite_soft_matching_random2d(x, w, h, sx, sy, r, no_rand=True)
    merged, merged_ref = m(x), m_ref(x)
    assert merged.shape == merged_ref.shape
    out, out_ref = u(f(merged)), u_ref(f(merged_ref))
    assert_same_rows(as_np(merged), as_np(merged_ref), 1e-5)
    np.testing.assert_allclose(as_np(out), as_np(out_ref), atol=1e-5)
    effect = np.abs(as_np(out) - as_np(f(x))).max()
    assert effect > 1e-2 if r > 0 else effect == 0.0


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("no_rand", [True, False])
# paddle's CPU build has no float16 multiply/tanh/p_norm and no bfloat16 matmul kernels, so half
# precision models only run on its GPU build; here bfloat16 covers the merge arithmetic (matching
# on fp32) and torch covers float16 end to end in tests/torch.
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-6), ("bfloat16", 2e-2)])
def test_torch_and_paddle_merge_the_same_tokens(case, no_rand, dtype, tol):
    b, h, w, sx, sy, r = case
    data = np.random.RandomState(7 + sum(case)).randn(b, h * w, 24).astype("float32")
    # Matching on the fp32 metric (half precision has exact score ties, broken arbitrarily);
    # the merged values themselves are computed in `dtype`.
    xt = torch.from_numpy(data).to(getattr(torch, dtype))
    xp = paddle.to_tensor(data).astype(dtype)
    # Default arguments (no seed): the random dst pattern must be the same on both frameworks.
    mt, ut = bipartite_soft_matching_random2d(torch.from_numpy(data), w, h, sx, sy, r, no_rand=no_rand)
    mp, up = bipartite_soft_matching_random2d(paddle.to_tensor(data), w, h, sx, sy, r, no_rand=no_rand)
    # Same layout on both backends, so the tensors compare row by row, not as multisets: a backend
    # that merged a different token fails here. On the 1024-token grid the smallest gap between
    # similarity scores (~1e-6) meets the two frameworks' matmul round-off, so a token at the
    # merge boundary may flip there; at most 0.5% of tokens may differ on that grid, none elsewhere.
    merged_t, merged_p = mt(xt), mp(xp)
    out_t, out_p = as_np(ut(f(merged_t))), as_np(up(f(merged_p)))
    allowed = tol + tol * np.abs(out_p)  # what the check below lets each element differ by
    token_ok = (np.abs(out_t - out_p) <= allowed).all(-1)
    # The merge acts, far beyond the tolerance: on the agreeing tokens some element moves by over 100x
    # what it may differ by. (Per element: against the largest |out|, bfloat16's rtol leaves no 100x room.)
    if r > 0:
        margin = (np.abs(out_t - as_np(f(xt))) / allowed)[token_ok].max()
        assert margin > 100, f"the merge moved the output by only {margin:.1f}x the tolerance"
    if h * w <= 100:
        np.testing.assert_allclose(as_np(merged_t), as_np(merged_p), atol=tol, rtol=tol)
        assert token_ok.all()
    else:
        assert token_ok.mean() >= 0.995, f"{(~token_ok).sum()} tokens differ"
    if r > 0:
        top_left = bipartite_soft_matching_random2d(xt, w, h, sx, sy, r, no_rand=True)[0](xt)
        if not no_rand and min(h // sy, w // sx) > 1:
            assert not torch.equal(merged_t, top_left), "use_rand must change the dst choice"


def test_seed_picks_the_pattern_alike_on_both_frameworks():
    """No seed means DEFAULT_SEED; another seed gives another pattern, the same on torch and paddle."""
    b, h, w, sx, sy, r = 2, 16, 16, 2, 2, 100
    data = np.random.RandomState(3).randn(b, h * w, 24).astype("float32")

    def merged(x, **kw):
        return as_np(bipartite_soft_matching_random2d(x, w, h, sx, sy, r, **kw)[0](x))

    xt, xp = torch.from_numpy(data), paddle.to_tensor(data)
    # The merge acts, far beyond the tolerance: unmerge(merge(x)) is far from x, for both seeds compared.
    for x in (xt, xp):
        for seed in (11, DEFAULT_SEED):
            m, u = bipartite_soft_matching_random2d(x, w, h, sx, sy, r, seed=seed)
            assert np.abs(as_np(u(m(x))) - data).max() > 1e-2
    np.testing.assert_array_equal(merged(xt), merged(xt, seed=DEFAULT_SEED))
    np.testing.assert_array_equal(merged(xp), merged(xp, seed=DEFAULT_SEED))
    assert not np.array_equal(merged(xt, seed=11), merged(xt))
    np.testing.assert_allclose(merged(xt, seed=11), merged(xp, seed=11), atol=1e-6)


def test_paddle_global_rng_untouched():
    x = paddle.randn([2, 256, 16])
    paddle.seed(5)
    expected = paddle.rand([4]).numpy()
    paddle.seed(5)
    bipartite_soft_matching_random2d(x, 16, 16, 2, 2, 100)
    np.testing.assert_array_equal(paddle.rand([4]).numpy(), expected)

