"""diffusers' context parallelism (Ulysses and ring) with ToMe: each rank merges within its own band of the
tokens, and a P-way run equals the band rule on one process (bands=P) to fp32 round-off. Tensor parallelism
with the patch applied before or after enable_parallelism equals one process. cache-dit's parallelism merges
per band as diffusers' does; an engine whose split ToMe cannot read (ParaAttention) is refused clearly.

Each world is one spawn of gloo processes running every case (tests/parallel.py, tests/parallel_cases.py):
the tiny Flux (8 x 8 image tokens, 8 text tokens) and Wan (3 frames of 6 x 8 tokens, so two bands meet inside
a frame, across a cell) transformers with 4 heads, so Ulysses splits them 4 ways too.
"""
import pytest
import torch

import parallel
from probes import assert_round_off_apart

BANDED = ["flux_ulysses", "flux_ring", "wan_ulysses", "wan_ring"]
PROPORTIONAL = ["flux_ulysses_prop", "flux_ring_prop", "wan_ring_prop", "wan_ulysses_prop_vs_plain"]
TOLERANCE = 2e-5  # fp32 round-off: attention sums its keys in another order on P ranks
TOKENS = {"flux_ulysses": 64, "flux_ring": 64, "wan_ulysses": 144, "wan_ring": 144, "flux_ulysses_prop": 64,
          "flux_ring_prop": 64, "wan_ring_prop": 144, "wan_ulysses_prop_vs_plain": 144}


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return parallel.run(2, BANDED + PROPORTIONAL + ["flux_reuse_steps", "flux_pipeline_clock", "patch_before_parallelism",
                                     "tensor_parallel", "refusals", "cache_dit_ulysses", "para_attention"],
                        tmp_path_factory.mktemp("cp2"))


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return parallel.run(4, BANDED, tmp_path_factory.mktemp("cp4"))


def _case(ranks, name):
    results = ranks[0][name]
    assert not isinstance(results, str), results  # a case that raised reports its traceback
    return results


def _check_banded(ranks, name, world):
    out = _case(ranks, name)
    # The effect first: ToMe moves the output far more than the tolerance, and bands differ from one matching.
    assert (out["bands"] - out["base"]).abs().max() > 1e3 * TOLERANCE
    assert (out["bands"] - out["global"]).abs().max() > 10 * TOLERANCE
    assert (out["parallel"] - out["bands"]).abs().max() < TOLERANCE
    # Every rank's first attention took its band less its share of the merged tokens, the same on every rank.
    band = TOKENS[name] // world
    for rank in range(world):
        assert ranks[rank][name][f"tokens/{rank}"] == [band - int(band * 0.5)]


@pytest.mark.parametrize("name", BANDED)
def test_two_ranks_equal_two_bands_on_one_process(world2, name):
    _check_banded(world2, name, 2)


@pytest.mark.parametrize("name", PROPORTIONAL)
def test_proportional_attention_on_two_ranks_equals_two_bands_on_one_process(world2, name):
    """Each rank's merged keys keep their sizes through Ulysses' all-to-all and ring's passes: a 2-way run with
    proportional attention equals bands=2 with it on one process."""
    _check_banded(world2, name, 2)
    if name == "wan_ulysses_prop_vs_plain":  # and the weights act there
        out = _case(world2, name)
        assert (out["parallel"] - out["plain"]).abs().max() > 1e3 * TOLERANCE


@pytest.mark.parametrize("name", BANDED)
def test_four_ranks_equal_four_bands_on_one_process(world4, name):
    _check_banded(world4, name, 4)


def test_reuse_steps_under_context_parallelism(world2):
    out = _case(world2, "flux_reuse_steps")
    assert out["parallel/reused"] == out["bands/reused"] > 0  # the second call of each window reused
    assert (out["parallel"] - out["bands"]).abs().max() < TOLERANCE


def test_the_pipeline_clock_under_context_parallelism(world2):
    out = _case(world2, "flux_pipeline_clock")
    assert_round_off_apart(out["parallel"], out["bands"], out["plain"])  # images through 3 steps and a VAE


def test_patch_before_enable_parallelism_equals_after(world2):
    out = _case(world2, "patch_before_parallelism")
    assert torch.equal(out["before"], out["after"])


def test_tensor_parallelism_with_the_patch_before_or_after_equals_one_process(world2):
    """Flux's row-wise layers (the single block's proj_out) hand ToMe's unmerge a DTensor partial sum: it is
    unmerged on each rank's local tensor."""
    out = _case(world2, "tensor_parallel")
    assert (out["one"] - out["base"]).abs().max() > 1e3 * TOLERANCE
    assert (out["after"] - out["one"]).abs().max() < TOLERANCE
    assert torch.equal(out["before"], out["after"])


def test_cache_dits_context_parallelism_merges_each_band(world2):
    """cache-dit's own parallelism (ParallelismConfig(ulysses_size=2)) records its config on the model as
    diffusers does: each rank merges its band, equal to bands=2 on one process."""
    out = _case(world2, "cache_dit_ulysses")
    assert (out["parallel"] - out["bands"]).abs().max() < TOLERANCE
    assert [world2[rank]["cache_dit_ulysses"][f"tokens/{rank}"] for rank in (0, 1)] == [[16], [16]]


def test_an_engine_whose_split_tome_cannot_read_is_refused_clearly(world2):
    """ParaAttention keeps its mesh in a forward it swaps in: the block that reveals the split refuses, naming
    the engines where ToMe merges per band. (para-attn 0.3.38 fails on diffusers 0.42 by itself: below.)"""
    out = _case(world2, "para_attention")
    assert "enable_gqa" in out["unpatched"]
    for words in ("holds 32 of the call's 64 image tokens", "enable_parallelism(ContextParallelConfig", "cache-dit",
                  "remove_patch"):
        assert words in out["refusal"], out["refusal"]


@pytest.mark.parametrize("case,words", [
    ("ulysses_anything", ["ulysses_anything=True", "Leave ulysses_anything off", "bands=2"]),
    ("downsample", ["mode='downsample' does not run under context parallelism", "use mode='merge'"]),
    ("bands", ["bands=3 contradicts the 2 processes", "Leave bands out"]),
    ("sd3", ["SD3Transformer2DModel under context parallelism", "remove_patch", "bands=2"]),
])
def test_what_a_band_cannot_serve_is_refused_at_the_first_call(world2, case, words):
    message = _case(world2, "refusals")[case]
    assert all(word in message for word in words), message
