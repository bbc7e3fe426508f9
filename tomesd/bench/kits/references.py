"""The reference implementations, loaded so they never shadow this project's `tomesd`.

tomesd 0.1.3 is installed by `make` into .refs/tomesd-0.1.3 (pip --target; it is also called
`tomesd`) and loaded from there as the package `tomesd_ref`; the .refs folder is looked up in
$TOME_REFS_DIR, then ./.refs, then the source checkout. ppdiffusers' built-in ToMe is its own
module, run through `tomesd.apply_tome.builtin_methods`.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any, List

REF_FOLDER = "tomesd-0.1.3"
# A source checkout's .refs (made by `make envs`); an installed wheel has none.
_CHECKOUT_REFS = Path(__file__).resolve().parents[3] / ".refs"


def refs_candidates() -> List[Path]:
    """Where the references are looked for, in order: $TOME_REFS_DIR, ./.refs under the current
    working directory, then the source checkout's .refs."""
    places = []
    if os.environ.get("TOME_REFS_DIR"):
        places.append(Path(os.environ["TOME_REFS_DIR"]))
    places += [Path.cwd() / ".refs", _CHECKOUT_REFS]
    unique: List[Path] = []
    for place in places:
        if place.resolve() not in [u.resolve() for u in unique]:
            unique.append(place)
    return unique


def find_tomesd_ref() -> Path:
    """The reference's `tomesd/__init__.py` in the first place that has it; RuntimeError listing them all."""
    places = refs_candidates()
    for place in places:
        init = place / REF_FOLDER / "tomesd" / "__init__.py"
        if init.is_file():
            return init
    looked = "\n".join(f"  {place / REF_FOLDER}" for place in places)
    raise RuntimeError(
        f"reference tomesd 0.1.3 not found; looked in (TOME_REFS_DIR, ./.refs, the source checkout's .refs):\n{looked}\n"
        f"`make envs` installs it in a checkout, or: pip install --no-deps --target .refs/{REF_FOLDER} tomesd==0.1.3 "
        f"(or set TOME_REFS_DIR to a folder holding {REF_FOLDER}/)"
    )


def refs_dir() -> Path:
    """The folder holding tomesd-0.1.3/ (see refs_candidates)."""
    return find_tomesd_ref().parents[2]


def load_tomesd_ref() -> Any:
    if "tomesd_ref" in sys.modules:
        return sys.modules["tomesd_ref"]
    init = find_tomesd_ref()
    spec = importlib.util.spec_from_file_location("tomesd_ref", init, submodule_search_locations=[str(init.parent)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["tomesd_ref"] = module
    spec.loader.exec_module(module)
    return module
