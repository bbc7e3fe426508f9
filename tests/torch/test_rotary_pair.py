"""A rotary (cos, sin) pair gathered once per block (runtime/sites.py: gather_pair) gives what gathering each table
gives (TokenMerge.gather_tables), for every layout of rows the families use, and follows a table changed in place."""
import types

import pytest
import torch

import tomesd  # noqa: F401  (registers the torch backend)
from tome_core import TokenMerge, get_backend
from tomesd.runtime.sites import gather_pair

B, N, M, D = 2, 6, 4, 8


def _merge(per_sample: bool) -> TokenMerge:
    xp = get_backend(torch.zeros(1))
    gen = torch.Generator().manual_seed(0)
    reps = torch.stack([torch.randperm(N, generator=gen)[:M] for _ in range(B)])
    if not per_sample:
        reps = reps[0]
    rows = torch.arange(B * N) % (B * M)  # the map itself plays no part in the rows' gather
    return TokenMerge(xp, rows, None, B, N, M, representatives=reps)


def _call() -> types.SimpleNamespace:
    return types.SimpleNamespace(eager=True, rotary=None)


LAYOUTS = [  # (table shape, rows axis, image_first)
    ((N, D), 0, False), ((3 + N, D), 0, False), ((N + 3, D), 0, True),  # Flux's rows first, with text
    ((1, N, 1, D), 1, False),  # Wan's
    ((1, 2, N, D), -2, False),  # LTX-2's rows after heads
    ((1, 3, N), -1, False),  # rows along the last axis: each table on its own
]


@pytest.mark.parametrize("per_sample", [True, False])
@pytest.mark.parametrize("shape,axis,image_first", LAYOUTS)
def test_a_pair_gathered_once_equals_each_table_gathered(shape, axis, image_first, per_sample):
    merge = _merge(per_sample)
    cos, sin = torch.randn(shape), torch.randn(shape)
    expected = merge.gather_tables((cos, sin), axis, image_first)
    call = _call()
    for _ in range(2):  # the second block reads the call's join
        got = gather_pair(get_backend(cos), merge, (cos, sin), axis, image_first, call)
        assert [g.shape for g in got] == [e.shape for e in expected]
        assert all(torch.equal(g, e) for g, e in zip(got, expected))


def test_a_table_changed_in_place_during_the_call_is_joined_again():
    merge = _merge(True)
    cos, sin = torch.randn(N, D), torch.randn(N, D)
    call = _call()
    gather_pair(get_backend(cos), merge, (cos, sin), 0, False, call)
    cos.mul_(2)
    got = gather_pair(get_backend(cos), merge, (cos, sin), 0, False, call)
    assert torch.equal(got[0], merge.gather_tables((cos, sin), 0, False)[0])
