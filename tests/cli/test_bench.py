"""The benchmark command's plumbing on a tiny config: arguments, JSON, plot, errors. No timings
are asserted: speed is measured by the benchmark, not by tests."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from tomesd.bench.cli import add_arguments, run
from tomesd.bench.measures.report import SCHEMA


def bench(argv):
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return run(parser.parse_args(argv))


TINY = ["--config", "tiny", "--res", "128", "--repeats", "2", "--warmup", "1"]


def test_tiny_bench_with_compare_writes_table_json_and_plot(tmp_path, capsys):
    out_json, out_png = tmp_path / "r.json", tmp_path / "p.png"
    assert bench(TINY + ["--ratios", "0.3,0.5", "--compare", "--json", str(out_json), "--plot", str(out_png)]) == 0
    printed = capsys.readouterr().out
    assert "| baseline |" in printed and "ToMe (ours) r=0.5" in printed and "tomesd 0.1.3 r=0.3" in printed
    assert "| downsample (ours) |" in printed  # the default run shows both modes
    assert printed.count("paid most here: ") == 1

    doc = json.loads(out_json.read_text())
    assert doc["schema"] == SCHEMA and doc["reference"] == "tomesd 0.1.3"
    assert doc["settings"]["ratios"] == [0.3, 0.5] and doc["settings"]["compare"] is True
    assert {"platform", "cpus", "torch", "device"} <= set(doc["machine"])
    rows = {(r["method"], r["ratio"]): r for r in doc["results"]}
    assert set(rows) == {("baseline", None), ("tome", 0.3), ("tome", 0.5), ("tome", None), ("reference", 0.3),
                         ("reference", 0.5)}  # ("tome", None): downsampling
    assert doc["verdict"].startswith("paid most here: ")
    for row in rows.values():
        assert len(row["times_s"]) == 2 and row["time_s"] > 0 and row["speedup"] > 0
        assert row["peak_mem_bytes"] > 50 * 2**20 and row["mem_reduction"] is not None
    base_tokens = rows[("baseline", None)]["tokens"]
    assert base_tokens["1"][0] == base_tokens["1"][1] == 3 * 256  # three level-1 blocks of 16x16 tokens
    assert rows[("tome", None)]["tokens"]["1"] == [768, 3 * 64]  # keys downsampled 2x per side
    for ratio in (0.3, 0.5):
        ours, ref = rows[("tome", ratio)], rows[("reference", ratio)]
        assert ours["tokens"]["1"] == [768, 3 * (256 - int(256 * ratio))]
        assert ours["tokens"]["2"][0] == ours["tokens"]["2"][1]  # level 2 does not merge by default
        assert ref["tokens"] == ours["tokens"]
        assert ours["output_change"] > 0 and 0 < ours["tome_fraction"] < 1 and ours["tome_time_s"] > 0
        assert 0 < ref["tome_fraction"] < 1
    assert rows[("baseline", None)]["tome_time_s"] == 0
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _row(method, speedup, times, ratio=0.5, mode="merge", reuse=1, change=0.01):
    from tomesd.bench.measures.runner import Row

    return Row(method=method, ratio=ratio, mode=mode, reuse_steps=reuse, times_s=list(times), speedup=speedup,
               output_change=change)


def test_the_verdict_names_the_fastest_setting_as_the_call_that_applies_it():
    from tomesd.bench.measures.report import verdict
    from tomesd.bench.measures.runner import Settings

    settings = Settings(ratios=(0.25, 0.5), modes=("merge", "downsample"), reuse_steps=(1, 2), steps=2)
    rows = [_row("baseline", 1.0, [10.0, 10.2], ratio=None), _row("tome", 1.3, [7.6, 7.7], ratio=0.25),
            _row("tome", 1.6, [6.2, 6.3], reuse=2), _row("tome", 1.4, [7.1, 7.2], ratio=None, mode="downsample"),
            _row("reference", 2.0, [5.0, 5.1])]  # tomesd's own: not ours to recommend
    line = verdict(rows, "tomesd 0.1.3", settings)
    assert line.startswith("paid most here: ToMe (ours) r=0.5 reuse 2, 1.60x")
    assert "tomesd.apply_patch(model, ratio=0.5, reuse_steps=2)" in line and "up to 2%" in line
    rows[2].speedup = 1.0  # now downsampling is the fastest
    assert "tomesd.apply_patch(model, mode='downsample')" in verdict(rows, "tomesd 0.1.3", settings)


def test_the_verdict_says_when_nothing_pays_beyond_the_noise():
    from tomesd.bench.measures.report import verdict
    from tomesd.bench.measures.runner import Settings

    rows = [_row("baseline", 1.0, [10.0, 10.9], ratio=None), _row("tome", 1.05, [9.5, 9.6]),
            _row("tome", 0.97, [10.3, 10.4], ratio=0.25)]
    line = verdict(rows, "tomesd 0.1.3", Settings())
    assert line.startswith("paid most here: no setting is faster than the baseline by more than this run's noise")
    assert "(9% between repeats" in line and "ToMe (ours) r=0.5, ran 1.05x" in line


def test_modes_reuse_and_a_denoising_loop(tmp_path, capsys):
    out_json = tmp_path / "r.json"
    argv = TINY + ["--no-memory", "--ratios", "0.5", "--modes", "merge,downsample,merge-restore,downsample-restore", "--reuse-steps",
                   "1,2", "--steps", "3", "--compare", "--json", str(out_json)]
    assert bench(argv) == 0
    printed = capsys.readouterr().out
    assert "downsample (ours)" in printed and "ToMe (ours) r=0.5 reuse 2" in printed and "loops of 3 UNet calls" in printed
    doc = json.loads(out_json.read_text())
    rows = {(r["method"], r["mode"], r["reuse_steps"]): r for r in doc["results"]}
    assert set(rows) == {("baseline", "merge", 1), ("tome", "merge", 1), ("tome", "merge", 2),
                         ("tome", "downsample", 1), ("reference", "merge", 1), ("tome", "merge-restore", 2),
                         ("tome", "downsample-restore", 2)}
    # restored tokens: one [2, 256, 32] float32 residual per level-1 self-attention (3 blocks), stated in the output
    restored = rows[("tome", "merge-restore", 2)]
    assert restored["restore_sites"] == 3 and restored["restore_bytes"] == 3 * 2 * 256 * 32 * 4
    assert "r=0.5 reuse 2 prop restore keeps 0.2 MiB of residuals" in printed
    # in downsample mode: one [2, 256, 32] residual per downsampled attention (the level-1 self-attentions)
    restored = rows[("tome", "downsample-restore", 2)]
    assert restored["restore_sites"] == 3 and restored["restore_bytes"] == 3 * 2 * 256 * 32 * 4
    assert "downsample (ours) reuse 2 restore keeps 0.2 MiB of residuals" in printed
    down = rows[("tome", "downsample", 1)]
    assert down["tokens"]["1"] == [768, 768 // 4]  # keys at level 1: a quarter
    assert down["output_change"] > 0 and down["tome_time_s"] > 0
    assert rows[("tome", "merge", 2)]["tokens"] == rows[("tome", "merge", 1)]["tokens"]
    assert doc["settings"]["steps"] == 3
    for row in doc["results"]:
        assert len(row["times_s"]) == 2 and row["time_s"] > 0


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--modes", "merge,fast"], "choose from merge, merge-mlp, merge-prop, merge-restore, downsample"),
        (["--modes", "merge-restore", "--steps", "6"], "give --reuse-steps 3"),
        (["--modes", "downsample-restore", "--steps", "6"], "give --reuse-steps 3"),
        (["--reuse-steps", "0"], "each value must be at least 1"),
        (["--reuse-steps", "3"], "needs --steps N"),
        (["--reuse-steps", "2", "--steps", "4", "--compile"], "cannot be compiled"),
        (["--steps", "0"], "--steps must be at least 1"),
        (["--ratios", "1.5"], "each ratio must be in (0, 1)"),
        (["--ratios", "half"], "comma-separated numbers"),
        (["--res", "100"], "multiple of 8"),
        (["--res", "128x100"], "multiple of 8"),
        (["--repeats", "0"], "--repeats must be at least 1"),
        (["--model", "/no/such/folder"], "no such folder"),
        (["--backend", "paddle"], "needs paddlepaddle and ppdiffusers"),
        (["--device", "cuda"], "no CUDA device"),
        (["--backend", "paddle", "--compile"], "--compile is torch only"),
        (["--compile-backend", "aot_eager"], "--compile-backend goes with --compile"),
        (["--compile", "--compile-backend", "no-such-backend"], "torch.compile knows"),
    ],
)
def test_bad_input_gets_a_clear_error(argv, message, capsys):
    assert bench(TINY + argv) == 2
    assert message in capsys.readouterr().err


def _ssim_by_hand(a, b):
    """SSIM of two [H, W, 3] images in [0, 1] (Wang et al. 2004: Gaussian window of 11 taps, sigma 1.5, k1 0.01,
    k2 0.03; the image mirrored at its borders), averaged over every pixel and channel."""
    import numpy as np
    from scipy.ndimage import gaussian_filter

    def blur(x):
        return gaussian_filter(x, sigma=1.5, truncate=5 / 1.5, mode="mirror")

    c1, c2 = 0.01 ** 2, 0.03 ** 2
    values = []
    for ch in range(3):
        x, y = a[..., ch], b[..., ch]
        mx, my = blur(x), blur(y)
        vx, vy, cxy = blur(x * x) - mx ** 2, blur(y * y) - my ** 2, blur(x * y) - mx * my
        values.append(((2 * mx * my + c1) * (2 * cxy + c2)) / ((mx ** 2 + my ** 2 + c1) * (vx + vy + c2)))
    return float(np.mean(values))


def test_model_closeness_equals_psnr_and_ssim_by_hand_of_the_saved_images(tmp_path, capsys):
    """Every setting of the bench runs on the pipeline (merge, merge with reuse, downsampling), over two
    prompts x two seeds; its PSNR and SSIM against the baseline equal those computed by hand from the images
    in the saved grid, and the floor is the baseline against itself from other noise."""
    import numpy as np
    from PIL import Image

    import tiny_torch as T

    folder = tmp_path / "pipe"
    T.sd_pipeline(tmp_path).save_pretrained(folder)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat\n\na red house by the sea\n")
    grid, out_json, plot = tmp_path / "grid.png", tmp_path / "r.json", tmp_path / "c.png"
    argv = ["--config", "tiny", "--res", "32", "--ratios", "0.5", "--modes", "merge,downsample", "--reuse-steps",
            "1,2", "--repeats", "1", "--warmup", "0", "--no-memory", "--prompts", str(prompts), "--seeds", "2",
            "--model", str(folder), "--steps", "3", "--grid", str(grid), "--json", str(out_json),
            "--closeness-plot", str(plot)]
    assert bench(argv) == 0
    printed = capsys.readouterr().out
    doc = json.loads(out_json.read_text())["pipeline"]
    names = [r["name"] for r in doc["runs"]]
    assert names == ["baseline", "ToMe (ours) r=0.5", "ToMe (ours) r=0.5 reuse 2", "downsample (ours)"]
    assert doc["prompts"] == ["a cat", "a red house by the sea"] and doc["seeds"] == [0, 1]
    with Image.open(grid) as image:
        pixels = np.asarray(image.convert("RGB"), dtype=np.float64) / 255.0
    cell = lambda col, row: pixels[20 + 32 * row: 20 + 32 * (row + 1), 32 * col: 32 * (col + 1)]  # noqa: E731
    assert pixels.shape == (20 + 4 * 32, 5 * 32, 3)  # 4 settings and the floor, 4 images each

    def by_hand(col):
        psnr = [10 * np.log10(1.0 / np.mean((cell(col, r) - cell(0, r)) ** 2)) for r in range(4)]
        return float(np.mean(psnr)), float(np.mean([_ssim_by_hand(cell(col, r), cell(0, r)) for r in range(4)]))

    for col, run in enumerate(doc["runs"][1:], start=1):
        psnr, ssim = by_hand(col)
        assert abs(run["psnr"] - psnr) < 1e-4 and abs(run["ssim"] - ssim) < 1e-6, run["name"]
        assert run["psnr"] < 60  # every setting moved the images
    floor_psnr, floor_ssim = by_hand(4)
    assert abs(doc["floor"]["psnr"] - floor_psnr) < 1e-4 and abs(doc["floor"]["ssim"] - floor_ssim) < 1e-6
    assert doc["runs"][1]["psnr"] > doc["floor"]["psnr"]  # r=0.5 stays closer than other noise
    assert "baseline from other noise (the floor)" in printed and "LPIPS" in doc["metrics"]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_model_folder_without_a_pipeline_is_refused(tmp_path, capsys):
    assert bench(TINY + ["--no-memory", "--model", str(tmp_path)]) == 2
    assert "model_index.json" in capsys.readouterr().err


def test_model_path_runs_the_pipeline_and_writes_a_grid(tmp_path, capsys, monkeypatch):
    """--model loads the pipeline in --dtype on --device, and warms each configuration up before timing it."""
    import torch
    from diffusers import DiffusionPipeline, StableDiffusionPipeline

    import tiny_torch as T
    from tomesd.bench.measures.tokens import token_counter

    folder = tmp_path / "pipe"
    T.sd_pipeline(tmp_path).save_pretrained(folder)

    loads, moves, calls = [], [], []
    from_pretrained, to, call = DiffusionPipeline.from_pretrained.__func__, DiffusionPipeline.to, StableDiffusionPipeline.__call__

    def spy_from_pretrained(cls, path, **kwargs):
        loads.append(kwargs)
        return from_pretrained(cls, path, **kwargs)

    def spy_to(self, *args, **kwargs):
        moves.append((args, kwargs))
        return to(self, *args, **kwargs)

    def spy_call(self, *args, **kwargs):
        forwards = []
        handle = self.unet.register_forward_pre_hook(lambda module, args: forwards.append(1))
        try:
            with token_counter(self.unet, "torch") as seen:
                out = call(self, *args, **kwargs)
        finally:
            handle.remove()
        # (steps, UNet dtype, UNet forwards, tokens into the first self-attention, at the latent's full size)
        calls.append((kwargs["num_inference_steps"], self.unet.dtype, len(forwards), seen[0][1]))
        return out

    monkeypatch.setattr(DiffusionPipeline, "from_pretrained", classmethod(spy_from_pretrained))
    monkeypatch.setattr(DiffusionPipeline, "to", spy_to)
    monkeypatch.setattr(StableDiffusionPipeline, "__call__", spy_call)

    grid, out_json = tmp_path / "grid.png", tmp_path / "r.json"
    argv = ["--config", "tiny", "--res", "32", "--ratios", "0.5", "--modes", "merge", "--repeats", "1", "--warmup", "0",
            "--no-memory", "--dtype", "bfloat16", "--device", "cpu", "--prompt", "a cat", "--seeds", "1",
            "--model", str(folder), "--steps", "3", "--grid", str(grid), "--json", str(out_json),
            "--closeness-plot", str(tmp_path / "c.png")]
    assert bench(argv) == 0
    from PIL import Image

    with Image.open(grid) as image:
        assert image.size == (3 * 32, 32 + 20)  # baseline, ToMe and the baseline from other noise, with labels
    assert loads == [{"torch_dtype": torch.bfloat16}]
    assert len(moves) == 1 and torch.device(*moves[0][0]) == torch.device("cpu")
    bf16 = torch.bfloat16
    # each configuration: an untimed 2-step warm-up, then the timed 3-step generation; then the floor's
    # unpatched generation from other noise
    assert calls == [(2, bf16, 2, 256), (3, bf16, 3, 256), (2, bf16, 2, 128), (3, bf16, 3, 128), (3, bf16, 3, 256)]
    doc = json.loads(out_json.read_text())["pipeline"]
    assert [r["name"] for r in doc["runs"]] == ["baseline", "ToMe (ours) r=0.5"]
    assert all(r["time_s"] > 0 for r in doc["runs"])
    assert (doc["dtype"], doc["device"], doc["warmup_steps"], doc["steps"]) == ("bfloat16", "cpu", 2, 3)
    assert "image grid" in capsys.readouterr().out


def test_console_script_and_module_entry_points():
    script = shutil.which("tomesd-bench", path=os.path.dirname(sys.executable))
    assert script is not None, "tomesd-bench is not installed beside this Python"
    for cmd in ([script, "--help"], [sys.executable, "-m", "tomesd", "bench", "--help"]):
        out = subprocess.run(cmd, capture_output=True, text=True)
        assert out.returncode == 0 and "--compare" in out.stdout


def test_a_transformer_architecture_in_every_mode_over_a_loop(tmp_path, capsys):
    """--config tiny-sd3 stands in for --arch sd3 (the same code path, a tiny width): image keys merge or
    shrink in every block, over a loop with reuse, memory probes included."""
    out_json = tmp_path / "r.json"
    argv = ["--config", "tiny-sd3", "--res", "64", "--repeats", "1", "--ratios", "0.5", "--modes", "merge,downsample",
            "--reuse-steps", "1,2", "--steps", "2", "--json", str(out_json)]
    assert bench(argv) == 0
    printed = capsys.readouterr().out
    assert "tiny SD3 transformer at 64x64" in printed and "downsample (ours)" in printed
    rows = {(r["method"], r["mode"], r["reuse_steps"]): r for r in json.loads(out_json.read_text())["results"]}
    tokens = 2 * 4 * 4  # two blocks over the 4x4 patch grid of a 64-pixel image
    assert [pair for pair in rows[("baseline", "merge", 1)]["tokens"].values()] == [[tokens, tokens]]
    assert list(rows[("tome", "merge", 1)]["tokens"].values()) == [[tokens, tokens // 2]]
    assert list(rows[("tome", "merge", 2)]["tokens"].values()) == [[tokens, tokens // 2]]
    assert list(rows[("tome", "downsample", 1)]["tokens"].values()) == [[tokens, tokens // 4]]
    for key, row in rows.items():
        assert row["peak_mem_bytes"] > 0 and (key[0] == "baseline" or row["output_change"] > 0)


@pytest.mark.parametrize("argv,message", [
    (["--arch", "sd3", "--compare"], "no reference"),
    (["--arch", "pixart", "--max-downsample", "2"], "one token grid"),
    (["--arch", "sd3", "--depth", "25"], "1 to 24"),
    (["--arch", "sd1", "--depth", "2"], "for transformers"),
])
def test_transformer_options_are_checked_before_any_work(argv, message, capsys):
    assert bench(argv) == 2
    assert message in capsys.readouterr().err


def test_flux_architecture_packs_its_latent_and_merges_every_block(tmp_path, capsys):
    out_json = tmp_path / "r.json"
    argv = ["--config", "tiny-flux", "--res", "64", "--repeats", "1", "--ratios", "0.5", "--no-memory",
            "--json", str(out_json)]
    assert bench(argv) == 0
    rows = {r["method"]: r for r in json.loads(out_json.read_text())["results"]}
    # 64 pixels: an 8x8 latent packed into 4x4 tokens; 1 double block sees 16 image keys, 2 single blocks
    # see 512 text + 16 image keys each.
    assert list(rows["tome"]["tokens"].values())[0][1] < list(rows["baseline"]["tokens"].values())[0][0]
    assert rows["tome"]["output_change"] > 0


def test_wan_architecture_merges_its_space_time_grid_at_a_non_square_size(tmp_path, capsys):
    """--config tiny-wan stands in for --arch wan: --res HEIGHTxWIDTH gives a 64x96 image, 9 frames give
    (9 - 1) / 4 + 1 = 3 latent frames, so each block's self-attention sees 3 x 4 x 6 = 72 image tokens,
    halved at r=0.5 (st=1)."""
    out_json = tmp_path / "r.json"
    argv = ["--config", "tiny-wan", "--res", "64x96", "--frames", "9", "--repeats", "1", "--warmup", "0",
            "--ratios", "0.5", "--no-memory", "--json", str(out_json)]
    assert bench(argv) == 0
    assert "tiny Wan transformer, 9 frames at 64x96" in capsys.readouterr().out
    doc = json.loads(out_json.read_text())
    rows = {(r["method"], r["mode"]): r for r in doc["results"]}
    assert list(rows["baseline", "merge"]["tokens"].values()) == [[2 * 72, 2 * 72]]  # 2 blocks
    assert list(rows["tome", "merge"]["tokens"].values()) == [[2 * 72, 2 * 36]]
    # keys downsampled at the attention dispatch: each frame's 4 x 6 grid to 2 x 3
    assert list(rows["tome", "downsample"]["tokens"].values()) == [[2 * 72, 2 * 3 * 6]]
    assert rows["tome", "merge"]["output_change"] > 0 and rows["tome", "downsample"]["output_change"] > 0


def test_sdxl_architecture_builds_and_passes_its_added_conditions(monkeypatch, capsys):
    """--arch sdxl at a cut width (the real one takes minutes per forward here): the SDXL layout with its
    text-and-time conditions runs, and ToMe merges at its default level 2."""
    from tomesd.bench.kits import configs

    small = dict(configs.SDXL, block_out_channels=(32, 64, 64), transformer_layers_per_block=(1, 1, 1),
                 attention_head_dim=(2, 4, 4), cross_attention_dim=32, norm_num_groups=8, layers_per_block=1,
                 addition_time_embed_dim=8, projection_class_embeddings_input_dim=16 + 6 * 8)
    monkeypatch.setitem(configs.ARCHS, "sdxl", configs.Arch("SDXL UNet", "UNet2DConditionModel", small, 4, 32, 16,
                                                            extra="sdxl"))
    assert bench(["--arch", "sdxl", "--res", "128", "--repeats", "1", "--ratios", "0.5", "--no-memory"]) == 0
    printed = capsys.readouterr().out
    assert "SDXL UNet at 128x128" in printed and "L2: " in printed


# Random weights: fbc's threshold is raised so far that the first block's residual is always "close enough"
# to skip (at diffusers' default 0.05 it skips nothing here, and the cache would not act).
@pytest.mark.parametrize("config,cache", [("tiny-sd3", "taylorseer"), ("tiny-flux", "fbc:10")])
def test_a_step_cache_runs_alone_and_under_each_setting(tmp_path, capsys, config, cache, monkeypatch):
    """--cache adds the cache alone and stacked under each of our settings, each compared with the plain
    baseline over the whole loop; the cache acts (it skips work and moves the outputs)."""
    import diffusers.hooks as dh

    applied = []
    real = getattr(dh, {"taylorseer": "apply_taylorseer_cache", "fbc:10": "apply_first_block_cache"}[cache])
    monkeypatch.setattr(dh, real.__name__, lambda model, cfg: applied.append(cfg) or real(model, cfg))
    out_json = tmp_path / "r.json"
    argv = ["--config", config, "--res", "64", "--repeats", "1", "--warmup", "0", "--ratios", "0.5", "--modes",
            "merge,downsample" if config == "tiny-sd3" else "merge", "--steps", "8", "--cache", cache,
            "--no-memory", "--json", str(out_json)]
    assert bench(argv) == 0
    printed = capsys.readouterr().out
    assert f"| {cache} alone |" in printed
    assert f"| ToMe (ours) r=0.5 + {cache} |" in printed
    rows = {(r["method"], r["mode"], r["cache"]): r for r in json.loads(out_json.read_text())["results"]}
    ours = [k for k in rows if k[0] == "tome" and k[2] is None]
    stacked = [(m, mode, cache) for m, mode, _ in ours]  # every setting, merge mode included
    assert stacked and set(rows) == {("baseline", "merge", None), ("baseline", "merge", cache)} | set(ours) | set(stacked)
    assert len(applied) == 2 * (len(stacked) + 1)  # a fresh cache for each timed loop and for the final eager pass
    if cache == "fbc:10":
        assert all(cfg.threshold == 10.0 for cfg in applied) and "First Block Cache (threshold 10)" in printed
    alone = rows[("baseline", "merge", cache)]
    assert rows[("baseline", "merge", None)]["loop_change"] == 0 and alone["loop_change"] > 1e-4  # the cache acts
    for m, mode, _ in stacked:  # stacked: both act, each measured against the plain baseline
        both, tome = rows[(m, mode, cache)], rows[(m, mode, None)]
        assert both["loop_change"] > 1e-4 and abs(both["loop_change"] - tome["loop_change"]) > 1e-5
        assert list(both["tokens"].values()) and all(a < b for b, a in both["tokens"].values())


def test_several_caches_run_side_by_side_in_one_run(tmp_path, capsys):
    """--cache a,b: each cache alone and stacked under each setting, beside one baseline and one row per
    setting, all in one interleaved run; each cache acts on its own rows."""
    out_json = tmp_path / "r.json"
    argv = ["--config", "tiny-sd3", "--res", "64", "--repeats", "1", "--warmup", "0", "--ratios", "0.5", "--modes",
            "merge", "--steps", "6", "--cache", "taylorseer,fastercache", "--no-memory", "--json", str(out_json)]
    assert bench(argv) == 0
    printed = capsys.readouterr().out
    rows = {(r["method"], r["cache"]): r for r in json.loads(out_json.read_text())["results"]}
    assert set(rows) == {(m, c) for m in ("baseline", "tome") for c in (None, "taylorseer", "fastercache")}
    for cache in ("taylorseer", "fastercache"):
        assert f"| {cache} alone |" in printed and f"| ToMe (ours) r=0.5 + {cache} |" in printed
        assert rows[("baseline", cache)]["loop_change"] > 1e-4  # the cache acts alone
    assert rows[("baseline", "taylorseer")]["loop_change"] != rows[("baseline", "fastercache")]["loop_change"]


def test_a_cache_of_attentions_after_a_cache_of_blocks_in_one_run(tmp_path):
    """--cache fbc,taylorseer on one model: TaylorSeer's attention hooks get their cache context after First
    Block Cache's block hooks were applied and removed (diffusers caches the list of hooked modules)."""
    out_json = tmp_path / "r.json"
    argv = ["--config", "tiny-flux", "--res", "64", "--repeats", "1", "--warmup", "0", "--ratios", "0.5", "--modes",
            "merge", "--steps", "6", "--cache", "fbc,taylorseer", "--no-memory", "--json", str(out_json)]
    assert bench(argv) == 0
    rows = {(r["method"], r["cache"]): r for r in json.loads(out_json.read_text())["results"]}
    assert rows[("baseline", "taylorseer")]["loop_change"] > 1e-4 and rows[("tome", "taylorseer")]["loop_change"] > 1e-4


@pytest.mark.parametrize("argv,message", [
    (["--config", "tiny-sd3", "--cache", "taylorseer,nope", "--steps", "4"], "choose one or more of"),
    (["--config", "tiny-sd3", "--cache", "taylorseer,fbc", "--steps", "4"],
     "fails on SD3Transformer2DModel in diffusers itself"),
    (["--config", "tiny-sd3", "--cache", "fbc", "--steps", "4"], "fails on SD3Transformer2DModel in diffusers itself"),
    (["--config", "tiny", "--cache", "fbc", "--steps", "4"], "fails on UNet2DConditionModel"),
    (["--config", "tiny-sd3", "--cache", "pab:0.1", "--steps", "4"], "pab takes no value; only fbc:THRESHOLD"),
    (["--config", "tiny-flux", "--cache", "fbc:0", "--steps", "4"], "fbc's threshold must be a positive number"),
    (["--config", "tiny-sd3", "--cache", "fbc:0.2", "--steps", "4"], "fails on SD3Transformer2DModel"),
    (["--config", "tiny-sd3", "--cache", "taylorseer"], "--steps N"),
    (["--config", "tiny-sd3", "--cache", "taylorseer", "--steps", "4", "--compile"], "drop --compile"),
    (["--config", "tiny", "--backend", "paddle", "--cache", "taylorseer", "--steps", "4"], "torch only"),
])
def test_cache_options_are_checked_before_any_work(argv, message, capsys):
    assert bench(argv) == 2
    assert message in capsys.readouterr().err


def test_a_video_architecture_merges_spatial_blocks_per_frame(tmp_path, capsys):
    """--config tiny-animatediff stands in for --arch animatediff: a [1, 4, frames, 16, 16] latent; every
    spatial self-attention at the finest level sees each frame's 256 tokens reduced."""
    out_json = tmp_path / "r.json"
    argv = ["--config", "tiny-animatediff", "--res", "128", "--frames", "3", "--repeats", "1", "--ratios", "0.5",
            "--modes", "merge,downsample", "--no-memory", "--json", str(out_json)]
    assert bench(argv) == 0
    assert "tiny AnimateDiff UNet, 3 frames at 128x128" in capsys.readouterr().out
    doc = json.loads(out_json.read_text())
    assert doc["settings"]["frames"] == 3
    rows = {(r["method"], r["mode"]): r for r in doc["results"]}
    full = rows[("baseline", "merge")]["tokens"]["1"][0]
    assert full == 3 * 256  # three spatial blocks at the top level; motion modules are not counted
    assert rows[("tome", "merge")]["tokens"]["1"] == [full, full // 2]
    assert rows[("tome", "downsample")]["tokens"]["1"] == [full, full // 4]
    assert all(r["output_change"] > 0 for k, r in rows.items() if k[0] == "tome")


def test_svd_architecture_merges_spatial_blocks_per_frame(tmp_path, capsys):
    """--config tiny-svd stands in for --arch svd: a [1, frames, 8, 16, 16] latent with SVD's added time ids;
    the spatial blocks at the finest level see each frame's 256 tokens reduced, the temporal ones are not
    counted (they attend over frames)."""
    out_json = tmp_path / "r.json"
    argv = ["--config", "tiny-svd", "--res", "128", "--frames", "3", "--batch", "1", "--repeats", "1", "--warmup", "0",
            "--ratios", "0.5", "--modes", "merge,downsample", "--no-memory", "--json", str(out_json)]
    assert bench(argv) == 0
    assert "tiny SVD UNet, 3 frames at 128x128" in capsys.readouterr().out
    rows = {(r["method"], r["mode"]): r for r in json.loads(out_json.read_text())["results"]}
    full = rows[("baseline", "merge")]["tokens"]["1"][0]
    assert full == 3 * 256  # one down and two up spatial blocks at the top level
    assert rows[("tome", "merge")]["tokens"]["1"] == [full, full // 2]
    assert rows[("tome", "downsample")]["tokens"]["1"] == [full, full // 4]


@pytest.mark.parametrize("argv,message", [
    (["--arch", "sd1", "--frames", "8"], "for video architectures"),
    (["--arch", "animatediff", "--frames", "0"], "at least 1"),
    (["--arch", "animatediff", "--compare"], "cannot patch UNetMotionModel"),
])
def test_video_options_are_checked_before_any_work(argv, message, capsys):
    assert bench(argv) == 2
    assert message in capsys.readouterr().err


def test_merge_mlp_rows_merge_the_feed_forward_too(tmp_path, capsys, monkeypatch):
    import tomesd

    applied = []
    real = tomesd.apply_patch
    monkeypatch.setattr(tomesd, "apply_patch", lambda model, **kw: applied.append(kw) or real(model, **kw))
    out_json = tmp_path / "r.json"
    argv = ["--config", "tiny-sd3", "--res", "64", "--repeats", "1", "--warmup", "0", "--ratios", "0.5",
            "--modes", "merge,merge-mlp", "--no-memory", "--json", str(out_json)]
    assert bench(argv) == 0
    assert "| ToMe (ours) r=0.5 merge_mlp |" in capsys.readouterr().out
    rows = {r["mode"]: r for r in json.loads(out_json.read_text())["results"] if r["method"] == "tome"}
    assert {kw["merge_mlp"] for kw in applied} == {False, True}
    assert rows["merge-mlp"]["output_change"] != rows["merge"]["output_change"]  # the feed-forward merged too


@pytest.mark.parametrize("config", ["tiny", "tiny-sd3"])
def test_flops_ratio_is_the_compute_each_setting_leaves_counted_by_hand(tmp_path, capsys, config):
    """The FLOPs column (counted on the meta device) equals torch's FlopCounterMode over the same model built
    on the CPU with real weights, unpatched and patched by hand; the ratio is the baseline's count over the row's.
    By hand, attention runs as torch's math kernel: FlopCounterMode has no count for the CPU's fused one (torch
    2.13), and on the meta device attention is counted as those same products."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    import tomesd
    from tomesd.bench.kits.torch_kit import TorchKit

    out_json = tmp_path / "r.json"
    assert bench(["--config", config, "--res", "64", "--repeats", "1", "--warmup", "0", "--no-memory", "--ratios",
                  "0.5", "--modes", "merge,merge-mlp,downsample", "--json", str(out_json)]) == 0
    assert "FLOPs ratio" in capsys.readouterr().out
    rows = {(r["method"], r["mode"]): r for r in json.loads(out_json.read_text())["results"]}

    kit = TorchKit("cpu", "float32")
    doc = json.loads(out_json.read_text())["settings"]
    model = kit.build(config, doc["seed"], doc["depth"])
    inputs = kit.inputs(config, doc["batch"], 64, doc["seed"] + 1, doc["frames"])

    def count(**kwargs):
        if kwargs:
            tomesd.apply_patch(model, **kwargs)
        with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
            kit.forward(model, inputs)
        tomesd.remove_patch(model)
        return counter.get_total_flops()

    by_hand = {("baseline", "merge"): count(), ("tome", "merge"): count(ratio=0.5),
               ("tome", "merge-mlp"): count(ratio=0.5, merge_mlp=True), ("tome", "downsample"): count(mode="downsample")}
    base = by_hand[("baseline", "merge")]
    for key, flops in by_hand.items():
        assert rows[key]["flops"] == flops, (key, rows[key]["flops"], flops)
        assert rows[key]["flop_speedup"] == pytest.approx(base / flops)
    # every mode leaves less compute, and merging the feed-forward too leaves less than merging attention alone
    assert 1 < rows[("tome", "merge")]["flop_speedup"] < rows[("tome", "merge-mlp")]["flop_speedup"]
    assert rows[("tome", "downsample")]["flop_speedup"] > 1


def test_flops_only_counts_at_full_size_without_running_anything(tmp_path, capsys):
    """--flops-only on PixArt-alpha at 1024x1024, all 28 blocks, in seconds: nothing is allocated or timed."""
    out_json = tmp_path / "f.json"
    assert bench(["--arch", "pixart", "--res", "1024", "--batch", "1", "--ratios", "0.5", "--modes",
                  "merge,downsample", "--flops-only", "--json", str(out_json)]) == 0
    printed = capsys.readouterr().out
    assert "| baseline |" in printed and "GFLOPs per forward" in printed and "time per" not in printed
    rows = {r["configuration"]: r for r in json.loads(out_json.read_text())["flops"]}
    # 28 blocks over 64x64 patches of 1,152 channels: thousands of GFLOPs, and ToMe r=0.5 leaves about 2/3
    assert rows["baseline"]["flops"] > 5e12
    assert 1.3 < rows["ToMe (ours) r=0.5"]["flop_speedup"] < 1.6 and rows["downsample (ours)"]["flop_speedup"] > 1.3


def test_flops_only_is_torch_only(capsys):
    assert bench(["--config", "tiny", "--flops-only", "--backend", "paddle"]) == 2
    assert "--flops-only counts with torch" in capsys.readouterr().err


def test_flux2_architecture_counts_keys_where_one_layer_projects_them_with_the_mlp(tmp_path):
    """--config tiny-flux2 stands in for --arch flux2. 64 pixels: an 8x8 latent packed into 4x4 = 16 image
    tokens beside 512 text tokens. The double block's to_k sees the 16 image keys; the 2 single blocks have
    no to_k (one layer projects q, k, v and the MLP's input), so their attention's input is counted: 528."""
    out_json = tmp_path / "r.json"
    argv = ["--config", "tiny-flux2", "--res", "64", "--repeats", "1", "--warmup", "0", "--ratios", "0.5",
            "--modes", "merge,downsample", "--no-memory", "--json", str(out_json)]
    assert bench(argv) == 0
    rows = {(r["method"], r["mode"]): r for r in json.loads(out_json.read_text())["results"]}
    levels = lambda row: sorted(row["tokens"].values())  # noqa: E731
    assert levels(rows["baseline", "merge"]) == [[16, 16], [2 * 528, 2 * 528]]
    assert levels(rows["tome", "merge"]) == [[16, 8], [2 * 528, 2 * 520]]  # half the image tokens merge
    assert levels(rows["tome", "downsample"]) == [[16, 4], [2 * 528, 2 * 516]]  # keys pooled 2x2
    assert rows["tome", "merge"]["output_change"] > 0 and rows["tome", "downsample"]["output_change"] > 0


def test_qwen_image_architecture_reads_its_grid_from_img_shapes(tmp_path):
    """--config tiny-qwen-image stands in for --arch qwen-image: 64 pixels, an 8x8 latent packed into 4x4 = 16
    image tokens, its grid passed as img_shapes. Each of the 2 blocks' to_k sees the image keys alone (the text's
    come from add_k_proj): half merge, or a quarter remain pooled 2x2."""
    out_json = tmp_path / "r.json"
    argv = ["--config", "tiny-qwen-image", "--res", "64", "--repeats", "1", "--warmup", "0", "--ratios", "0.5",
            "--modes", "merge,downsample", "--no-memory", "--json", str(out_json)]
    assert bench(argv) == 0
    rows = {(r["method"], r["mode"]): r for r in json.loads(out_json.read_text())["results"]}
    assert list(rows["baseline", "merge"]["tokens"].values()) == [[2 * 16, 2 * 16]]
    assert list(rows["tome", "merge"]["tokens"].values()) == [[2 * 16, 2 * 8]]
    assert list(rows["tome", "downsample"]["tokens"].values()) == [[2 * 16, 2 * 4]]
    assert rows["tome", "merge"]["output_change"] > 0 and rows["tome", "downsample"]["output_change"] > 0


def _tiny_arch_rows(config, res, tmp_path, extra=()):
    out_json = tmp_path / "r.json"
    argv = ["--config", config, "--res", str(res), "--repeats", "1", "--warmup", "0", "--ratios", "0.5,0.75",
            "--no-memory", "--json", str(out_json), *extra]
    assert bench(argv) == 0
    return {(r["method"], r["mode"], r["ratio"]): r for r in json.loads(out_json.read_text())["results"]}


def test_z_image_architecture_merges_its_lists_of_latents_and_refuses_downsample(tmp_path, capsys):
    """--config tiny-z-image stands in for --arch z-image: each sample's latent and caption go in as ZImagePipeline's
    lists. 64 pixels: an 8x8 latent in 2x2 patches, 16 image tokens (32 with Z-Image's padding to a multiple of 32),
    128 caption tokens. --depth 1: 1 main layer and 1 refiner a side. The noise refiner (image alone) merges 8 or 12
    of the 16; the main layer (160: [image, its padding, caption]) the same; the context refiner (caption alone, 128)
    never. Downsampling is not Z-Image's: the default run leaves its row out and --modes downsample is refused by
    name."""
    from tomesd.bench.kits.configs import ARCHS

    rows = _tiny_arch_rows("tiny-z-image", 64, tmp_path, ["--depth", "1"])
    assert set(rows) == {("baseline", "merge", None), ("tome", "merge", 0.5), ("tome", "merge", 0.75)}
    tokens = lambda r: sorted(map(tuple, rows[r]["tokens"].values()))  # noqa: E731
    assert tokens(("baseline", "merge", None)) == [(32, 32), (288, 288)]
    assert tokens(("tome", "merge", 0.5)) == [(32, 24), (288, 280)]
    assert tokens(("tome", "merge", 0.75)) == [(32, 20), (288, 276)]
    half, most = rows["tome", "merge", 0.5], rows["tome", "merge", 0.75]
    assert 1 < half["flop_speedup"] < most["flop_speedup"]
    assert half["output_change"] > 1e-3 and most["output_change"] > 1e-3
    printed = capsys.readouterr().out
    assert "ToMe (ours) r=0.5 |" in printed and "ToMe (ours) r=0.75 |" in printed and "downsample" not in printed
    assert "(1 of 2 main blocks, 1 of 1 refiner blocks on each side)" in printed
    # the real width's cut: D main layers, at most D of its 2 refiner layers a side
    assert [(c["n_layers"], c["n_refiner_layers"]) for c in map(ARCHS["z-image"].build_config, (1, 4, None))] == \
        [(1, 1), (4, 2), (30, 2)]

    assert bench(["--config", "tiny-z-image", "--res", "64", "--modes", "merge,downsample", "--no-memory"]) == 2
    assert "Z-Image attends over one unified sequence" in capsys.readouterr().err


def test_hunyuanvideo15_architecture_counts_its_flops_on_the_cpu(tmp_path, capsys):
    """--config tiny-hunyuanvideo-1.5 stands in for --arch hunyuanvideo-1.5: 128 pixels are an 8x8 latent (its VAE
    packs 16x16 pixels), 5 frames 2 latent frames, so 128 image keys at each of the 2 blocks' to_k (the text's go
    through add_k_proj). Its forward reads tensors on the host, so its FLOPs are counted on the CPU."""
    rows = _tiny_arch_rows("tiny-hunyuanvideo-1.5", 128, tmp_path)
    assert set(rows) == {("baseline", "merge", None), ("tome", "merge", 0.5), ("tome", "merge", 0.75)}
    assert list(rows["baseline", "merge", None]["tokens"].values()) == [[2 * 128, 2 * 128]]
    assert list(rows["tome", "merge", 0.5]["tokens"].values()) == [[2 * 128, 2 * 64]]
    assert list(rows["tome", "merge", 0.75]["tokens"].values()) == [[2 * 128, 2 * 32]]
    half, most = rows["tome", "merge", 0.5], rows["tome", "merge", 0.75]
    assert 1 < half["flop_speedup"] < most["flop_speedup"]
    assert half["output_change"] > 1e-3 and most["output_change"] > 1e-3
    printed = capsys.readouterr().out
    assert "ToMe (ours) r=0.75 |" in printed and "counted on cpu, one real forward per row" in printed

    assert bench(["--config", "tiny-hunyuanvideo-1.5", "--res", "128", "--modes", "downsample", "--no-memory"]) == 2
    assert "HunyuanVideo 1.5's processor pads its text mask" in capsys.readouterr().err
    assert bench(["--config", "tiny-hunyuanvideo-1.5", "--res", "120", "--modes", "merge", "--no-memory"]) == 2
    assert "--res must be a multiple of 16" in capsys.readouterr().err


def test_flops_counted_on_the_cpu_equal_those_counted_on_meta(monkeypatch):
    """Where a host's forward cannot run on the meta device, its FLOPs are counted on the CPU, whose fused attention
    kernel the counter does not know: counted as the attention it computes, the CPU's count is the meta device's."""
    from tomesd.bench.kits import configs
    from tomesd.bench.measures.flops import fill_flops
    from tomesd.bench.measures.runner import Row, Settings

    def count():
        settings = Settings(backend="torch", config="tiny-z-image", res=64, batch=2, ratios=(0.5,), device="cpu")
        rows = [Row(method="baseline", ratio=None, mode="merge"), Row(method="tome", ratio=0.5, mode="merge")]
        fill_flops(settings, rows)
        return [row.flops for row in rows]

    on_meta = count()
    monkeypatch.setattr(configs.ARCHS["tiny-z-image"], "host_reads", "as if it read tensors on the host")
    assert count() == on_meta and on_meta[0] > on_meta[1] > 0


def test_attention_backend_times_every_configuration_under_that_kernel(tmp_path, monkeypatch, capsys):
    """--attention-backend flex: the configurations' attention runs through diffusers' flex kernel (proportional
    attention too: its channel joins at the dispatch), and the process-wide kernel is the default again after."""
    from diffusers.models import attention_dispatch as D

    calls = []
    flex = D._AttentionBackendRegistry._backends["flex"]

    def counted(**kwargs):
        calls.append(kwargs["query"].shape[1])
        return flex(**kwargs)

    monkeypatch.setitem(D._AttentionBackendRegistry._backends, "flex", counted)
    before = D._AttentionBackendRegistry.get_active_backend()
    out_json = tmp_path / "r.json"
    argv = ["--config", "tiny-flux", "--res", "64", "--repeats", "1", "--warmup", "0", "--ratios", "0.5", "--modes",
            "merge,merge-prop", "--no-memory", "--attention-backend", "flex", "--json", str(out_json)]
    assert bench(argv) == 0
    assert calls and D._AttentionBackendRegistry.get_active_backend() == before
    assert "attention kernel: flex" in capsys.readouterr().out
    rows = json.loads(out_json.read_text())["results"]
    assert {r["mode"] for r in rows if r["method"] == "tome"} == {"merge", "merge-prop"}


def test_attention_backend_is_checked_before_any_work(capsys):
    assert bench(["--config", "tiny-flux", "--attention-backend", "nope"]) == 2
    assert "diffusers knows" in capsys.readouterr().err


def test_an_attention_backend_this_machine_cannot_run_is_an_error_not_a_traceback(monkeypatch, capsys):
    """diffusers checks a kernel's requirements (flash-attn, sageattention) as its context enters."""
    import contextlib

    from diffusers.models import attention_dispatch as D

    @contextlib.contextmanager
    def missing(name):
        raise RuntimeError(f"Flash Attention backend {name!r} is not usable because of missing package")
        yield

    monkeypatch.setattr(D, "attention_backend", missing)
    assert bench(["--config", "tiny-flux", "--res", "64", "--repeats", "1", "--no-memory",
                  "--attention-backend", "flash"]) == 2
    assert "--attention-backend: Flash Attention backend 'flash' is not usable" in capsys.readouterr().err
