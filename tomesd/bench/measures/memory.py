"""The benchmark's CPU peak-memory probes: peak RSS of one forward per configuration, each in a process of its own
(RSS never shrinks back, so configurations cannot share one).

One server process (`python -m tomesd.bench.measures.memory --serve`) imports the framework once and forks a child
per configuration, which builds the model and runs the forward; so a probe costs its model and its forward, not a
framework import (seconds each). The server runs no tensor op before it forks, so no thread pool is copied into a
child, and it owns no main module that a child could run again (multiprocessing's fork server re-imports the
caller's script in each child). Where there is no os.fork (Windows), each probe is a fresh `python -m
tomesd.bench.measures.memory '<json>'`, which prints {"peak_rss_bytes": N}.
"""
from __future__ import annotations

import importlib
import json
import os
import resource
import subprocess
import sys
import traceback
from dataclasses import asdict
from typing import Any, Callable, Dict, List

from ..kits.pick import make_kit
from .runner import Config, Row, Settings, config_of

# What the server imports before it forks the first probe, by backend.
_PRELOAD = {"torch": ["torch", "diffusers", "tomesd.bench.measures.memory"],
            "paddle": ["paddle", "ppdiffusers", "tomesd.bench.measures.memory"]}


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


def probe(spec: Dict[str, Any]) -> int:
    """Peak RSS (bytes) of one forward of the configuration `spec` names ({"settings": ..., "config": ...})."""
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
            compiled = kit.compile(copy, settings.compile_backend, settings.compile_mode, settings.compile_regional)
            kit.forward(compiled, inputs)
            _reset_peak()
            kit.forward(compiled, inputs)
    else:
        with kit.method(model, config, settings):
            _reset_peak()
            kit.forward(model, inputs)
    return _peak_rss()


def _fork_probe(spec: Dict[str, Any]) -> Dict[str, Any]:
    """In the server: one forked child runs the probe; its result, its traceback, or how it ended."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        os.close(read)
        try:
            result: Dict[str, Any] = {"peak_rss_bytes": probe(spec)}
        except BaseException:  # noqa: B036 - whatever failed goes back to the benchmark, which raises it
            result = {"error": traceback.format_exc()[-2000:]}
        os.write(write, json.dumps(result).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        data = pipe.read()
    _, status = os.waitpid(pid, 0)
    if not data:
        return {"error": f"the probe process ended without a result (wait status {status}; killed for memory?)"}
    return json.loads(data)


def serve() -> None:
    """The server's loop: a spec per line on stdin, a result per line on the stdout it was started with (anything
    a model prints goes to stderr)."""
    results = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    imported = False
    for line in sys.stdin:
        spec = json.loads(line)
        if not imported:  # the framework, once, before the first fork
            for name in _PRELOAD.get(spec["settings"]["backend"], []):
                importlib.import_module(name)
            imported = True
        results.write(json.dumps(_fork_probe(spec)) + "\n")
        results.flush()


def _subprocess(spec: Dict[str, Any]) -> Dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "tomesd.bench.measures.memory", json.dumps(spec)], capture_output=True,
                         text=True, env=dict(os.environ))
    if out.returncode != 0:
        return {"error": out.stderr[-2000:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure_cpu_memory(settings: Settings, rows: List[Row], progress: Callable[[int], None] = lambda n: None) -> None:
    """Fill each row's peak_mem_bytes: peak RSS of one forward under its configuration, model weights included."""
    server = None
    if hasattr(os, "fork"):
        server = subprocess.Popen([sys.executable, "-m", "tomesd.bench.measures.memory", "--serve"],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                  env=dict(os.environ))
    try:
        for row in rows:
            spec = {"settings": asdict(settings), "config": asdict(config_of(row))}
            if server is None:
                result = _subprocess(spec)
            else:
                server.stdin.write(json.dumps(spec) + "\n")
                server.stdin.flush()
                answer = server.stdout.readline()
                result = json.loads(answer) if answer else {"error": "the probe server ended (killed for memory?)"}
            if "error" in result:
                raise RuntimeError(f"memory probe failed for {row.method} {row.ratio}:\n{result['error']}")
            row.peak_mem_bytes = result["peak_rss_bytes"]
            progress(1)
    finally:
        if server is not None:
            server.stdin.close()
            server.wait()


if __name__ == "__main__":
    if sys.argv[1] == "--serve":
        serve()
    else:
        print(json.dumps({"peak_rss_bytes": probe(json.loads(sys.argv[1]))}))
