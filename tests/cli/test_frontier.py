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

    from tomesd.bench.measures.runner import Settings
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


def test_what_pays_on_a_gpu_is_the_closest_setting_at_the_flops_floor():
    """Of the points whose FLOPs ratio reaches the floor (1.4x: the GPU's proxy; a point exactly on it counts), the one
    with the highest PSNR: neither the closest overall (below the floor), nor the fastest, nor one whose closeness
    was never measured. Of equal PSNRs, the larger FLOPs ratio. Without a yardstick, the mildest at the floor."""
    from tomesd.frontier import FLOPS_FLOOR, closest_paying, gpu_pick, mildest_paying

    points = [dict(name="closest overall", flop_ratio=1.2, psnr=60.0),
              dict(name="paying", flop_ratio=1.45, psnr=40.0),
              dict(name="fastest", flop_ratio=2.5, psnr=20.0),
              dict(name="on the floor", flop_ratio=1.4, psnr=45.0),
              dict(name="unmeasured", flop_ratio=1.6, psnr=None),
              dict(name="uncounted", flop_ratio=None, psnr=70.0)]
    assert FLOPS_FLOOR == 1.4
    assert closest_paying(points)["name"] == "on the floor"
    assert closest_paying(points, 1.5)["name"] == "fastest"
    assert closest_paying(points, 3.0) is None
    tied = points + [dict(name="as close, faster", flop_ratio=1.7, psnr=45.0)]
    assert closest_paying(tied)["name"] == "as close, faster"
    assert mildest_paying(points)["name"] == "on the floor" and mildest_paying(points, 1.41)["name"] == "paying"
    assert gpu_pick(points, yardstick=False) == (points[3], "mildest at >= 1.4x FLOPs (no yardstick)")
    assert gpu_pick(points)[1] == "closest at >= 1.4x FLOPs"


def test_the_frontier_marks_what_pays_on_a_gpu(tmp_path, capsys):
    """`--flops-floor` sets the floor; the closest setting at it is marked in the table, named below it with its
    PSNR and the closeness file it came from (of two files, the later one's row), and recorded in the JSON; with
    `--closeness none` nothing has a PSNR and the mildest setting at the floor is marked instead. On the tiny SD3 at
    128² r=0.5 leaves 1.38x of the compute, r=0.75 1.64x, r=0.5 with restored tokens 1.18x: the floor is 1.3x."""
    older, newer, out = tmp_path / "old.json", tmp_path / "new.json", tmp_path / "f.json"
    names = ["ToMe r=0.5", "ToMe r=0.75", "ToMe r=0.5 reuse 3 prop restore"]
    older.write_text(json.dumps({"arch": "sd3", "results": [{"name": names[0], "psnr": 50.0},
                                                            {"name": names[1], "psnr": 30.0}]}))
    newer.write_text(json.dumps({"arch": "sd3", "results": [{"name": names[0], "psnr": 22.0},
                                                            {"name": names[2], "psnr": 45.0}]}))
    common = ["frontier", "--arch", "sd3", "--only", ",".join(names), "--config", "tiny-sd3", "--res", "128",
              "--flops-only", "--flops-floor", "1.3", "--json", str(out), "--plot", ""]
    with pytest.raises(SystemExit) as done:
        main(common + ["--closeness", f"{older},{newer}"])
    assert done.value.code == 0
    doc, text = json.loads(out.read_text()), capsys.readouterr().out
    points = {p["name"]: p for p in doc["points"]}
    assert points[names[0]]["psnr"] == 22.0 and points[names[0]]["closeness_source"] == "new.json"
    assert points[names[2]]["flop_ratio"] < 1.3 < points[names[0]]["flop_ratio"] < points[names[1]]["flop_ratio"]
    assert doc["gpu_pick"] == {"name": names[1], "rule": "closest at >= 1.3x FLOPs"}
    assert [name for name, p in points.items() if p["gpu_pick"]] == [names[1]]
    assert f"| {names[1]} | - |" in text and "| 30.0 | yes; closest at >= 1.3x FLOPs |" in text
    assert f"closest at >= 1.3x FLOPs: {names[1]} (1.6" in text and "30.0 dB (old.json)" in text

    with pytest.raises(SystemExit) as done:
        main(common + ["--closeness", "none"])
    assert done.value.code == 0
    doc, text = json.loads(out.read_text()), capsys.readouterr().out
    assert all(p["psnr"] is None for p in doc["points"])
    assert doc["gpu_pick"] == {"name": names[0], "rule": "mildest at >= 1.3x FLOPs (no yardstick)"}
    assert "no yardstick prices" in text


def test_the_gpu_picks_are_the_device_time_picks_of_the_docs_frontier_runs():
    """Each entry of GPU_PICKS (what `tune --device cuda` tries first, what tomesd.recommend returns) is a setting of
    its frontier run in docs/, with that run's FLOPs ratio and the yardstick's PSNR; its predicted device-time ratio
    reaches its goal and it is the closest that does (the mildest with no yardstick), or, where none reaches, the
    fastest predicted; frontier.gpu_pick over the priced points by predicted ratio gives it back."""
    import os

    from tomesd.devicetime.picks import GOALS, shipped
    from tomesd.frontier import GPU_PICKS, gpu_pick
    from tomesd.quality.settings import SETTINGS

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert {(p.arch, p.res, p.frames) for p in GPU_PICKS} == {(g.arch, g.res, g.frames) for g in GOALS}
    priced = {m["arch"]: m for m in shipped()["models"]}
    for pick in GPU_PICKS:
        with open(os.path.join(root, pick.counted)) as f:
            doc = json.load(f)
        assert (doc["res"], doc["width"], doc["frames"], doc["depth"]) == (*pick.res, pick.frames, None), pick
        point = {p["name"]: p for p in doc["points"]}[pick.name]
        assert point["kwargs"] == pick.kwargs and round(point["flop_ratio"], 2) == pick.flop_ratio, pick
        points = [p for p in priced[pick.arch]["points"] if "predicted_ratio" in p]
        again, _ = gpu_pick(points, pick.goal, yardstick=pick.yardstick is not None, key="predicted_ratio")
        if pick.reached:
            assert again is not None and again["name"] == pick.name and pick.predicted_ratio >= pick.goal, pick
        else:
            assert again is None and pick.predicted_ratio == round(max(p["predicted_ratio"] for p in points), 2)
        if pick.yardstick:
            assert pick.kwargs == {s.name: s.kwargs for s in SETTINGS[pick.yardstick]}[pick.name], pick
