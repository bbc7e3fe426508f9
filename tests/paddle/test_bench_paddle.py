"""The benchmark command on the paddle backend, against ppdiffusers' built-in (tiny config)."""
import argparse
import json

from tomesd.bench.cli import add_arguments, run


def test_tiny_paddle_bench_with_compare(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out_json = tmp_path / "r.json"
    argv = ["--backend", "paddle", "--config", "tiny", "--res", "128", "--ratios", "0.5", "--repeats", "1",
            "--warmup", "0", "--compare", "--json", str(out_json)]
    assert run(parser.parse_args(argv)) == 0
    assert "ppdiffusers built-in r=0.5" in capsys.readouterr().out
    doc = json.loads(out_json.read_text())
    assert doc["reference"] == "ppdiffusers built-in" and "paddle" in doc["machine"]
    rows = {(r["method"], r["ratio"]): r for r in doc["results"]}
    ours, ref = rows[("tome", 0.5)], rows[("reference", 0.5)]
    assert ours["tokens"]["1"] == ref["tokens"]["1"] == [768, 384]  # the built-in really merged
    assert ours["output_change"] > 0 and ref["output_change"] > 0  # each with its own random dst pattern
    assert 0 < ours["tome_fraction"] < 1 and 0 < ref["tome_fraction"] < 1
    assert all(r["peak_mem_bytes"] > 50 * 2**20 for r in rows.values())


def _tiny_ppdiffusers_pipeline(tmp_path):
    import paddle
    from paddlenlp.transformers import CLIPTokenizer
    from ppdiffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from ppdiffusers.transformers import CLIPTextConfig, CLIPTextModel

    from tiny_configs import CLIP_TEXT, VAE, write_clip_vocab
    from tiny_torch import SD1_UNET

    vocab_file, merges_file, vocab_size = write_clip_vocab(str(tmp_path))
    paddle.seed(0)
    return StableDiffusionPipeline(
        vae=AutoencoderKL(**VAE), text_encoder=CLIPTextModel(CLIPTextConfig(vocab_size=vocab_size, **CLIP_TEXT)),
        tokenizer=CLIPTokenizer(vocab_file, merges_file, max_len=77), unet=UNet2DConditionModel(**SD1_UNET),
        scheduler=DDIMScheduler(), safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    )


def test_paddle_model_path_loads_in_dtype_and_warms_up(tmp_path, capsys, monkeypatch):
    import paddle
    from ppdiffusers import DiffusionPipeline, StableDiffusionPipeline

    folder = tmp_path / "pipe"
    _tiny_ppdiffusers_pipeline(tmp_path).save_pretrained(str(folder))
    loads, calls = [], []
    from_pretrained, call = DiffusionPipeline.from_pretrained.__func__, StableDiffusionPipeline.__call__

    def spy_from_pretrained(cls, path, **kwargs):
        loads.append(kwargs)
        return from_pretrained(cls, path, **kwargs)

    def spy_call(self, *args, **kwargs):
        forwards = []
        handle = self.unet.register_forward_pre_hook(lambda layer, args: forwards.append(1))
        try:
            out = call(self, *args, **kwargs)
        finally:
            handle.remove()
        calls.append((kwargs["num_inference_steps"], len(forwards)))
        return out

    monkeypatch.setattr(DiffusionPipeline, "from_pretrained", classmethod(spy_from_pretrained))
    monkeypatch.setattr(StableDiffusionPipeline, "__call__", spy_call)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out_json = tmp_path / "r.json"
    argv = ["--backend", "paddle", "--config", "tiny", "--res", "32", "--ratios", "0.5", "--repeats", "1", "--warmup",
            "0", "--no-memory", "--model", str(folder), "--steps", "3", "--grid", str(tmp_path / "grid.png"),
            "--json", str(out_json), "--prompt", "a cat", "--seeds", "1", "--closeness-plot", str(tmp_path / "c.png")]
    assert run(parser.parse_args(argv)) == 0
    assert loads == [{"paddle_dtype": paddle.float32}]
    # per configuration (baseline, merge, downsample): a 2-step warm-up, then the timed run; then the floor
    assert calls == [(2, 2), (3, 3)] * 3 + [(3, 3)]
    doc = json.loads(out_json.read_text())["pipeline"]
    assert (doc["library"], doc["dtype"], doc["device"], doc["warmup_steps"]) == ("ppdiffusers", "float32", "cpu", 2)
    assert [r["name"] for r in doc["runs"]] == ["baseline", "ToMe (ours) r=0.5", "downsample (ours)"]
    assert all(r["psnr"] > doc["floor"]["psnr"] for r in doc["runs"][1:])  # closer than the baseline from other noise
