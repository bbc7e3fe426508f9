"""`tomesd bench --compile`: one compiled UNet per configuration, compile time reported apart.
aot_eager keeps it quick; no timings are asserted."""
import json

from tomesd.bench.cli import add_arguments, run
from tomesd.bench.measures.report import SCHEMA


def bench(argv):
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return run(parser.parse_args(argv))


def test_compiled_bench_reports_compile_time_per_configuration(tmp_path, capsys):
    out_json = tmp_path / "r.json"
    argv = ["--config", "tiny", "--res", "128", "--compile", "--compile-backend", "aot_eager", "--repeats", "1",
            "--warmup", "0", "--no-memory", "--ratios", "0.5", "--compare", "--json", str(out_json)]
    assert bench(argv) == 0
    printed = capsys.readouterr().out
    assert "first call, compiling (s)" in printed

    doc = json.loads(out_json.read_text())
    assert doc["schema"] == SCHEMA
    assert doc["settings"]["compile"] is True and doc["settings"]["compile_backend"] == "aot_eager"
    rows = {(r["method"], r["ratio"]): r for r in doc["results"]}
    assert {("baseline", None), ("tome", 0.5)} <= set(rows)
    if ("reference", 0.5) not in rows:  # tomesd 0.1.3's patch may not compile into one graph: said so
        assert "note: tomesd 0.1.3 left out" in printed and any("tomesd 0.1.3 left out" in n for n in doc["notes"])
    for row in rows.values():
        assert row["compile_s"] > 0 and len(row["times_s"]) == 1 and row["time_s"] > 0
        # each compiled model computes what its configuration computes eagerly (no graph served to another)
        assert row["compiled_vs_eager"] < 1e-4
        assert row["tome_time_s"] is None and row["tome_fraction"] is None
    ours = rows[("tome", 0.5)]
    assert ours["tokens"]["1"] == [768, 384] and ours["output_change"] > 0.01


def test_eager_rows_have_no_compile_time(tmp_path):
    out_json = tmp_path / "r.json"
    argv = ["--config", "tiny", "--res", "64", "--repeats", "1", "--warmup", "0", "--no-memory", "--ratios", "0.5",
            "--json", str(out_json)]
    assert bench(argv) == 0
    doc = json.loads(out_json.read_text())
    assert doc["settings"]["compile"] is False
    assert all(r["compile_s"] is None and r["compiled_vs_eager"] is None for r in doc["results"])
    assert all(r["tome_time_s"] is not None for r in doc["results"])


def test_regionally_compiled_bench_runs_each_configuration_as_compiled(tmp_path, capsys):
    """--compile-regional: the repeated blocks of each configuration's copy compiled on their own, equal to its eager
    forward (the blocks' shared code serves no configuration another's graph)."""
    out_json = tmp_path / "r.json"
    argv = ["--config", "tiny", "--res", "128", "--compile", "--compile-regional", "--compile-backend", "aot_eager",
            "--repeats", "1", "--warmup", "0", "--no-memory", "--ratios", "0.5", "--modes", "merge,downsample",
            "--json", str(out_json)]
    assert bench(argv) == 0
    assert "compile_repeated_blocks(backend='aot_eager')" in capsys.readouterr().out
    doc = json.loads(out_json.read_text())
    rows = {(r["method"], r["ratio"]): r for r in doc["results"]}
    assert {("baseline", None), ("tome", 0.5), ("tome", None)} <= set(rows)  # ("tome", None): mode="downsample"
    for row in rows.values():
        assert row["compile_s"] > 0 and row["compiled_vs_eager"] < 1e-4
    assert rows[("tome", 0.5)]["output_change"] > 0.01 and rows[("tome", None)]["output_change"] > 0.01
