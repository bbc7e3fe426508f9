import gc
import os
import sys
import threading

import pytest

# Tests import their helpers (references, models) from this folder.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# `make test` runs two pytest-xdist workers on a 2-core machine: each computes on one thread (set before torch
# or paddle is imported), so the two never fight over the cores.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import process_state  # noqa: E402  (from this folder, put on sys.path above)


# Kinds that count only after a collection: a dropped model's patch is no leak once the model is gone (a ComfyUI
# model patcher sits in reference cycles: only a collection frees it, and with it the seams its patch used).
_AFTER_COLLECTION = ("ToMe patches still hooked on a model", "users of a host function's seam", "threads left running")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "call":
        item.tome_call_failed = report.failed


@pytest.fixture(autouse=True)
def leaves_the_process_as_it_found_it(request):
    """Fails the test that leaves process-wide state changed (tests/process_state.py names each kind: a patch
    hooked, a seam in use, diffusers' attention registry, a torch or dynamo setting, an environment variable, a
    replaced function...), then restores what it can, so the next test starts clean whatever this one did. A
    test that failed already is not failed twice: what it left is put back (its patches removed) in silence.
    Every test starts from the global RNGs seeded as in a fresh process, and code a test compiled is dropped
    after it, so no test's result depends on which ran before it in its worker."""
    process_state.seed_global_rngs()
    before, graphs = process_state.snapshot(), process_state.compiled_graphs()
    yield
    if process_state.compiled_graphs() != graphs:
        process_state.forget_compiled_code()
    after = process_state.snapshot()
    changes = [c for c in process_state.changes(before, after) if not c.startswith(_AFTER_COLLECTION)]
    if process_state.changes(before, after) != changes:
        gc.collect()
        for thread in threading.enumerate():
            if not thread.daemon and thread.name in after["threads left running"] and thread is not threading.current_thread():
                thread.join(timeout=5)
        changes += [c for c in process_state.changes(before, process_state.snapshot()) if c.startswith(_AFTER_COLLECTION)]
    if changes:
        process_state.restore(before)
        if not getattr(request.node, "tome_call_failed", False):
            pytest.fail(f"{request.node.nodeid} left the process changed: " + "; ".join(changes), pytrace=False)


@pytest.fixture
def unpatch():
    """`unpatch(model)`: remove the model's ToMe patch when the test ends, however it ends (before the
    process check above runs)."""
    models = []
    yield models.append
    import tomesd

    for model in models:
        tomesd.remove_patch(model)
