"""What a test can leave behind in its worker's process, read before and after each test (tests/conftest.py).

Each entry names one kind of process-wide state; a test that changes one fails by name, and the conftest puts it
back so the next test starts as a fresh process would. Only what is already imported is looked at (the core's
environment has no torch), and nothing here imports a framework or triggers a lazy import.

Kinds found leaking in a run of the whole suite (issue 65) are mended where they are made; the global RNGs and
dynamo's compiled code are reset around every test instead, since every test may draw or compile.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Any, Dict, List

# Modules whose functions tests and hosts wrap (a seam's patch, a host's attention registry): a function left
# replaced after a test changes what every later test runs.
WRAPPED_MODULES = (
    "torch.nn.functional", "diffusers.models.attention_dispatch", "diffusers.models.attention_processor",
    "diffusers.models.attention", "comfy.ldm.modules.attention", "comfy.ldm.flux.layers", "comfy.model_management",
    "tomesd",
    "ppdiffusers.models.attention_processor",
)
# Set by pytest for the running test, or by a library the first time it is used (scikit-learn and joblib set
# OpenMP's two on import, torch its inductor cache's folder when first asked for it): no test's doing.
_SET_ON_IMPORT = {"PYTEST_CURRENT_TEST", "KMP_DUPLICATE_LIB_OK", "KMP_INIT_AT_FORK", "TORCHINDUCTOR_CACHE_DIR"}
LOGGERS = ("", "diffusers", "transformers", "torch", "tomesd", "ppdiffusers", "paddle")


def snapshot() -> Dict[str, Any]:
    """{kind of state: its value now}."""
    state: Dict[str, Any] = {}
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
    functions = sys.modules.get("tomesd.backends.torch_function_seam")
    if functions is not None:  # a host function a patch wraps while it uses it (ComfyUI's flux attention)
        state["users of a host function's seam"] = {path: len(seam._users) for path, seam in functions._SEAMS.items()
                                                    if seam._users}
    attention = sys.modules.get("diffusers.models.attention_dispatch")
    registry = getattr(attention, "_AttentionBackendRegistry", None)
    if registry is not None and hasattr(registry, "_backends"):
        state["diffusers' attention backends"] = {name: id(fn) for name, fn in registry._backends.items()}
        state["diffusers' active attention backend"] = str(getattr(registry, "_active_backend", None))
    state["functions replaced in a module"] = _functions()
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "is_grad_enabled"):
        state.update(_torch(torch))
    # tests/torch and tests/paddle sit on sys.path's `tests` folder: where a framework is not installed, an
    # `import paddle` that a test triggers (a refusal's probe) imports the folder as a namespace package, which
    # libraries that look in sys.modules (einops) then take for the framework.
    state["test folders imported as a framework"] = sorted(
        name for name in ("torch", "paddle") if name in sys.modules and getattr(sys.modules[name], "__file__", 1) is None)
    # An import that failed half-way (a dependency stubbed out by a test) drops the package but leaves its
    # submodules, which hold the dropped package: the next import of it then fails in any later test.
    state["packages left half-imported"] = half_imported()
    # A package stood in for by a bare module (a test's stub of torchvision, say) that stays in sys.modules is
    # what every later import of it gets. Real top-level modules all have a spec.
    state["stand-in modules"] = sorted(name for name, module in list(sys.modules.items())
                                       if "." not in name and module is not None and name != "__main__"
                                       and "cython" not in name  # Cython's runtime modules have no spec either
                                       and getattr(module, "__spec__", 0) is None and not hasattr(module, "__file__"))
    state["environment variables"] = {k: v for k, v in os.environ.items() if k not in _SET_ON_IMPORT}
    state["sys.path"] = list(sys.path)
    # Only levels already set: a library sets its logger's level when first used (diffusers, transformers).
    known = logging.Logger.manager.loggerDict
    state["logging levels"] = {name: logging.getLogger(name).level for name in LOGGERS
                               if not name or (isinstance(known.get(name), logging.Logger) and known[name].level)}
    numpy = sys.modules.get("numpy")
    if numpy is not None and hasattr(numpy, "geterr"):
        state["numpy floating-point error handling"] = numpy.geterr()
    paddle = sys.modules.get("paddle")
    if callable(getattr(paddle, "is_grad_enabled", None)):  # (some tests stand a stub in for paddle)
        state["paddle grad mode"] = paddle.is_grad_enabled()
        state["paddle default dtype"] = str(paddle.get_default_dtype())
        state["paddle device"] = str(paddle.device.get_device())
    state["threads left running"] = sorted(t.name for t in threading.enumerate() if not t.daemon and t.is_alive())
    return state


def _torch(torch: Any) -> Dict[str, Any]:
    backends = torch.backends
    state = {
        "grad mode": torch.is_grad_enabled(),
        "inference mode": torch.is_inference_mode_enabled(),
        "anomaly detection": torch.is_anomaly_enabled(),
        "default dtype": str(torch.get_default_dtype()),
        "default device": str(torch.get_default_device()),
        "float32 matmul precision": torch.get_float32_matmul_precision(),
        "deterministic algorithms": (torch.are_deterministic_algorithms_enabled(),
                                     torch.is_deterministic_algorithms_warn_only_enabled()),
        "intra-op threads": torch.get_num_threads(),
        # No getter exists: a denormal times 1.5 is zero only where flush-denormal (FTZ/DAZ) is on.
        "flush denormal": bool((torch.full((1,), 1e-39) * 1.5 == 0).item()),
        "backend flags": {
            "cudnn": (backends.cudnn.enabled, backends.cudnn.benchmark, backends.cudnn.deterministic,
                      backends.cudnn.allow_tf32),
            "cuda matmul": (backends.cuda.matmul.allow_tf32,
                            backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
                            backends.cuda.matmul.allow_bf16_reduced_precision_reduction),
            "sdp kernels": (backends.cuda.flash_sdp_enabled(), backends.cuda.mem_efficient_sdp_enabled(),
                            backends.cuda.math_sdp_enabled(), backends.cuda.cudnn_sdp_enabled()),
            "mkldnn": backends.mkldnn.enabled,
        },
        "torch's scaled_dot_product_attention": type(torch.nn.functional.scaled_dot_product_attention).__name__,
    }
    distributed = getattr(torch, "distributed", None)
    if distributed is not None and distributed.is_available():
        state["torch.distributed process group"] = distributed.is_initialized()
    for name in ("torch._dynamo.config", "torch._inductor.config", "torch._functorch.config"):
        config = sys.modules.get(name)
        if config is not None and hasattr(config, "get_config_copy"):
            state[name] = repr(sorted(config.get_config_copy().items()))
    return state


def _functions() -> Dict[str, Dict[str, Any]]:
    found = {}
    for name in WRAPPED_MODULES:
        module = sys.modules.get(name)
        if module is not None:  # vars(), not getattr: a lazy module (diffusers') imports nothing for it
            found[name] = {key: value for key, value in list(vars(module).items())
                           if callable(value) and not key.startswith("__") and not isinstance(value, type(sys))}
    return found


def half_imported() -> List[str]:
    return sorted({name.split(".")[0] for name in list(sys.modules)
                   if "." in name and sys.modules.get(name.split(".")[0]) is None})


def changes(before: Dict[str, Any], after: Dict[str, Any]) -> List[str]:
    """One line per kind that differs, naming what changed (for a dict: the keys that differ)."""
    lines = []
    for key, value in after.items():
        if key not in before or before[key] == value:
            continue
        if key == "functions replaced in a module":  # a name a new import added is no replacement
            diff = sorted(f"{module}.{name}" for module, names in value.items() for name, fn in names.items()
                          if before[key].get(module, {}).get(name, fn) is not fn)
            if diff:
                lines.append(f"{key}: {diff[:8]!r}")
        elif key == "logging levels":  # a logger first set up during the test is no change
            diff = sorted(name for name, level in before[key].items() if value.get(name) != level)
            if diff:
                lines.append(f"{key}: {diff!r} changed")
        elif isinstance(value, dict) and isinstance(before[key], dict):
            diff = sorted(k for k in set(value) | set(before[key]) if value.get(k, None) != before[key].get(k, None))
            lines.append(f"{key}: {diff[:8]!r} changed")
        else:
            lines.append(f"{key}: {_short(before[key])} -> {_short(value)}")
    return lines


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) < 300 else text[:300] + "..."


def restore(before: Dict[str, Any]) -> None:
    """Puts back what can be put back of `before`, so that the next test starts clean whatever this one did."""
    for package in half_imported():
        for name in [n for n in sys.modules if n.startswith(package + ".")]:
            del sys.modules[name]
    for name in ("torch", "paddle"):
        if name in sys.modules and getattr(sys.modules[name], "__file__", 1) is None:
            del sys.modules[name]
    for name in set(snapshot()["stand-in modules"]) - set(before.get("stand-in modules", ())):
        sys.modules.pop(name, None)
    runtime = sys.modules.get("tomesd.runtime.tome_patch")
    if runtime is not None:
        for patch in list(runtime.HOOKED):
            patch.remove()
    for module, names in before.get("functions replaced in a module", {}).items():
        if module in sys.modules:
            for name, fn in names.items():
                if vars(sys.modules[module]).get(name, fn) is not fn:
                    setattr(sys.modules[module], name, fn)
    if "environment variables" in before:
        for name in set(os.environ) - set(before["environment variables"]) - _SET_ON_IMPORT:
            del os.environ[name]
        os.environ.update(before["environment variables"])
    if "sys.path" in before:
        sys.path[:] = before["sys.path"]
    for name, level in before.get("logging levels", {}).items():
        logging.getLogger(name).setLevel(level)
    torch = sys.modules.get("torch")
    if torch is not None and "grad mode" in before:
        torch.set_grad_enabled(before["grad mode"])
        torch.set_default_dtype(getattr(torch, before["default dtype"].split(".")[-1]))
        torch.set_default_device(None if before["default device"] == "cpu" else before["default device"])
        torch.set_float32_matmul_precision(before["float32 matmul precision"])
        torch.use_deterministic_algorithms(*before["deterministic algorithms"][:1],
                                           warn_only=before["deterministic algorithms"][1])
        torch.set_num_threads(before["intra-op threads"])
        torch.set_flush_denormal(before["flush denormal"])
        torch.autograd.set_detect_anomaly(before["anomaly detection"])
    numpy = sys.modules.get("numpy")
    if numpy is not None and "numpy floating-point error handling" in before:
        numpy.seterr(**before["numpy floating-point error handling"])
    paddle = sys.modules.get("paddle")
    if "paddle grad mode" in before and callable(getattr(paddle, "set_grad_enabled", None)):
        paddle.set_grad_enabled(before["paddle grad mode"])
        paddle.set_default_dtype(before["paddle default dtype"])


def seed_global_rngs() -> None:
    """Every global RNG a test could draw from, seeded as a fresh process would be: a test that draws from one
    (a model built without a generator) then gets the same numbers whichever tests ran before it."""
    import random

    random.seed(0)
    numpy = sys.modules.get("numpy")
    if numpy is not None and hasattr(numpy, "random"):
        numpy.random.seed(0)
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "manual_seed"):
        torch.manual_seed(0)
    paddle = sys.modules.get("paddle")
    if callable(getattr(paddle, "seed", None)):
        paddle.seed(0)


def compiled_graphs() -> int:
    """How many graphs dynamo has compiled in this process so far (0 where dynamo is not imported)."""
    utils = sys.modules.get("torch._dynamo.utils")
    counters = getattr(utils, "counters", None)
    return 0 if counters is None else int(counters["stats"]["unique_graphs"])


def forget_compiled_code() -> None:
    """dynamo's caches cleared: code compiled in one test (ToMe's hooks are the same code objects in every
    model) would count towards the next test's recompile limit, where fullgraph=True raises."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch._dynamo.reset()
