"""`python -m tomesd frontier`: one command from settings to the closeness-speed plane. On the SD3 yardstick with a
few samples and the tiny SD3 timed: each point carries the quality run's PSNR and the bench's speed-up and FLOPs
ratio, and the front is the set no point beats on both."""
import json

import pytest

from tomesd.cli import main
from tomesd.frontier import pareto

ONLY = "ToMe r=0.5,ToMe r=0.5 reuse 3 prop restore,downsample f=2 nearest"


def test_frontier_joins_closeness_and_speed_and_marks_the_front(tmp_path, capsys):
    out = tmp_path / "f.json"
    with pytest.raises(SystemExit) as done:
        main(["frontier", "--arch", "sd3", "--only", ONLY, "--images", "2", "--noise-seeds", "2", "--sampling-steps", "3",
              "--config",
              "tiny-sd3", "--res", "128", "--steps", "3", "--repeats", "1", "--warmup", "0", "--json", str(out),
              "--plot", str(tmp_path / "f.png")])
    assert done.value.code == 0
    doc = json.loads(out.read_text())
    closeness = {r["name"]: r for r in json.loads((tmp_path / "f-closeness.json").read_text())["results"]}
    points = {p["name"]: p for p in doc["points"]}
    assert set(points) == set(ONLY.split(","))
    for name, point in points.items():
        assert point["psnr"] == closeness[name]["psnr"] and point["speedup"] > 0
    merged, restored = points["ToMe r=0.5"]["flop_ratio"], points["ToMe r=0.5 reuse 3 prop restore"]["flop_ratio"]
    assert merged > 1 and 1 < restored < merged  # one call in three runs unmerged
    assert [p["name"] for p in doc["points"] if p["front"]] and \
        {p["name"] for p in doc["points"] if p["front"]} == set(pareto(doc["points"]))
    assert (tmp_path / "f.png").read_bytes()[:4] == b"\x89PNG"
    assert "| setting | speed-up | FLOPs ratio | PSNR (dB) | on the front |" in capsys.readouterr().out


def test_the_front_is_what_no_point_beats_on_both():
    points = [dict(name="a", speedup=1.0, psnr=40.0), dict(name="b", speedup=1.5, psnr=30.0),
              dict(name="c", speedup=1.4, psnr=29.0), dict(name="d", speedup=2.0, psnr=20.0),
              dict(name="e", speedup=1.5, psnr=30.0 - 1e-9), dict(name="f", speedup=3.0, psnr=None)]
    assert pareto(points) == ["a", "b", "d"]


def test_closeness_from_another_yardstick_is_refused(tmp_path, capsys):
    path = tmp_path / "q.json"
    path.write_text(json.dumps({"arch": "wan", "results": []}))
    with pytest.raises(SystemExit) as done:
        main(["frontier", "--arch", "sd3", "--closeness", str(path), "--config", "tiny-sd3"])
    assert done.value.code == 2 and "prices the wan yardstick, not sd3" in capsys.readouterr().err


def test_downsample_restore_counts_what_its_first_step_runs_again():
    """A restoring window's first step runs every key and then each downsampled attention again: the whole module
    where it downsamples before projecting (SD3), the attention's products alone at the dispatch (Flux, Wan); an
    attention downsampling left as it was is not run again."""
    import torch

    from tomesd.bench.runner import Settings
    from tomesd.frontier import _flops, _rerun, config_of
    from tomesd.quality.settings import SETTINGS

    addmm, bmm = torch.ops.aten.addmm, torch.ops.aten.bmm
    counts = {"m.attn": {addmm: 10, bmm: 5}, "m.kept": {addmm: 7}}
    base = {"m.attn": {addmm: 10, bmm: 20}, "m.kept": {addmm: 7}}
    assert _rerun(counts, base, [("m.attn", "projections"), ("m.kept", "projections")]) == 15
    assert _rerun(counts, base, [("m.attn", "dispatch")]) == 5
    bench = Settings(config="tiny-sd3", depth=None, res=128, batch=1, ratios=(), steps=6, repeats=1, warmup=0,
                     device="cpu", dtype="float32")
    picked = {s.name: s for s in SETTINGS["sd3"]}
    plain, restored = _flops(bench, [config_of(picked["downsample f=2 avg prop"]),
                                     config_of(picked["downsample f=2 avg prop reuse 3 restore"])], [])
    assert plain > 1 and restored < 3 / (1 + 2 / plain)  # more than one unreduced step in three costs


def test_flops_only_times_nothing_and_fronts_on_the_flops_ratio(tmp_path, capsys):
    closeness, out = tmp_path / "q.json", tmp_path / "f.json"
    names = ["ToMe r=0.5", "downsample f=2 avg prop reuse 3 restore"]
    closeness.write_text(json.dumps({"arch": "sd3", "results": [{"name": names[0], "psnr": 22.0},
                                                                {"name": names[1], "psnr": 40.0}]}))
    with pytest.raises(SystemExit) as done:
        main(["frontier", "--arch", "sd3", "--closeness", str(closeness), "--only", ",".join(names), "--config",
              "tiny-sd3", "--res", "128", "--width", "64", "--flops-only", "--json", str(out),
              "--plot", str(tmp_path / "f.png")])
    assert done.value.code == 0
    doc = json.loads(out.read_text())
    assert doc["baseline_time_s"] is None and doc["width"] == 64
    assert all(p["speedup"] is None and p["time_s"] is None and p["flop_ratio"] > 0 for p in doc["points"])
    assert {p["name"] for p in doc["points"] if p["front"]} == set(pareto(doc["points"], "flop_ratio")) != set()
    assert "timing" not in capsys.readouterr().err and (tmp_path / "f.png").read_bytes()[:4] == b"\x89PNG"
