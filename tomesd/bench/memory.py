"""Child process of the benchmark: peak RSS of one UNet forward under one configuration (CPU).

Run as `python -m tomesd.bench.memory '<json>'`; prints {"peak_rss_bytes": N}.
"""
from __future__ import annotations

import json
import resource
import sys

from .kits import make_kit
from .runner import Config, Settings


def _reset_peak() -> bool:
    """Linux resets VmHWM (peak RSS) on writing 5 to clear_refs: model building is left out."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main() -> None:
    spec = json.loads(sys.argv[1])
    fields = dict(spec["settings"])
    for name in ("ratios", "modes", "reuse_steps"):
        fields[name] = tuple(fields[name])
    settings = Settings(**fields)
    config = Config(**spec["config"])
    kit = make_kit(settings.backend, settings.device, settings.dtype)
    model = kit.build(settings.config, settings.seed, settings.depth)
    inputs = kit.inputs(settings.config, settings.batch, settings.res, settings.seed + 1, settings.frames,
                        settings.width or None)
    if settings.compile:  # the compiled forward's peak, after its compilation
        with kit.compile_settings(1):
            copy = kit.patched_copy(model, config, settings)
            compiled = kit.compile(copy, settings.compile_backend, settings.compile_mode)
            kit.forward(compiled, inputs)
            _reset_peak()
            kit.forward(compiled, inputs)
    else:
        with kit.method(model, config, settings):
            _reset_peak()
            kit.forward(model, inputs)
    print(json.dumps({"peak_rss_bytes": _peak_rss()}))


if __name__ == "__main__":
    main()
