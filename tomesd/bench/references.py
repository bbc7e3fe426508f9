"""The reference implementations, loaded so they never shadow this project's `tomesd`.

tomesd 0.1.3 is installed by `make` into .refs/tomesd-0.1.3 (pip --target; it is also called
`tomesd`) and loaded from there as the package `tomesd_ref`. ppdiffusers' built-in ToMe is its own
module, run through `tomesd.adapters.ppdiffusers.builtin_methods`.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

_DEFAULT_REFS = Path(__file__).resolve().parents[2] / ".refs"


def refs_dir() -> Path:
    return Path(os.environ.get("TOME_REFS_DIR", _DEFAULT_REFS))


def load_tomesd_ref() -> Any:
    if "tomesd_ref" in sys.modules:
        return sys.modules["tomesd_ref"]
    init = refs_dir() / "tomesd-0.1.3" / "tomesd" / "__init__.py"
    if not init.exists():
        raise RuntimeError(
            f"reference tomesd 0.1.3 not found at {init}: `make envs` installs it "
            f"(pip install --no-deps --target {refs_dir() / 'tomesd-0.1.3'} tomesd==0.1.3), or set TOME_REFS_DIR"
        )
    spec = importlib.util.spec_from_file_location("tomesd_ref", init, submodule_search_locations=[str(init.parent)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["tomesd_ref"] = module
    spec.loader.exec_module(module)
    return module
