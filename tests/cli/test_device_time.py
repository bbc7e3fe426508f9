"""The device-time model (tomesd/devicetime) and `bench --predict`: the meta-device trace sees the kernels a GPU
would launch, the fit recovers rates it was given, the recorded profiles load, and the command predicts, says it
predicts, and refuses what it cannot price. Nothing here times anything."""
import argparse
import json
import random

import pytest
import torch

from tomesd.bench.cli import add_arguments, run
from tomesd.devicetime import fit as fitting
from tomesd.devicetime.model import Rates, predict, rates_for
from tomesd.devicetime.records import Record, load
from tomesd.devicetime.trace import ATTENTION, CLASSES, MATMUL, Launch, TraceRefused, trace


def bench(argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return run(parser.parse_args(argv))


def test_the_trace_sees_each_kernel_once_and_no_view():
    with torch.device("meta"):
        x, w = torch.randn(2, 64, 32), torch.randn(48, 32)
        q = torch.randn(2, 4, 64, 40)

    def forward():
        y = torch.nn.functional.linear(x, w)  # one matrix product
        y = y.transpose(1, 2).reshape(2, -1)  # views, then one copy (the transposed reshape)
        torch.nn.functional.scaled_dot_product_attention(q, q, q)  # one fused kernel, not its decomposition
        return y

    launches = trace(forward)
    assert [l.cls for l in launches] == [MATMUL, "copy", ATTENTION]
    assert launches[0].flops == 2 * 2 * 64 * 32 * 48
    attention = launches[2]
    assert attention.flops == 2 * (2 * 4 * 64 * 64) * (40 + 40)  # 4 B H S^2 D
    assert attention.padded_flops == 2 * (2 * 4 * 64 * 64) * (64 + 64)  # a head of 40 computes as 64
    assert attention.scores == 2 * 4 * 64 * 64


def test_a_host_read_is_refused_by_name():
    with torch.device("meta"):
        x = torch.randn(4)
    with pytest.raises(TraceRefused, match="meta"):
        trace(lambda: x.sum().item())


def test_the_fit_recovers_the_rates_it_was_given():
    """Synthetic records timed by known rates: the fit gives back rates that predict them exactly."""
    truth = Rates("h100", 0.004, {"matmul": 1.2e-12, "conv": 2e-12, "attention": 7e-13},
                  {term: 5e-10 * (1 + i / 4) for i, term in enumerate(fitting.TERMS)}, 4e-10)
    gen = random.Random(0)
    launches, records = {}, []
    for i in range(12):
        mine = [Launch(op, cls, gen.uniform(1e9, 1e12) if cls in ("matmul", "conv", ATTENTION) else 0.0,
                       gen.uniform(1e6, 1e8), False, gen.uniform(1e6, 1e8) if cls == ATTENTION else 0.0)
                for cls, op in zip(CLASSES, ("mm", "convolution", "sdpa", "native_layer_norm", "add", "cat", "gather",
                                             "max")) for _ in range(gen.randint(1, 30))]
        mine += [Launch("native_group_norm", "norm", 0.0, gen.uniform(1e6, 1e8)) for _ in range(gen.randint(1, 9))]
        mine += [Launch("sort", "sort_reduce", 0.0, gen.uniform(1e6, 1e8)) for _ in range(gen.randint(1, 9))]
        mine += [Launch("scatter_add_", "gather_scatter", 0.0, gen.uniform(1e6, 1e8)) for _ in range(gen.randint(1, 9))]
        by_class = {cls: sum(truth.kernel_ms(l) for l in mine if l.cls == cls) for cls in CLASSES}
        settings = (("config", f"m{i}"), ("res", 1024))
        launches[(settings, "baseline")] = mine
        records.append(Record(f"run{i}.json", "h100", settings, "baseline", sum(by_class.values()),
                              tuple(sorted(by_class.items()))))
    got = fitting.fit(records, launches)["h100"]
    for r in records:
        assert predict(launches[(r.settings, r.label)], got).total_ms == pytest.approx(r.total_ms, rel=1e-6)


def test_the_recorded_profiles_load():
    records = load("docs/gpu")
    assert len(records) == 57 and len({r.path for r in records}) == 16  # the 16 runs, 57 configurations
    assert {r.gpu for r in records} == {"h100", "h200"}
    sd15_2048 = next(r for r in records if r.model == "sd15 2048" and r.label == "baseline")
    assert 300 < sd15_2048.total_ms < 320  # without the profiler's "Command Buffer Full" stall (132 ms)


def test_shipped_rates_name_their_gpus_and_refuse_others():
    assert rates_for("H100").gpu == "h100"
    with pytest.raises(ValueError, match="no rates for 'a100'; it knows h100, h200"):
        rates_for("a100")


def test_bench_predict_writes_predicted_rows(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert bench(["--config", "tiny", "--res", "256", "--ratios", "0.5", "--compare", "--predict", "h100",
                  "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "predicted by the device-time model" in printed and "worst" in printed
    doc = json.loads(out.read_text())
    assert doc["predicted"] is True and doc["gpu"] == "h100" and doc["settings"]["dtype"] == "float16"
    rows = {r["configuration"]: r for r in doc["rows"]}
    assert set(rows) == {"baseline", "ToMe (ours) r=0.5", "downsample (ours)", "tomesd 0.1.3 r=0.5"}
    assert rows["baseline"]["predicted_speedup"] == 1.0 and rows["baseline"]["tome_own_ms"] == 0.0
    merged = rows["ToMe (ours) r=0.5"]
    assert merged["tome_own_ms"] > 0 and merged["device_ms"] != rows["baseline"]["device_ms"]
    assert merged["flop_speedup"] > 1


@pytest.mark.parametrize("argv, why", [
    (["--predict", "a100"], "no rates for 'a100'; it knows h100, h200"),
    (["--predict", "h100", "--compile"], "--predict traces one eager forward"),
    (["--predict", "h100", "--backend", "paddle"], "--predict traces one eager forward"),
])
def test_bench_predict_refuses_before_running(argv, why, capsys):
    assert bench(["--config", "tiny", "--res", "128"] + argv) != 0
    assert why in capsys.readouterr().err


def _traced_flux(**patch):
    """A tiny Flux at bfloat16 on the meta device, patched, traced: (ToMe's launches, the host's)."""
    import tiny_torch as T
    import tomesd
    from diffusers import FluxTransformer2DModel

    with torch.device("meta"):
        model = FluxTransformer2DModel(**T.FLUX).to(torch.bfloat16)
    inputs = {k: v.to("meta", torch.bfloat16) if v.is_floating_point() else v.to("meta")
              for k, v in T.flux_inputs(h=16, w=16).items()}
    tomesd.apply_patch(model, ratio=0.5, **patch)
    try:
        with torch.no_grad():
            launches = trace(lambda: model(**inputs))
    finally:
        tomesd.remove_patch(model)
    return [l for l in launches if l.own], [l for l in launches if not l.own]


def test_tomes_own_kernels_are_its_merges_and_the_hosts_layers_stay_the_hosts():
    """A host sub-layer ToMe wraps (Flux's proj_mlp, which it seats itself in) launches the host's product, not
    ToMe's; at half precision on an accelerator ToMe's means are products with the merge's matrix (one bmm a
    site beside each block's matching), and scattered as the recorded runs did inside scattered_merges()."""
    from tomesd.backends.torch import scattered_merges

    own, host = _traced_flux(merge_mlp=True)
    blocks = 2 + 2  # tiny Flux: two double blocks, two single blocks; one matching each
    assert {"addmm", "mm"} & {l.op for l in host} and not {"addmm", "mm"} & {l.op for l in own}
    products = sum(l.op == "bmm" for l in own)
    ops = [l.op for l in own]
    # each merge counts its rows once (a 1-D index_add_ of ones): no other scatter adds
    assert products > blocks and "scatter_reduce_" not in ops and ops.count("index_add_") <= blocks
    with scattered_merges():
        own, _ = _traced_flux(merge_mlp=True)
    assert sum(l.op == "bmm" for l in own) == blocks and "scatter_reduce_" in {l.op for l in own}
