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
        assert tiny.compile_mode is None and (tiny.compile_backend == "eager") == full.compile
    modes = {parser().parse_args(list(e.args)).compile_mode for e in gpu_report.entries()}
    assert "reduce-overhead" in modes  # CUDA-graph replay on at least one model


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
    assert "| SD1.5 1024² compiled | ToMe (ours) r=0.5 | " in table and "| SD1.5 1024² compiled | baseline |" in table
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
    assert "on Fake GPU, torch x; 300 s of a 250 s budget" in table and "| 500.0 | - | 1.00x |" in table


def _fake_bench(now, calls, fail=(), raise_at=()):
    def bench(argv):
        calls.append(argv)
        now[0] += 100.0
        if len(calls) in raise_at:
            raise RuntimeError("CUDA out of memory\nmore")
        if len(calls) in fail:
            return 1
        with open(argv[argv.index("--json") + 1], "w") as f:
            json.dump({"machine": {"device": "Fake GPU", "torch": "x"}, "reference": "tomesd 0.1.3", "results": [
                {"method": "baseline", "ratio": None, "time_s": 0.5, "speedup": 1.0, "output_change": 0.0}]}, f)
        return 0

    return bench


def test_a_run_that_raises_is_reported_and_the_next_runs_on_a_released_gpu(tmp_path):
    now, calls, released = [0.0], [], []
    args = parser().parse_args(["--preset", "gpu", "--device", "cuda", "--out", str(tmp_path), "--budget", "250"])
    code = gpu_report.run(args, _fake_bench(now, calls, raise_at=(1,)), clock=lambda: now[0],
                          between=lambda: released.append(len(calls)))
    assert code == 1 and len(calls) == 3 and released == [1, 2, 3]
    runs = json.loads((tmp_path / "report.json").read_text())["runs"]
    assert runs[0]["status"] == "failed: RuntimeError: CUDA out of memory" and "Traceback" in runs[0]["traceback"]
    assert [r["status"] for r in runs[1:3]] == ["ok", "ok"]


def test_the_report_is_written_after_every_run(tmp_path):
    """Cut short while the second run's GPU is released (the process killed), the report on disk holds the
    first run and lists the rest as not reached."""
    now, calls = [0.0], []
    args = parser().parse_args(["--preset", "gpu", "--device", "cuda", "--out", str(tmp_path), "--budget", "1e9"])

    def killed_after_two():
        if len(calls) == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        gpu_report.run(args, _fake_bench(now, calls), clock=lambda: now[0], between=killed_after_two)
    runs = json.loads((tmp_path / "report.json").read_text())["runs"]
    assert [r["status"] for r in runs[:1]] == ["ok"] and len(runs) == len(gpu_report.entries())
    assert all(r["status"] == "pending: not reached" for r in runs[1:])
    assert "| SD1.5 1024² | pending: not reached |" in (tmp_path / "report.md").read_text()


def test_a_run_too_long_for_what_is_left_is_skipped_and_cheaper_ones_still_go(tmp_path, monkeypatch):
    now, calls = [0.0], []
    sample = [gpu_report.Entry("cheap", ("--arch", "sd1"), 10), gpu_report.Entry("dear", ("--arch", "sdxl"), 500),
              gpu_report.Entry("cheap too", ("--arch", "sd3"), 50)]
    monkeypatch.setattr(gpu_report, "entries", lambda: sample)
    args = parser().parse_args(["--preset", "gpu", "--device", "cuda", "--out", str(tmp_path), "--budget", "300"])
    gpu_report.run(args, _fake_bench(now, calls), clock=lambda: now[0], between=lambda: None)
    assert [c[1] for c in calls] == ["sd1", "sd3"]
    runs = json.loads((tmp_path / "report.json").read_text())["runs"]
    assert runs[1]["status"].startswith("not run: it would pass the 300 s budget (100 s spent, about 500 s more)")


def test_only_reruns_the_named_runs_and_refuses_unknown_names(tmp_path, capsys):
    now, calls = [0.0], []
    names = "sd1-5-1024-compiled,wan-480x832-compiled"
    args = parser().parse_args(["--preset", "gpu", "--device", "cuda", "--out", str(tmp_path), "--only", names,
                                "--budget", "1e9"])
    gpu_report.run(args, _fake_bench(now, calls), clock=lambda: now[0], between=lambda: None)
    assert [c[1] for c in calls] == ["sd1", "wan"] and all("--compile" in c for c in calls)
    assert sorted(p.name for p in tmp_path.glob("[0-9]*.json"))[0].endswith("-sd1-5-1024-compiled.json")
    code = cli.run(parser().parse_args(["--preset", "gpu", "--device", "cuda", "--only", "sd1-5-1024,nope"]))
    assert code == 2 and "nope is not a run of the preset; the runs are: sd1-5-512," in capsys.readouterr().err


def test_profile_lists_the_ops_of_the_baseline_and_of_tome(tmp_path, monkeypatch):
    """--profile: one profiled forward per configuration; ToMe's forward runs the sort its matching needs,
    the baseline's none."""
    from tomesd.bench.measures import profiling

    monkeypatch.setattr(profiling, "TOP", 10_000)  # every op kept: the sort is cheap at this size
    path = tmp_path / "p.json"
    argv = ["--config", "tiny", "--res", "64", "--repeats", "1", "--warmup", "0", "--ratios", "0.5", "--no-memory",
            "--modes", "merge", "--profile", "--json", str(path)]
    assert cli.run(parser().parse_args(argv)) == 0
    profile = json.loads(path.read_text())["profile"]
    assert set(profile) == {"baseline", "ToMe (ours) r=0.5"}
    ops = {name: {op["op"] for op in p["ops"]} for name, p in profile.items()}
    assert all(p["clock"] == "host" and p["total_ms"] > 0 for p in profile.values())
    assert "aten::sort" in ops["ToMe (ours) r=0.5"] and "aten::sort" not in ops["baseline"]
    assert any("conv" in op for op in ops["baseline"])
    assert "| all ops |" in "\n".join(profiling.markdown("tiny", profile))


@pytest.mark.parametrize("extra, message", [
    (["--compile-mode", "reduce-overhead"], "--compile-mode goes with --compile"),
    (["--compile", "--compile-mode", "reduce-overhead"], "it needs --device cuda"),
    (["--compile", "--compile-backend", "eager", "--compile-mode", "default"], "has no modes"),
    (["--compile", "--profile"], "--profile times eager torch forwards"),
])
def test_compile_mode_and_profile_refusals(extra, message, capsys):
    assert cli.run(parser().parse_args(["--config", "tiny", "--res", "64", *extra])) == 2
    assert message in capsys.readouterr().err
