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
