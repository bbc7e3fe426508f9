"""The quality yardstick discriminates: a broken merge and an untrained model score clearly worse.

Runs on the shipped weights (tomesd/quality/weights), small sample counts, few steps."""
import json

import pytest
import torch

from tome_core.matching import TokenMerge
from tomesd.quality import model as M
from tomesd.quality import yardstick as Y

EXACT = Y.Setting("ToMe r=0.5", dict(ratio=0.5))
SMALL = dict(images=40, chunk=20, steps=8, noise_seeds=2)


@pytest.fixture(scope="module")
def trained():
    return M.load()


def scores(report, name):
    return next(r for r in report["results"] if r.name == name)


def test_trained_baseline_draws_the_digits_it_is_asked_for(trained):
    report = Y.evaluate([Y.DEFAULT_SETTINGS[0], EXACT], models=trained, **SMALL)
    base = scores(report, "baseline")
    assert base.accuracy >= 0.8, base
    exact = scores(report, EXACT.name)
    assert exact.psnr > report["noise_band"]["unrelated"]["psnr"] + 5  # far closer than an unrelated sample


# Every attention level: the digits UNet leans little on its 32x32 attention (see the README), so a
# merge broken there alone moves samples little; across all levels it must show.
ALL_LEVELS = Y.Setting("ToMe r=0.5 max_downsample=4", dict(ratio=0.5, max_downsample=4))


def test_a_broken_merge_scores_clearly_worse_than_exact_tome(trained, monkeypatch):
    exact = scores(Y.evaluate([Y.DEFAULT_SETTINGS[0], ALL_LEVELS], models=trained, **SMALL), ALL_LEVELS.name)
    unmerge = TokenMerge.unmerge
    perms = {}

    def shuffled(self, x):  # every token gets some other token's output
        out = unmerge(self, x)
        n = out.shape[1]
        perm = perms.setdefault(n, torch.randperm(n, generator=torch.Generator().manual_seed(n)))
        return out[:, perm]

    monkeypatch.setattr(TokenMerge, "unmerge", shuffled)
    broken = scores(Y.evaluate([Y.DEFAULT_SETTINGS[0], ALL_LEVELS], models=trained, **SMALL), ALL_LEVELS.name)
    assert broken.psnr < exact.psnr - 6, (broken, exact)  # far from the baseline's samples
    assert broken.ssim < exact.ssim - 0.1, (broken, exact)
    assert broken.fd > 1.5 * exact.fd, (broken, exact)  # and from the real digits
    assert broken.accuracy <= exact.accuracy


def test_an_untrained_model_scores_near_chance(trained):
    untrained = M.build()
    torch.manual_seed(0)
    for module in untrained:
        module.eval()
    models = (untrained[0], untrained[1], trained[2])  # the trained classifier judges it
    base = scores(Y.evaluate([Y.DEFAULT_SETTINGS[0]], models=models, **SMALL), "baseline")
    good = scores(Y.evaluate([Y.DEFAULT_SETTINGS[0]], models=trained, **SMALL), "baseline")
    assert base.accuracy <= 0.3, base
    assert base.fd > 3 * good.fd, (base, good)


def test_quality_command_writes_table_json_and_plot(tmp_path, capsys):
    from tomesd.cli import main

    out_json, out_png = tmp_path / "q.json", tmp_path / "q.png"
    with pytest.raises(SystemExit) as done:
        main(["quality", "--images", "10", "--chunk", "10", "--steps", "2", "--noise-seeds", "2",
              "--only", "ToMe r=0.5,downsample f=2 nearest", "--json", str(out_json), "--plot", str(out_png)])
    assert done.value.code == 0
    printed = capsys.readouterr().out
    assert "| downsample f=2 nearest |" in printed and "noise band" in printed
    doc = json.loads(out_json.read_text())
    assert doc["schema"] == Y.SCHEMA and [r["name"] for r in doc["results"]] == [
        "baseline", "ToMe r=0.5", "downsample f=2 nearest"]
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv,message", [(["--only", "nope"], "unknown settings"),
                                           (["--noise-seeds", "1"], "at least 2"),
                                           (["--weights", "/no/such.safetensors"], "python -m tomesd.quality.train")])
def test_quality_command_refuses_bad_input(argv, message, capsys):
    from tomesd.cli import main

    with pytest.raises(SystemExit) as done:
        main(["quality"] + argv)
    assert done.value.code == 2 and message in capsys.readouterr().err
