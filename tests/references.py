"""The reference implementations, loaded so they never shadow this project's `tomesd`.

tomesd 0.1.3 is installed by the Makefile into .refs/tomesd-0.1.3 (pip --target) and loaded
here as the package `tomesd_ref`; ppdiffusers' ToMe is its own module.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

REFS = Path(os.environ.get("TOME_REFS_DIR", Path(__file__).resolve().parent.parent / ".refs"))


def load_tomesd_ref():
    if "tomesd_ref" in sys.modules:
        return sys.modules["tomesd_ref"]
    init = REFS / "tomesd-0.1.3" / "tomesd" / "__init__.py"
    if not init.exists():
        raise RuntimeError(f"reference tomesd 0.1.3 not found at {init}: run `make test` (it installs it)")
    spec = importlib.util.spec_from_file_location("tomesd_ref", init, submodule_search_locations=[str(init.parent)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["tomesd_ref"] = module
    spec.loader.exec_module(module)
    return module
