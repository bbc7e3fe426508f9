"""`python -m tomesd tune`: the search picks the setting that is really fastest, prunes, says when nothing
pays, and honours the closeness threshold. Timings are made on purpose (sleeps, or a table), never asserted
of the machine."""
import argparse
import time

import pytest

from tomesd import tune


def run_tune(argv):
    parser = argparse.ArgumentParser()
    tune.add_arguments(parser)
    return tune.run(parser.parse_args(argv))


@pytest.fixture
def slow_on_purpose(monkeypatch):
    """The tiny UNet the tuner builds sleeps `delay(patch args or None)` seconds per forward: the fixture's
    timings dwarf the model's own few milliseconds."""
    from tomesd.bench.kits import TorchKit

    build = TorchKit.build
    state = {"delay": lambda args: 0.0}

    def slow_build(self, *a, **k):
        model = build(self, *a, **k)

        def sleep(module, args):
            patch = module.__dict__.get("_tome_patch")
            time.sleep(state["delay"](None if patch is None else patch.args))

        model.register_forward_pre_hook(sleep)
        return model

    monkeypatch.setattr(TorchKit, "build", slow_build)
    return state


TINY = ["--config", "tiny", "--res", "64", "--repeats", "2", "--budget", "120"]


def test_the_tuner_picks_the_setting_made_fast_and_prunes(slow_on_purpose, capsys):
    """The baseline sleeps 0.2 s per forward, nearest downsampling by 2 sleeps 0.1 s, every other setting 0.3 s:
    the tuner names downsampling by 2, drops each family whose mildest setting gains nothing, stops the
    downsampling family at its first setting that is no faster, and so measures fewer settings than it knows."""
    def delay(args):
        if args is None:
            return 0.2
        return 0.1 if args.mode == "downsample" and args.downsample_method == "nearest" and \
            args.downsample_factor == 2 else 0.3

    slow_on_purpose["delay"] = delay
    assert run_tune(TINY) == 0
    out = capsys.readouterr().out
    assert "fastest here: tomesd.apply_patch(model, mode='downsample', downsample_factor=2)" in out, out
    assert "quality was not priced" in out
    measured = [line for line in out.splitlines() if line.startswith("| ") and "speed-up" not in line]
    total = sum(len(settings) for _, settings in tune.families(transformer=False, loop=False))
    assert len(measured) < total
    assert "| ratio=0.25 |" in out and "| ratio=0.5 |" not in out  # merge gained nothing at 0.25: family dropped


def test_the_tuner_says_when_nothing_pays(slow_on_purpose, capsys):
    slow_on_purpose["delay"] = lambda args: 0.2 if args is None else 0.3  # every setting slower than the baseline
    assert run_tune(TINY) == 0
    out = capsys.readouterr().out
    assert "no setting is faster than the baseline by more than the noise here" in out
    assert "fastest here" not in out


def _table_search(speed, psnr, min_psnr=None, budget=1e9, plan=None, clock=None):
    """search() over a plan with the given speed-ups and PSNRs per setting name (baseline time 1.0)."""
    def time_once(kwargs):
        return 1.0 if kwargs is None else 1.0 / speed[tune.describe(kwargs)]

    plan = plan or [("merge", [dict(ratio=r) for r in (0.25, 0.5, 0.75)]),
                    ("downsample", [dict(mode="downsample", downsample_factor=f) for f in (2, 3)])]
    return tune.search(time_once, (lambda kw: psnr[tune.describe(kw)]) if psnr else None, plan, 2, budget, min_psnr,
                       **({"clock": clock} if clock else {}))


def test_search_stops_a_family_at_its_first_setting_below_the_threshold():
    speed = {"ratio=0.25": 1.2, "ratio=0.5": 1.5, "ratio=0.75": 1.9,
             "mode='downsample', downsample_factor=2": 1.4, "mode='downsample', downsample_factor=3": 1.6}
    psnr = {"ratio=0.25": 35.0, "ratio=0.5": 28.0, "ratio=0.75": 20.0,
            "mode='downsample', downsample_factor=2": 30.0, "mode='downsample', downsample_factor=3": 26.0}
    result = _table_search(speed, psnr, min_psnr=25.0)
    assert [(t.name, t.outcome) for t in result.trials] == [
        ("ratio=0.25", "kept"), ("ratio=0.5", "kept"), ("ratio=0.75", "too far"),
        ("mode='downsample', downsample_factor=2", "kept"), ("mode='downsample', downsample_factor=3", "kept")]
    assert result.best.name == "mode='downsample', downsample_factor=3"  # fastest of those above 25 dB
    text = tune.report(result, "paddle", pipeline=True)
    assert "fastest here: pipe.apply_tome(mode='downsample', downsample_factor=3)  (1.60x, 26.0 dB" in text


def test_search_stops_a_family_that_gets_no_faster_and_respects_the_budget():
    speed = {"ratio=0.25": 1.3, "ratio=0.5": 1.29, "ratio=0.75": 2.0,
             "mode='downsample', downsample_factor=2": 1.1, "mode='downsample', downsample_factor=3": 1.2}
    result = _table_search(speed, None)
    assert [(t.name, t.outcome) for t in result.trials][:2] == [("ratio=0.25", "kept"),
                                                                ("ratio=0.5", "no faster than the milder one")]
    assert "ratio=0.75" not in [t.name for t in result.trials]  # pruned
    ticks = iter(range(100))
    budgeted = _table_search(speed, None, budget=2.5, clock=lambda: next(ticks))
    assert budgeted.budget_hit and len(budgeted.trials) < len(result.trials)
    assert "the time budget ran out" in tune.report(budgeted, "torch", pipeline=False)


@pytest.mark.parametrize("argv,message", [
    (["--min-psnr", "30"], "needs --model"),
    (["--budget", "0"], "--budget must be positive"),
    (["--repeats", "0"], "--repeats must be at least 1"),
    (["--model", "/no/such/folder"], "no model_index.json"),
])
def test_bad_input_gets_a_clear_error(argv, message, capsys):
    assert run_tune(["--config", "tiny"] + argv) == 2
    assert message in capsys.readouterr().err


def test_tune_on_a_local_pipeline_prices_closeness_against_the_floor(tmp_path, monkeypatch, capsys):
    """--model: each setting's images are compared with the unpatched ones from the same noise; the default
    threshold is the floor (the unpatched images from other noise), and the pick is the fastest setting
    above it, as the call on the pipeline. Every UNet call sleeps 0.1 s unless keys are downsampled."""
    import tiny_torch as T
    from tomesd.bench import pipeline as P

    folder = tmp_path / "pipe"
    T.sd_pipeline(tmp_path).save_pretrained(folder)
    load = P.load

    def slow_load(path, kit):
        pipe = load(path, kit)

        def sleep(module, args):
            patch = module.__dict__.get("_tome_patch")
            time.sleep(0.0 if patch is not None and patch.args.mode == "downsample" else 0.1)

        pipe.unet.register_forward_pre_hook(sleep)
        return pipe

    monkeypatch.setattr(P, "load", slow_load)
    prompts = tmp_path / "p.txt"
    prompts.write_text("a cat\na dog\n")
    assert run_tune(["--model", str(folder), "--prompts", str(prompts), "--res", "32", "--steps", "3",
                     "--repeats", "2"]) == 0
    out = capsys.readouterr().out
    floor = float(out.split("lie at ")[1].split(" dB")[0])
    threshold = float(out.split("threshold ")[1].split(" dB")[0])
    assert threshold == floor
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| mode='downsample'")]
    assert rows and all(float(r[2]) > 0 for r in rows if r[3].strip(" |") in ("kept", "too far"))
    assert "fastest here: tomesd.apply_patch(pipe, mode='downsample'" in out
