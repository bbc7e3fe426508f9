"""`tomesd bench --context-parallel N`: the tiny Flux run context-parallel on 2 gloo processes, the baseline
beside ToMe; each rank's attention takes its band less the merged share, and what the collectives move
(counted op by op) shrinks."""
import json

import pytest

from tomesd.bench.cli import _bench as bench


@pytest.mark.parametrize("attention", ["ulysses", "ring"])
def test_context_parallel_rows_report_tokens_and_collectives_per_rank(tmp_path, capsys, attention):
    out_json = tmp_path / "cp.json"
    argv = ["--config", "tiny-flux", "--res", "128", "--batch", "1", "--ratios", "0.5", "--repeats", "1",
            "--warmup", "0", "--context-parallel", "2", "--cp-attention", attention, "--json", str(out_json)]
    assert bench(argv) == 0
    printed = capsys.readouterr().out
    assert f"{attention} over 2 processes" in printed and "| ToMe (ours) r=0.5 |" in printed
    doc = json.loads(out_json.read_text())
    assert doc["settings"]["processes"] == 2 and doc["settings"]["attention"] == attention
    base, tome = doc["results"]
    assert base["method"] == "baseline" and tome["ratio"] == 0.5
    assert base["tokens_per_rank"] == 32 and tome["tokens_per_rank"] == 16  # 64 tokens, each rank's band of 32
    assert 0 < tome["collective_elements"] < base["collective_elements"]
    assert tome["collective_bytes"] == 4 * tome["collective_elements"]  # float32
    assert all(row["time_s"] > 0 for row in (base, tome))


@pytest.mark.parametrize("argv,message", [
    (["--config", "tiny-sd3", "--context-parallel", "2"], "SD3Transformer2DModel has none of: use --arch flux"),
    (["--config", "tiny-flux", "--context-parallel", "1"], "N >= 2"),
    (["--config", "tiny-flux", "--context-parallel", "2", "--steps", "4", "--cache", "taylorseer"], "drop"),
])
def test_context_parallel_options_are_checked_before_any_work(argv, message, capsys):
    assert bench(argv) == 2
    assert message in capsys.readouterr().err
