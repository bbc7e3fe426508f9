"""`python -m tomesd tune`: the search picks the setting that is really fastest, prunes, says when nothing
pays, honours the noise and the closeness threshold, and keeps its budget. Timings are made on purpose, never
asserted of the machine: the command runs on a virtual clock that only a forward's pre-hook advances, by the
seconds the test gives that forward, so every timing is exact whatever the machine's speed or load."""
import argparse
import itertools

import pytest

from tomesd import tune


class VirtualClock:
    """Seconds that pass only when a hook says so: the tuner's timer and its --budget both read it."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def run_tune(argv, delay=lambda args: 1.0, part=lambda model: model):
    """The command on a virtual clock: every forward of `part(model)` (the model the tuner builds, or a part of
    the pipeline it loads) takes `delay(patch args, or None unpatched)` virtual seconds, and nothing else
    does. Returns the exit status."""
    parser = argparse.ArgumentParser()
    tune.add_arguments(parser)
    clock = VirtualClock()

    def on_model(model):
        def advance(module, inputs):
            patch = module.__dict__.get("_tome_patch")
            clock.now += delay(None if patch is None else patch.args)

        part(model).register_forward_pre_hook(advance)

    return tune.run(parser.parse_args(argv), timer=clock, clock=clock, on_model=on_model)


def is_downsample(args, factor, method="nearest"):
    return args.mode == "downsample" and args.downsample_method == method and args.downsample_factor == factor


def table_rows(out):
    """The report's rows as {setting: (speed-up, PSNR, outcome)}, in the order measured."""
    rows = {}
    for line in out.splitlines():
        if line.startswith("| ") and "speed-up" not in line:
            name, speedup, psnr, outcome = line.strip("| ").split(" | ")
            rows[name] = (speedup, psnr, outcome)
    return rows


TINY = ["--config", "tiny", "--res", "64", "--repeats", "2", "--budget", "100000"]
UNET_SETTINGS = sum(len(settings) for _, settings in tune.families(transformer=False, loop=False))


def test_the_tuner_picks_the_setting_made_fast_and_prunes(capsys):
    """The baseline takes 2 s per forward, nearest downsampling by 2 takes 1 s, every other setting 3 s: the
    tuner names downsampling by 2, drops each family whose mildest setting gains nothing, stops the
    downsampling family at its first setting that is no faster, and so measures fewer settings than it knows."""
    def delay(args):
        if args is None:
            return 2.0
        return 1.0 if is_downsample(args, 2) else 3.0

    assert run_tune(TINY, delay) == 0
    out = capsys.readouterr().out
    assert "fastest here: tomesd.apply_patch(model, mode='downsample', downsample_factor=2)  (2.00x" in out, out
    assert "quality was not priced" in out
    assert "noise: 0.0%" in out  # the virtual clock is exact
    rows = table_rows(out)
    assert rows == {
        "ratio=0.25": ("0.67x", "-", "no gain"),  # merge gained nothing at 0.25: family dropped
        "ratio=0.5, max_downsample=2": ("0.67x", "-", "no gain"),
        "mode='downsample', downsample_factor=2": ("2.00x", "-", "kept"),
        "mode='downsample', downsample_factor=3": ("0.67x", "-", "no faster than the milder one"),
        "mode='downsample', downsample_method='avg', downsample_factor=2": ("0.67x", "-", "no gain"),
    }, out
    assert len(rows) < UNET_SETTINGS


def test_the_tuner_names_the_fastest_kept_setting_not_the_last(capsys):
    """Three settings are kept, in three families: merging 0.25 (1.33x), merging 0.5 at two levels (4x) and
    downsampling by 2 (2x), measured in that order. The tuner names the 4x one, neither the first nor the
    last kept."""
    def delay(args):
        if args is None:
            return 4.0
        if args.mode == "merge" and args.max_downsample == 2:
            return 1.0
        if args.mode == "merge":
            return 3.0
        return 2.0 if is_downsample(args, 2) or is_downsample(args, 3) else 4.0

    assert run_tune(TINY, delay) == 0
    out = capsys.readouterr().out
    rows = table_rows(out)
    kept = [(name, speedup) for name, (speedup, _, outcome) in rows.items() if outcome == "kept"]
    assert kept == [("ratio=0.25", "1.33x"), ("ratio=0.5, max_downsample=2", "4.00x"),
                    ("mode='downsample', downsample_factor=2", "2.00x")], out
    assert "fastest here: tomesd.apply_patch(model, ratio=0.5, max_downsample=2)  (4.00x" in out, out
    # each family stopped at its first setting no faster than the one before
    assert rows["ratio=0.5"][2] == rows["ratio=0.75, max_downsample=2"][2] == \
        rows["mode='downsample', downsample_factor=3"][2] == "no faster than the milder one", out


def test_the_tuner_says_when_nothing_pays(capsys):
    assert run_tune(TINY, lambda args: 2.0 if args is None else 3.0) == 0  # every setting slower than the baseline
    out = capsys.readouterr().out
    assert "no setting is faster than the baseline by more than the noise here" in out
    assert "fastest here" not in out
    assert {outcome for _, _, outcome in table_rows(out).values()} == {"no gain"}


def test_a_gain_within_the_noise_does_not_count(capsys):
    """The baseline's forwards take 9, 10, 11, 9, ... s (three robust standard deviations: 44% of its median):
    merging 0.25 at 8 s gains 25%, more than MIN_GAIN but within the noise, so the merge family is dropped;
    downsampling by 2 at 4 s (about 2.4x) clears it and is named."""
    baseline = itertools.cycle([9.0, 10.0, 11.0])

    def delay(args):
        if args is None:
            return next(baseline)
        if args.mode == "merge" and args.ratio == 0.25 and args.max_downsample in (None, 1):
            return 8.0
        return 4.0 if is_downsample(args, 2) else 12.0

    assert run_tune(TINY, delay) == 0
    out = capsys.readouterr().out
    noise = float(out.split("noise: ")[1].split("%")[0]) / 100
    assert noise > 0.3, out
    rows = table_rows(out)
    assert 1 + tune.MIN_GAIN < float(rows["ratio=0.25"][0].rstrip("x")) < 1 + noise, out
    assert rows["ratio=0.25"][2] == "no gain", out
    assert "fastest here: tomesd.apply_patch(model, mode='downsample', downsample_factor=2)" in out, out


def test_the_budget_runs_on_the_tuners_clock(capsys):
    """--budget 50 with 10 s baseline forwards and 5 s patched ones, two pairs per setting: the first timing
    ends at 10 s, the first setting at 40 s, the second (no faster: the family stops) at 70 s, past the budget,
    so no further family is tried, however fast the machine really ran."""
    argv = ["--config", "tiny", "--res", "64", "--repeats", "2", "--budget", "50"]
    assert run_tune(argv, lambda args: 10.0 if args is None else 5.0) == 0
    out = capsys.readouterr().out
    assert table_rows(out) == {"ratio=0.25": ("2.00x", "-", "kept"),
                               "ratio=0.5": ("2.00x", "-", "no faster than the milder one")}, out
    assert "the time budget ran out before every family was tried" in out
    assert f"2 of {UNET_SETTINGS} settings measured" in out


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


def test_tune_on_a_local_pipeline_prices_closeness_against_the_floor(tmp_path, capsys):
    """--model: each setting's images are compared with the unpatched ones from the same noise; the default
    threshold is the floor (the unpatched images from other noise), and the pick is the fastest setting
    above it, as the call on the pipeline. Every UNet call takes 2 s, 1 s when keys are downsampled."""
    import tiny_torch as T

    folder = tmp_path / "pipe"
    T.sd_pipeline(tmp_path).save_pretrained(folder)
    prompts = tmp_path / "p.txt"
    prompts.write_text("a cat\na dog\n")
    argv = ["--model", str(folder), "--prompts", str(prompts), "--res", "32", "--steps", "3", "--repeats", "2"]
    assert run_tune(argv, lambda args: 1.0 if args is not None and args.mode == "downsample" else 2.0,
                    part=lambda pipe: pipe.unet) == 0
    out = capsys.readouterr().out
    floor = float(out.split("lie at ")[1].split(" dB")[0])
    threshold = float(out.split("threshold ")[1].split(" dB")[0])
    assert threshold == floor
    assert "noise: 0.0%" in out
    rows = table_rows(out)
    downsampled = {name: row for name, row in rows.items() if name.startswith("mode='downsample'")}
    assert downsampled and all(float(psnr) > 0 for _, psnr, outcome in downsampled.values()
                               if outcome in ("kept", "too far")), out
    for speedup, psnr, outcome in rows.values():  # the threshold decides, once a setting is faster
        if outcome == "kept":
            assert float(psnr) >= threshold and speedup == "2.00x", out
        if outcome == "too far":
            assert float(psnr) < threshold, out
    assert "fastest here: tomesd.apply_patch(pipe, mode='downsample'" in out


def test_on_a_gpu_the_frontiers_pick_is_tried_first(monkeypatch, capsys):
    """--device cuda (the kit made on the CPU here): the setting frontier.GPU_PICKS lists for the model and size is
    measured before every family and named when it is the fastest; a setting that reuses matches is timed over one
    window of its steps, per forward. On the CPU it is not tried. The baseline takes 2 s per forward, the pick 1 s,
    every other setting 3 s: the families' mild first settings lose, as eager ToMe's do on a GPU."""
    from tomesd import frontier
    from tomesd.bench.kits import pick as kits

    made = kits.make_kit
    monkeypatch.setattr(kits, "make_kit", lambda backend, device, dtype: made(backend, "cpu", dtype))
    pick = frontier.GpuPick("tiny", (64, 64), None, "ToMe r=0.5 max_downsample=4 reuse 2", dict(
        ratio=0.5, max_downsample=4, reuse_steps=2), 1.5, 40.0, "sd1", "docs/frontier-gpu-tiny.json", 1.45, 1.4)
    monkeypatch.setattr(frontier, "GPU_PICKS", (pick,))
    forwards = []

    def delay(args):
        forwards.append(None if args is None else args.reuse_steps)
        if args is None:
            return 2.0
        return 1.0 if args.reuse_steps == 2 and args.max_downsample == 4 else 3.0

    assert run_tune(TINY + ["--device", "cuda"], delay) == 0
    out = capsys.readouterr().out
    rows = table_rows(out)
    assert list(rows)[0] == "ratio=0.5, max_downsample=4, reuse_steps=2" and \
        rows["ratio=0.5, max_downsample=4, reuse_steps=2"] == ("2.00x", "-", "kept"), out
    assert forwards.count(2) == 2 * 2  # two repeats, each a window of 2 forwards
    assert "on a GPU, tried first: ratio=0.5, max_downsample=4, reuse_steps=2 (1.45x predicted device time on an " \
           "H100, at >= 1.4x; 1.50x FLOPs at 64x64; closest on the sd1 yardstick (40.0 dB)" in out, out
    assert "fastest here: tomesd.apply_patch(model, ratio=0.5, max_downsample=4, reuse_steps=2)  (2.00x" in out, out

    assert run_tune(TINY, delay) == 0  # on the CPU: the families alone
    out = capsys.readouterr().out
    assert "ratio=0.5, max_downsample=4, reuse_steps=2" not in table_rows(out) and "on a GPU" not in out, out

    assert run_tune(["--config", "tiny", "--res", "32", "--repeats", "2", "--device", "cuda"], delay) == 0
    assert "on a GPU: no setting is picked for tiny at 32x32" in capsys.readouterr().out


def test_the_gpu_offer_follows_the_model_and_its_size():
    """The real table: what `tune --device cuda` offers first, per model and size (frontier.GPU_PICKS); a size the
    frontier did not count gets nothing; a pipeline's denoiser names its model."""
    from types import SimpleNamespace as NS

    for arch, res, frames in [("sd1", (1024, 1024), None), ("sdxl", (1024, 1024), None), ("sd3", (1024, 1024), None),
                              ("flux", (1024, 1024), None), ("wan", (480, 832), 81)]:
        pick, line = tune.gpu_first(arch, res, frames)
        assert pick is not None and line.startswith("on a GPU, tried first: "), (arch, line)
        assert pick.predicted_ratio >= pick.goal or (not pick.reached and "nothing reaches" in line), (arch, line)
    assert tune.gpu_first("sd3", (512, 512), None)[0] is None
    assert tune.gpu_first("wan", (480, 832), 33)[0] is None

    class UNet2DConditionModel:
        def __init__(self, embed):
            self.config = NS(addition_embed_type=embed)

    class FluxTransformer2DModel:
        pass

    assert tune.model_key(NS(unet=UNet2DConditionModel("text_time"))) == "sdxl"
    assert tune.model_key(NS(unet=UNet2DConditionModel(None))) == "sd1"
    assert tune.model_key(NS(transformer=FluxTransformer2DModel())) == "flux"
    assert tune.model_key(NS(transformer=object())) is None
