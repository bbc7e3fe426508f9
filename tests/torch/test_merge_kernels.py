"""Which mean a merge takes (issue 59, item 4): torch's own `scatter_reduce_` mean (one call from the host, seven
kernels on CUDA) where its counts are unknown and nothing compiles; a sum times the inverse counts the merge keeps
(three kernels, and lowered by inductor) once they are known, at every later merging site, and always under a graph
compiler. Both give tomesd 0.1.3's merge to fp32 round-off."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from multiset import assert_same_rows
from references import load_tomesd_ref
from tome_core import bipartite_soft_matching_random2d

ref = load_tomesd_ref()


class Ops(TorchDispatchMode):
    """The names of the aten ops a region dispatches."""

    def __init__(self) -> None:
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _inputs():
    x = torch.randn(2, 256, 16, generator=torch.Generator().manual_seed(3))
    return x, bipartite_soft_matching_random2d(x, 16, 16, 2, 2, 128, no_rand=True)


def test_a_merge_takes_torchs_mean_until_its_counts_are_known_then_a_sum_times_them():
    x, (m, _) = _inputs()
    m_ref, _ = ref.merge.bipartite_soft_matching_random2d(x, 16, 16, 2, 2, 128, no_rand=True)
    with Ops() as first:
        own = m(x)
    m.__self__.inv_counts  # what proportional attention and restored tokens ask for
    with Ops() as later:
        kept = m(x)
    assert "scatter_reduce_" in first.names and "index_add_" not in first.names
    assert "scatter_reduce_" not in later.names and {"index_add_", "mul_"} <= set(later.names)
    theirs = m_ref(x)
    assert (kept - own).abs().max() < 1e-6 < (m.__self__.unmerge(own) - x).abs().max() / 1e5  # round-off apart; merged
    assert_same_rows(own.numpy(), theirs.numpy(), 1e-6)  # tomesd's rows, in the core's row order
    assert_same_rows(kept.numpy(), theirs.numpy(), 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_under_a_graph_compiler_every_mean_is_a_sum_times_kept_counts(dtype):
    x, _ = _inputs()
    x = x.to(dtype)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append({n.target if n.op == "call_method" else getattr(n.target, "__name__", str(n.target))
                       for n in gm.graph.nodes if n.op in ("call_function", "call_method")})
        return gm.forward

    def merged(x):
        m, u = bipartite_soft_matching_random2d(x.float(), 16, 16, 2, 2, 128, no_rand=True)
        return u(torch.tanh(m(x)))

    torch._dynamo.reset()
    try:
        out = torch.compile(merged, backend=backend, fullgraph=True)(x)
    finally:
        torch._dynamo.reset()  # no compiled code left for the tests after this one
    targets = graphs[0]
    assert "scatter_reduce_" not in targets and "index_add_" in targets, sorted(targets)
    torch.testing.assert_close(out, merged(x), rtol=1e-3 if dtype is torch.float16 else 1e-6, atol=1e-3 if dtype is torch.float16 else 1e-6)


def test_an_eager_call_asks_whether_to_keep_counts_with_no_python_call():
    """The runtime's eager backend (CallState.xp of a call no graph compiler traces) answers a merge's question for
    free: no Python frame on the hot path, and no kept counts (scatter_reduce_'s one call)."""
    import sys

    from tomesd.backends.torch import eager_backend

    frames = []
    previous = sys.getprofile()
    sys.setprofile(lambda frame, event, arg: frames.append(frame.f_code.co_name) if event == "call" else None)
    try:
        answer = eager_backend.prefers_kept_counts()
    finally:
        sys.setprofile(previous)
    assert answer is False and frames == []
