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


# A mean merge as a product with its 0/1 matrix (issue 66, item 5): where a GPU's scatter is the slow way
# (tomesd/backends/torch.py, merge_pays_as_product), one bmm per merging site, its matrix built once per merge.

def test_a_half_precision_merge_on_a_gpu_is_a_product_below_the_break_even():
    from tomesd.backends.torch import merge_pays_as_product, scattered_merges

    meta16 = torch.empty(1, device="meta", dtype=torch.float16)
    assert merge_pays_as_product(meta16, 2, 4096, 1024)  # SD3, Flux, SDXL at 1024², r=0.75: 4,096 tokens
    assert merge_pays_as_product(meta16.to(torch.bfloat16), 1, 4608, 1536)  # Flux's single blocks, text in front
    assert not merge_pays_as_product(meta16, 2, 16384, 4096)  # SD1.5's 1024² top level: the scatter is cheaper
    assert not merge_pays_as_product(meta16.float(), 2, 4096, 1024)  # float32: no tensor cores by default
    assert not merge_pays_as_product(torch.empty(1, dtype=torch.float16), 2, 4096, 1024)  # a CPU adds
    assert not merge_pays_as_product(meta16, 64, 4096, 1024)  # its matrix past 64 MiB
    with scattered_merges():  # as the recorded GPU runs merged (the device-time model's fit traces so)
        assert not merge_pays_as_product(meta16, 2, 4096, 1024)
    assert merge_pays_as_product(meta16, 2, 4096, 1024)


@pytest.fixture
def products(monkeypatch):
    """Every mean merge a product, here on a CPU in float32 where the rule would scatter."""
    import tomesd.backends.torch as torch_backend

    monkeypatch.setattr(torch_backend, "merge_pays_as_product", lambda *args: True)


def test_a_product_merge_is_tomesds_merge(products):
    x, (m, u) = _inputs()
    m_ref, _ = ref.merge.bipartite_soft_matching_random2d(x, 16, 16, 2, 2, 128, no_rand=True)
    with Ops() as first:
        own = m(x)
    with Ops() as later:
        again = m(x)
    # the matrix built at the first site (zeros, one scatter of the tokens' ones), a product at each
    assert "bmm" in first.names and "scatter_reduce_" not in first.names and first.names.count("scatter_") == 1
    assert later.names.count("bmm") == 1 and "scatter_" not in later.names and "index_add_" not in later.names
    assert torch.equal(own, again)
    assert_same_rows(own.numpy(), m_ref(x).numpy(), 1e-6)
    assert (u(own) - x).abs().max() > 0.1  # it merged


def _diffusers_at_least(version):
    import diffusers
    from packaging.version import Version

    return Version(diffusers.__version__) >= Version(version)


def _sd3_and_flux():
    import tiny_torch as T

    return [("sd3", T.transformer("sd3"), T.transformer_inputs("sd3"), T.run_transformer),
            ("flux", T.flux(), T.flux_inputs(), lambda model, inputs: model(**inputs).sample)]


@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_a_model_merging_by_products_gives_its_scattered_output(kind, monkeypatch):
    """SD3's joint blocks and Flux's double and single blocks (the image alone, and text in front of it: the whole
    map's matrix) with proportional attention: products give the scatter's output to fp32 round-off."""
    import tomesd
    import tomesd.backends.torch as torch_backend
    from probes import assert_round_off_apart

    with torch.no_grad():
        name, model, inputs, run = next(c for c in _sd3_and_flux() if c[0] == kind)
        plain = run(model, inputs)
        tomesd.apply_patch(model, ratio=0.5, merge_mlp=True, proportional_attention=True)
        try:
            scattered = run(model, inputs)
            taken = []
            monkeypatch.setattr(torch_backend, "merge_pays_as_product", lambda *args: taken.append(args[1:]) or True)
            with Ops() as ops:
                product = run(model, inputs)
        finally:
            tomesd.remove_patch(model)
    assert "bmm" in ops.names and "scatter_reduce_" not in ops.names and taken
    if kind == "flux" and _diffusers_at_least("0.42"):  # its single blocks' [text, image]: 5 tokens, then 64
        assert any(n == 5 + 64 for _, n, _ in taken), taken
    assert_round_off_apart(product, scattered, plain)
