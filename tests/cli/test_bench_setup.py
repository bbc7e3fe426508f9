"""What the benchmark checks and finds before it runs: optional dependencies, the reference's folder;
and the token counting it shares with `python -m tomesd demo`."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tomesd.bench.kits import references
from tomesd.bench.cli import add_arguments, run

TINY = ["--config", "tiny", "--res", "128", "--ratios", "0.5", "--repeats", "1", "--warmup", "0", "--no-memory"]


def bench(argv):
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return run(parser.parse_args(argv))


@pytest.fixture
def forwards(monkeypatch):
    """Every UNet the benchmark builds and every forward it runs, recorded ("forward", or "meta forward" for the
    FLOPs count on the meta device)."""
    from tomesd.bench.kits.torch_kit import TorchKit

    seen = []
    build, forward = TorchKit.build, TorchKit.forward
    monkeypatch.setattr(TorchKit, "build", lambda self, *a: (seen.append("build"), build(self, *a))[1])
    monkeypatch.setattr(TorchKit, "forward", lambda self, *a: (
        seen.append("meta forward" if self.device.type == "meta" else "forward"), forward(self, *a))[1])
    return seen


@pytest.mark.parametrize(
    "module,argv,message",
    [
        ("matplotlib", ["--plot", "{tmp}/p.png"], "--plot needs matplotlib"),
        ("PIL", ["--model", "{tmp}"], "--model (for its image grid) needs pillow"),
    ],
)
def test_missing_optional_dependency_fails_before_any_work(module, argv, message, tmp_path, monkeypatch, capsys, forwards):
    monkeypatch.setitem(sys.modules, module, None)  # `import module` now raises ImportError
    assert bench(TINY + [a.format(tmp=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "pip install 'tomesd[bench]'" in err
    assert forwards == []  # nothing was built, nothing ran


def test_runs_without_tqdm(tmp_path, monkeypatch, capsys, forwards):
    """The progress bar is optional (diffusers itself needs tqdm, so it is imported first)."""
    from diffusers import UNet2DConditionModel  # noqa: F401

    monkeypatch.setitem(sys.modules, "tqdm", None)
    out_json = tmp_path / "r.json"
    assert bench(TINY + ["--json", str(out_json)]) == 0
    rows = json.loads(out_json.read_text())["results"]
    # the default run: the baseline, ToMe at the one ratio given, and downsampling
    assert [(r["method"], r["mode"]) for r in rows] == [("baseline", "merge"), ("tome", "merge"), ("tome", "downsample")]
    # per configuration: one timed forward, one measured, three counting its host work (a warm-up, the launches, the
    # Python calls), and one more observing the blocks ToMe's two configurations reduce ...
    assert forwards.count("forward") == 3 * 2 + 3 * 3 + 2
    assert forwards.count("meta forward") == 3  # ... and one FLOPs count on the meta device


def _fake_reference(refs: Path, where: str) -> None:
    package = refs / "tomesd-0.1.3" / "tomesd"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(f"WHERE = {where!r}\n")


def test_reference_lookup_order(tmp_path, monkeypatch):
    env, cwd, checkout = tmp_path / "env", tmp_path / "cwd", tmp_path / "checkout" / ".refs"
    for folder in (env, cwd, checkout):
        folder.mkdir(parents=True)
    monkeypatch.setattr(references, "_CHECKOUT_REFS", checkout)
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("TOME_REFS_DIR", str(env))

    with pytest.raises(RuntimeError) as missing:
        references.find_tomesd_ref()
    message = str(missing.value)
    places = [str(env / "tomesd-0.1.3"), str(cwd / ".refs" / "tomesd-0.1.3"), str(checkout / "tomesd-0.1.3")]
    assert all(place in message for place in places), message
    assert [message.index(place) for place in places] == sorted(message.index(place) for place in places)
    assert "TOME_REFS_DIR" in message and "pip install" in message

    init = ("tomesd-0.1.3", "tomesd", "__init__.py")
    _fake_reference(checkout, "checkout")
    assert references.find_tomesd_ref() == checkout.joinpath(*init)
    _fake_reference(cwd / ".refs", "cwd")
    assert references.find_tomesd_ref() == (cwd / ".refs").joinpath(*init)
    _fake_reference(env, "env")
    assert references.find_tomesd_ref() == env.joinpath(*init)
    monkeypatch.setenv("TOME_REFS_DIR", str(tmp_path / "empty"))  # set, but holding nothing: the next place
    assert references.find_tomesd_ref() == (cwd / ".refs").joinpath(*init)
    monkeypatch.delenv("TOME_REFS_DIR")
    assert references.find_tomesd_ref() == (cwd / ".refs").joinpath(*init)


def test_reference_is_loaded_from_the_working_directory(tmp_path):
    """As from an installed wheel: no TOME_REFS_DIR, the reference under ./.refs."""
    _fake_reference(tmp_path / ".refs", "cwd")
    env = {k: v for k, v in os.environ.items() if k != "TOME_REFS_DIR"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")])
    code = "from tomesd.bench.kits.references import load_tomesd_ref; print(load_tomesd_ref().WHERE)"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "cwd"


def test_demo_counts_merged_tokens_per_block(capsys):
    from tomesd.cli import main

    main(["demo", "--config", "tiny", "--res", "128", "--ratio", "0.5"])
    lines = capsys.readouterr().out.splitlines()
    blocks = [line.split() for line in lines if "transformer_blocks" in line]
    # tiny: level 1 (16x16 tokens) in down_blocks.0 and up_blocks.1 (3 blocks), level 2 (8x8) in the mid block
    assert [(b[1], b[3]) for b in blocks if b[0].startswith(("down_blocks.0", "up_blocks.1"))] == [("256", "128")] * 3
    assert [(b[1], b[3]) for b in blocks if b[0].startswith("mid_block")] == [("64", "64")]
    assert sum("merged 128 (50%)" in line for line in lines) == 3
