"""`tomesd bench --host comfyui`: its plumbing on tiny ComfyUI models (timings are not asserted)."""
import json

import pytest

import comfy_host

comfy_host.import_comfy()

from tomesd.bench import comfyui  # noqa: E402
from tomesd.cli import main  # noqa: E402


def test_bench_times_each_configuration_side_by_side(tmp_path):
    out = tmp_path / "comfy.json"
    with pytest.raises(SystemExit) as exit:
        main(["bench", "--host", "comfyui", "--arch", "sd1", "--config", "tiny", "--res", "128", "--ratios", "0.25,0.5",
              "--repeats", "2", "--warmup", "0", "--json", str(out)])
    assert exit.value.code == 0
    result = json.loads(out.read_text())
    names = [row["config"] for row in result["rows"]]
    assert names == ["unpatched", "ComfyUI TomePatchModel r=0.25", "tomesd ToMe r=0.25",
                     "ComfyUI TomePatchModel r=0.5", "tomesd ToMe r=0.5", "tomesd ToDo x2"]
    assert all(len(times) == 2 for times in result["seconds"].values())
    assert result["rows"][0]["speedup"] == 1.0


def test_rounds_interleave_configurations_on_one_clock():
    """Each round calls every configuration once, starting one later each round; a virtual clock gives each
    its own made-up cost."""
    order, now = [], [0.0]
    cost = {"a": 2.0, "b": 1.0}

    class Model:
        def __init__(self, name):
            self.name, self.model_options, self.wrappers = name, {}, {}
            outer = self

            class Base:
                def apply_model(self, *args, **kwargs):
                    order.append(outer.name)
                    now[0] += cost[outer.name]

            self.model = Base()

    configs = {"unpatched": Model("a"), "fast": Model("b")}
    seconds = comfyui.measure(configs, (None, None, None), {}, repeats=2, warmup=1, sync=lambda: None,
                              clock=lambda: now[0])
    assert order == ["a", "b", "b", "a", "a", "b"]
    assert seconds == {"unpatched": [2.0, 2.0], "fast": [1.0, 1.0]}
    rows = comfyui.report(seconds)
    assert [round(row["speedup"], 3) for row in rows] == [1.0, 2.0]


def test_flux_is_timed_with_the_tome_node_only():
    model = comfyui.build("tiny-flux", None, __import__("torch").float32, __import__("torch").device("cpu"), 0)
    names = list(comfyui.configurations(model, "tiny-flux", [0.5]))
    assert names == ["unpatched", "ComfyUI TomePatchModel r=0.5", "tomesd ToMe r=0.5"]


def test_comfyuis_attention_and_proportional_rows(tmp_path):
    """--attention-backend picks ComfyUI's attention function by its registered name for the run (and puts it back
    after); --modes merge-prop adds the ToMe node with proportional attention beside each ratio."""
    import importlib

    attention = importlib.import_module("comfy.ldm.modules.attention")
    before = attention.optimized_attention
    seen = []
    split = attention.REGISTERED_ATTENTION_FUNCTIONS["split"]

    def spy(*args, **kwargs):
        seen.append(1)
        return split(*args, **kwargs)

    attention.REGISTERED_ATTENTION_FUNCTIONS["split"] = spy
    out = tmp_path / "comfy.json"
    try:
        with pytest.raises(SystemExit) as exit:
            main(["bench", "--host", "comfyui", "--arch", "sd1", "--config", "tiny", "--res", "128", "--ratios", "0.5",
                  "--modes", "merge-prop", "--attention-backend", "split", "--repeats", "1", "--warmup", "0",
                  "--json", str(out)])
    finally:
        attention.REGISTERED_ATTENTION_FUNCTIONS["split"] = split
    assert exit.value.code == 0
    result = json.loads(out.read_text())
    assert [row["config"] for row in result["rows"]] == ["unpatched", "ComfyUI TomePatchModel r=0.5",
                                                         "tomesd ToMe r=0.5", "tomesd ToMe r=0.5 prop",
                                                         "tomesd ToDo x2"]
    assert result["attention"] == "split" and seen  # the run's attention calls went to it
    assert attention.optimized_attention is before
    assert importlib.import_module("comfy.ldm.modules.attention").optimized_attention is before

    with pytest.raises(SystemExit, match="--attention-backend 'fused': ComfyUI registers .*pytorch"):
        main(["bench", "--host", "comfyui", "--arch", "sd1", "--config", "tiny", "--res", "128", "--ratios", "0.5",
              "--attention-backend", "fused", "--repeats", "1", "--warmup", "0"])
