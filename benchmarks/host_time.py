"""ToMe's added host time per forward where the compute is negligible: each yardstick's real block structure at a
tiny width (tomesd/bench/measures/host_cost.py's NARROW), batch 2, an 8x8 latent, on this CPU. The unpatched model, ToMe
r=0.5 and mode="downsample" (and tomesd 0.1.3 on SD1.5), each on its own copy patched once (weights shared), are
timed interleaved in one process: the median of --repeats forwards each.

    TOME_REFS_DIR=.refs python benchmarks/host_time.py [--repeats 21] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def interleaved(models: Dict[str, Any], forward: Callable[[Any], Any], repeats: int) -> Dict[str, List[float]]:
    """Seconds of each of `repeats` forwards of every model, interleaved (the order reversed every other round), so
    the machine's drift falls on every configuration alike."""
    times: Dict[str, List[float]] = {label: [] for label in models}
    for rep in range(repeats):
        order = list(models.items()) if rep % 2 == 0 else list(models.items())[::-1]
        for label, model in order:
            started = time.perf_counter()
            forward(model)
            times[label].append(time.perf_counter() - started)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--models", default="sd1.5,sdxl,sd3,flux,wan")
    parser.add_argument("--json", default=None)
    opts = parser.parse_args()

    import torch

    import tomesd
    from tomesd.bench.measures.host_cost import build_narrow, host_work, narrow_inputs
    from tomesd.bench.kits.torch_kit import TorchKit

    torch.set_num_threads(1)
    kit = TorchKit("cpu", "float32")
    results = {}
    for name in opts.models.split(","):
        base = build_narrow(name)
        inputs = narrow_inputs(name)
        models = {"unpatched": base}
        for label, kwargs in (("ToMe r=0.5", dict(ratio=0.5)), ("downsample", dict(mode="downsample"))):
            models[label] = kit.share_copy(base)
            tomesd.apply_patch(models[label], **kwargs)
        if name == "sd1.5":
            models["tomesd 0.1.3 r=0.5"] = kit.share_copy(base)
            kit.apply_reference(models["tomesd 0.1.3 r=0.5"], 0.5, 1)
        if name in ("sd1.5", "sdxl"):  # the latent by position, as pipelines pass it (tomesd 0.1.3 reads it so)
            sample, rest = inputs["sample"], {k: v for k, v in inputs.items() if k != "sample"}
            forward = lambda model: model(sample, **rest)  # noqa: E731
        else:
            forward = lambda model: model(**inputs)  # noqa: E731
        with torch.no_grad():
            for model in models.values():  # warm-up: first calls plan, park and keep their constants
                for _ in range(2):
                    forward(model)
            times = interleaved(models, forward, opts.repeats)
            counts = {label: host_work(lambda m=model: forward(m)) for label, model in models.items()}
        own = statistics.median(times["unpatched"])
        rows = {}
        for label in models:
            t = statistics.median(times[label])
            rows[label] = {"ms": round(t * 1e3, 3), "added_ms": round((t - own) * 1e3, 3),
                           "added_fraction": round((t - own) / own, 3), "launches": counts[label].launches,
                           "python_calls": counts[label].python_calls}
        results[name] = rows
        print(f"\n{name} (batch 2, 8x8 latent, tiny width), median of {opts.repeats} interleaved forwards")
        print("| configuration | ms per forward | added ms | added, of the unpatched | launches | Python calls |")
        print("|---|---|---|---|---|---|")
        for label, row in rows.items():
            print(f"| {label} | {row['ms']:.2f} | {row['added_ms']:+.2f} | {row['added_fraction']:+.0%} | "
                  f"{row['launches']:,} | {row['python_calls']:,} |")
        for label, model in models.items():
            if label.startswith(("ToMe", "downsample")):
                tomesd.remove_patch(model)
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"repeats": opts.repeats, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
