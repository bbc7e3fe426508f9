import gc
import os
import sys

import pytest

# Tests import their helpers (references, models) from this folder.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# `make test` runs two pytest-xdist workers on a 2-core machine: each computes on one thread (set before torch
# or paddle is imported), so the two never fight over the cores.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def _process_state():
    """What a test may change in the process and must give back: ToMe patches whose hooks are on a model,
    users of the attention dispatch seam, diffusers' attention-backend registry (each backend's function and
    the active one), grad mode and the default dtype. Only what is already imported is looked at (the core's
    environment has no torch)."""
    state = {}
    runtime = sys.modules.get("tomesd.runtime.tome_patch")
    if runtime is not None:
        state["ToMe patches still hooked on a model"] = sorted(
            f"{type(patch.root).__name__} (id {id(patch.root)})" for patch in list(runtime.HOOKED))
    dispatch = sys.modules.get("tomesd.backends.torch_dispatch")
    if dispatch is not None:
        state["users of the attention dispatch seam"] = len(dispatch.SEAM._users)
    sdpa = sys.modules.get("tomesd.backends.torch_sdpa")
    if sdpa is not None:
        state["users of the SDPA seam"] = len(sdpa.SDPA_SEAM._users)
        state["torch's scaled_dot_product_attention"] = type(sys.modules["torch"].nn.functional.scaled_dot_product_attention).__name__
    attention = sys.modules.get("diffusers.models.attention_dispatch")
    registry = getattr(attention, "_AttentionBackendRegistry", None)
    if registry is not None and hasattr(registry, "_backends"):
        state["diffusers' attention backends"] = {name: id(fn) for name, fn in registry._backends.items()}
        state["diffusers' active attention backend"] = str(getattr(registry, "_active_backend", None))
    torch = sys.modules.get("torch")
    if torch is not None:
        state["grad mode"] = torch.is_grad_enabled()
        state["default dtype"] = str(torch.get_default_dtype())
    # tests/torch and tests/paddle sit on sys.path's `tests` folder: where a framework is not installed, an
    # `import paddle` that a test triggers (a refusal's probe) imports the folder as a namespace package, which
    # libraries that look in sys.modules (einops) then take for the framework.
    state["test folders imported as a framework"] = sorted(
        name for name in ("torch", "paddle") if name in sys.modules and getattr(sys.modules[name], "__file__", 1) is None)
    # An import that failed half-way (a dependency stubbed out by a test) drops the package but leaves its
    # submodules, which hold the dropped package: the next import of it then fails in any later test.
    state["packages left half-imported"] = _half_imported()
    paddle = sys.modules.get("paddle")
    if callable(getattr(paddle, "is_grad_enabled", None)):  # (some tests stand a stub in for paddle)
        state["paddle grad mode"] = paddle.is_grad_enabled()
    return state


def _half_imported():
    return sorted({name.split(".")[0] for name in list(sys.modules)
                   if "." in name and sys.modules.get(name.split(".")[0]) is None})


_STRICT = ("packages left half-imported", "test folders imported as a framework", "users of the attention dispatch seam",
           "diffusers' attention backends", "users of the SDPA seam",
           "torch's scaled_dot_product_attention")


def _changes(before, after):
    return [f"{key}: {before.get(key)!r} -> {after[key]!r}" for key in after
            if key in before and before[key] != after[key]]


@pytest.fixture(autouse=True)
def leaves_the_process_as_it_found_it(request):
    """Fails the test that leaves a patch hooked, the dispatch seam in use, diffusers' attention registry or
    a global mode changed (a collected model's patch does not count), then restores what it can, so the
    next test starts clean whatever this one did."""
    before = _process_state()
    yield
    after = _process_state()
    # diffusers' registry is process-wide: a wrapper left in it until some later collection changes the tests
    # after this one, so it counts before any collection. A dropped patched model's hooks do not.
    changes = [change for change in _changes(before, after) if change.startswith(_STRICT)]
    if _changes(before, after):
        gc.collect()
        changes += [change for change in _changes(before, _process_state()) if not change.startswith(_STRICT)]
    if changes:
        _restore(before)
        pytest.fail(f"{request.node.nodeid} left the process changed: " + "; ".join(changes), pytrace=False)


def _restore(before):
    for package in _half_imported():
        for name in [n for n in sys.modules if n.startswith(package + ".")]:
            del sys.modules[name]
    for name in ("torch", "paddle"):
        if name in sys.modules and getattr(sys.modules[name], "__file__", 1) is None:
            del sys.modules[name]
    runtime = sys.modules.get("tomesd.runtime.tome_patch")
    if runtime is not None:
        for patch in list(runtime.HOOKED):
            patch.remove()
    torch = sys.modules.get("torch")
    if torch is not None and "grad mode" in before:
        torch.set_grad_enabled(before["grad mode"])
        torch.set_default_dtype(getattr(torch, before["default dtype"].split(".")[-1]))
    paddle = sys.modules.get("paddle")
    if "paddle grad mode" in before and callable(getattr(paddle, "set_grad_enabled", None)):
        paddle.set_grad_enabled(before["paddle grad mode"])


@pytest.fixture
def unpatch():
    """`unpatch(model)`: remove the model's ToMe patch when the test ends, however it ends (before the
    process check above runs)."""
    models = []
    yield models.append
    import tomesd

    for model in models:
        tomesd.remove_patch(model)
