"""ComfyUI's entry to this repository cloned into `custom_nodes` (ComfyUI-Manager, comfy-cli's `node install`, the
Comfy Registry): the node pack of `tomesd/comfyui`, with `tomesd` and `tome_core` taken from this clone. The web UI
extension (scripts/tomesd_webui.py, the same clone in `extensions`) loads its packages through `load_packages` here.

ComfyUI imports this file under a name of its own, from a folder that is not on `sys.path`; so the two packages are
loaded here by their paths, when ComfyUI first asks for the node mappings (so that importing this file as a
package, as pytest does from the repository's root, loads nothing). A `tomesd` already imported is used when it is
this project's (a pip install of it); one of another project (tomesd 0.1.3 has no node pack) is refused by name
rather than shadowed, since whoever imported it holds its modules."""
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_PACKAGES = ("tome_core", "tomesd")


def _load(name: str) -> None:
    folder = os.path.join(_HERE, name)
    spec = importlib.util.spec_from_file_location(name, os.path.join(folder, "__init__.py"),
                                                  submodule_search_locations=[folder])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise


def _is_ours(module) -> bool:
    return any(os.path.isdir(os.path.join(folder, "comfyui")) for folder in getattr(module, "__path__", []))


def _version_of(module) -> str:
    """A module's version: its own attribute, or the metadata installed beside it (tomesd 0.1.3 has no attribute)."""
    if hasattr(module, "__version__"):
        return str(module.__version__)
    import importlib.metadata

    folders = [os.path.dirname(folder) for folder in getattr(module, "__path__", [])]
    for dist in importlib.metadata.distributions(path=folders):
        if dist.metadata["Name"] == module.__name__:
            return dist.version
    return "unknown"


def load_packages(replace_foreign: bool = False) -> None:
    """`tomesd` and `tome_core` from this clone, unless this project's `tomesd` is imported already. A foreign one
    (tomesd 0.1.3) is refused, or with `replace_foreign` forgotten by `sys.modules`: the web UIs import tomesd 0.1.3
    for the one module that the extension then points at this one (its holders keep their module objects)."""
    present = sys.modules.get("tomesd")
    if present is not None and replace_foreign and not _is_ours(present):
        for name in [n for n in sys.modules if n == "tomesd" or n.startswith("tomesd.")]:
            del sys.modules[name]
        present = None
    if present is not None:
        if not _is_ours(present):
            folders = list(getattr(present, "__path__", []))
            raise ImportError(
                f"another tomesd (version {_version_of(present)}, from "
                f"{folders[0] if folders else getattr(present, '__file__', '?')}) is already imported in this ComfyUI, "
                f"so this node pack's tomesd at {_HERE} cannot load beside it: uninstall that one "
                "(`python -m pip uninstall tomesd` in ComfyUI's Python), or install this one there instead "
                f"(`python -m pip install {_HERE}`)")
        return
    for name in _PACKAGES:
        if name not in sys.modules:
            _load(name)


_EXPORTS = ("NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS")
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(name)
    load_packages()
    import tomesd.comfyui.nodes as nodes

    return getattr(nodes, name)
