"""`bench --preset gpu`: its runs' arguments are valid bench calls, the tiny configurations run through the
real bench into JSON and one markdown table, and the budget is kept by a virtual clock."""
import argparse
import json

import pytest

from tomesd.bench import cli, gpu_report


def parser():
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    return p


def test_every_run_is_a_valid_bench_call_full_and_tiny():
    titles = [e.title for e in gpu_report.entries()]
    assert len(set(titles)) == len(titles)
    for need in ("SD1.5 512²", "SD1.5 1024²", "SD1.5 2048²", "SDXL 1024²", "SD3 1024²", "Wan 480x832, 17 frames"):
        assert need in titles
    assert any(t.startswith("Flux 1024² (depth") for t in titles)
    assert {e.args[e.args.index("--cache") + 1] for e in gpu_report.entries() if "--cache" in e.args} == {
        "taylorseer", "fbc", "magcache", "pab", "fastercache"}
    for entry in gpu_report.entries():
        full = parser().parse_args(list(entry.args))
        assert full.dtype in ("float16", "bfloat16")
        tiny = parser().parse_args(gpu_report.tiny_args(entry.args))
        assert tiny.config.startswith("tiny") and tiny.dtype == "float32" and tiny.depth is None
        assert tiny.compile == full.compile and tiny.cache == full.cache and tiny.compare == full.compare


def test_the_full_preset_needs_a_gpu_device(capsys):
    assert cli.run(parser().parse_args(["--preset", "gpu"])) == 2
    assert "--device cuda" in capsys.readouterr().err


def test_tiny_runs_go_through_the_bench_into_one_table(tmp_path, monkeypatch, capsys):
    """A sample of the runs (a UNet beside tomesd 0.1.3, eager and compiled; Flux with a cache over a loop; Wan), on
    the tiny configurations: each writes its JSON, the report has a row per configuration."""
    chosen = ["SD1.5 512²", "SD1.5 1024² compiled", "Flux 1024² (depth 6) + taylorseer", "Wan 480x832, 17 frames"]
    sample = [e for e in gpu_report.entries() if e.title in chosen]
    monkeypatch.setattr(gpu_report, "entries", lambda: sample)
    code = cli.run(parser().parse_args(["--preset", "gpu", "--preset-config", "tiny", "--out", str(tmp_path)]))
    assert code == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert [r["title"] for r in report["runs"]] == [e.title for e in sample] and all(r["status"] == "ok" for r in report["runs"])
    table = (tmp_path / "report.md").read_text()
    assert "| SD1.5 512² | tomesd 0.1.3 r=0.5 |" in table
    assert "| SD1.5 1024² compiled | downsample (ours) |" in table
    assert "| Flux 1024² (depth 6) + taylorseer | ToMe (ours) r=0.5 + taylorseer |" in table
    assert "| Flux 1024² (depth 6) + taylorseer | taylorseer alone |" in table
    assert "| Wan 480x832, 17 frames | baseline |" in table


def test_runs_past_the_budget_are_listed_as_not_run(tmp_path):
    """A virtual clock: each run takes 100 s, the budget is 250 s, so three runs start and the rest are
    listed; a failing run is reported and makes the exit code 1."""
    now = [0.0]
    calls = []

    def bench(argv):
        calls.append(argv)
        now[0] += 100.0
        path = argv[argv.index("--json") + 1]
        if len(calls) == 2:
            return 1
        with open(path, "w") as f:
            json.dump({"machine": {"device": "Fake GPU", "torch": "x"}, "reference": "tomesd 0.1.3", "results": [
                {"method": "baseline", "ratio": None, "time_s": 0.5, "speedup": 1.0, "output_change": 0.0}]}, f)
        return 0

    args = parser().parse_args(["--preset", "gpu", "--device", "cuda", "--out", str(tmp_path), "--budget", "250"])
    code = gpu_report.run(args, bench, clock=lambda: now[0])
    assert code == 1 and len(calls) == 3
    report = json.loads((tmp_path / "report.json").read_text())
    statuses = [r["status"] for r in report["runs"]]
    assert statuses[:3] == ["ok", "failed (exit 1)", "ok"]
    assert all(s.startswith("not run") for s in statuses[3:]) and len(statuses) == len(gpu_report.entries())
    table = (tmp_path / "report.md").read_text()
    assert "on Fake GPU, torch x; 300 s of a 250 s budget" in table and "| 500.0 | 1.00x |" in table
