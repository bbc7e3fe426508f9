"""The benchmark command on the paddle backend, against ppdiffusers' built-in (tiny config)."""
import argparse
import json

from tomesd.bench.cli import add_arguments, run


def test_tiny_paddle_bench_with_compare(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out_json = tmp_path / "r.json"
    argv = ["--backend", "paddle", "--config", "tiny", "--res", "128", "--ratios", "0.5", "--repeats", "1",
            "--warmup", "0", "--compare", "--json", str(out_json)]
    assert run(parser.parse_args(argv)) == 0
    assert "ppdiffusers built-in r=0.5" in capsys.readouterr().out
    doc = json.loads(out_json.read_text())
    assert doc["reference"] == "ppdiffusers built-in" and "paddle" in doc["machine"]
    rows = {(r["method"], r["ratio"]): r for r in doc["results"]}
    ours, ref = rows[("tome", 0.5)], rows[("reference", 0.5)]
    assert ours["tokens"]["1"] == ref["tokens"]["1"] == [768, 384]  # the built-in really merged
    assert ours["output_change"] > 0 and ref["output_change"] > 0  # each with its own random dst pattern
    assert 0 < ours["tome_fraction"] < 1 and 0 < ref["tome_fraction"] < 1
    assert all(r["peak_mem_bytes"] > 50 * 2**20 for r in rows.values())
