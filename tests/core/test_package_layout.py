"""The package's layout by concern (docs/architecture.md): each layer imports only from the layers below it, no
folder grows into a heap, and the family registry finds a family from its module alone."""
from __future__ import annotations

import ast
import importlib
import pathlib
import re
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

# Lower rank: imported by higher ranks, never importing them. The package root (tomesd/__init__.py) is the facade
# over all of them and is left out.
RANKS = (
    ("tome_core", 0),
    ("tomesd.backends", 1),
    ("tomesd.layouts", 2),
    ("tomesd.families", 3),
    ("tomesd.runtime", 4),
    ("tomesd.hosts", 5),
    ("tomesd.config", 6), ("tomesd.patch", 6), ("tomesd.merge", 6),
    # the rest of tomesd 0.1.3's module surface (tomesd.patch's other functions, tomesd.utils)
    ("tomesd.compat013", 6), ("tomesd.utils", 6),
    # front-ends on the public API: ppdiffusers' pipe.apply_tome(), ComfyUI's node pack, the web UIs' extension
    ("tomesd.apply_tome", 7), ("tomesd.comfyui", 7), ("tomesd.recommend", 7), ("tomesd.webui", 7),
    # the device-time model (a forward's kernels priced per GPU); its fit traces the bench's configurations
    ("tomesd.devicetime", 7), ("tomesd.devicetime.fit", 8), ("tomesd.devicetime.picks", 8),
    ("tomesd.devicetime.__main__", 8),
    ("tomesd.bench", 8), ("tomesd.quality", 8), ("tomesd.tune", 8), ("tomesd.frontier", 8), ("tomesd.cli", 8),
    ("tomesd.__main__", 8),
)


def rank(module: str) -> int:
    """The rank of the longest prefix of `module` in RANKS."""
    prefixes = [prefix for prefix, _ in RANKS if module == prefix or module.startswith(prefix + ".")]
    assert prefixes, f"{module} has no rank in RANKS: give its folder one"
    best = max(prefixes, key=len)
    return dict(RANKS)[best]


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(text: str, name: str, is_package: bool = False):
    """(imported module, line) for every import in module `name`'s source, function-level ones too, relative ones
    resolved; `from X import y` counts as importing X.y where y is a module of package X, else X."""
    package = name if is_package else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                anchor = ".".join(parts[:len(parts) - node.level + 1])
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                submodule = ROOT.joinpath(*f"{base}.{alias.name}".split("."))
                known = submodule.with_suffix(".py").exists() or (submodule / "__init__.py").exists()
                yield (f"{base}.{alias.name}" if known else base), node.lineno


def upward_imports(text: str, name: str, is_package: bool = False):
    return [(target, line) for target, line in imports_of(text, name, is_package)
            if target.startswith(("tomesd.", "tome_core")) and rank(target) > rank(name)]


def project_files():
    for top in ("tome_core", "tomesd"):
        yield from sorted((ROOT / top).rglob("*.py"))


def test_every_module_imports_none_above_its_layer():
    found = []
    for path in project_files():
        name = module_name(path)
        if name == "tomesd":  # the facade
            continue
        for target, line in upward_imports(path.read_text(), name, path.name == "__init__.py"):
            found.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    assert not found, "imports running upward:\n" + "\n".join(found)


def test_an_import_running_upward_is_seen():
    """The check above on sources that break the rule: a layout importing the runtime, a family the runtime."""
    assert upward_imports("from ..runtime import calls\n", "tomesd.layouts.grids") == [("tomesd.runtime.calls", 1)]
    assert upward_imports("def f():\n    from ...runtime.sites import SiteHook\n",
                          "tomesd.families.image.flux") == [("tomesd.runtime.sites", 2)]
    assert upward_imports("from ..families import root_kind\n", "tomesd.runtime.sites") == []


def test_no_folder_is_a_heap_and_no_module_is_named_after_a_version():
    for folder in [ROOT / "tome_core"] + [p for p in (ROOT / "tomesd").rglob("*") if p.is_dir()]:
        modules = [p for p in folder.glob("*.py") if p.name != "__init__.py"]
        assert len(modules) <= 16, f"{folder.relative_to(ROOT)} holds {len(modules)} modules"
        for module in modules:  # kinds_diffusers_0_42.py said when it was written, not what it holds
            assert not re.search(r"_\d+_\d+", module.stem), module


def test_the_registry_finds_a_new_family_from_its_module_alone(tmp_path, monkeypatch):
    families = importlib.import_module("tomesd.families")
    image = importlib.import_module("tomesd.families.image")
    name = "tomesd.families.image.toy_family"
    folder = tmp_path / "extra"
    folder.mkdir()
    (folder / "toy_family.py").write_text(textwrap.dedent('''
        from tomesd.layouts.entries import BlockKind, Downsample, RootKind, Sublayer

        BLOCK_KINDS = (BlockKind("ToyTransformerBlock", sublayers=(Sublayer("attn", "merge_attn"),),
                                 downsample=(Downsample("attn", "context"),)),)
        ROOT_KINDS = (RootKind("Toy", ("ToyTransformer2DModel",), "patches", supported="the Toy transformer"),)
    '''))
    monkeypatch.setattr(image, "__path__", list(image.__path__) + [str(folder)])
    try:
        modules = families._family_modules()
        assert name in [m.__name__ for m in modules]
        monkeypatch.setattr(families, "FAMILY_MODULES", modules)
        blocks, roots, _, _, _ = families._gather()
        assert "ToyTransformerBlock" in blocks and "Toy" in [kind.family for kind in roots]
    finally:
        sys.modules.pop(name, None)


def test_the_registry_refuses_a_block_kind_declared_twice_an_unknown_layout_and_an_unplaced_sequence(monkeypatch):
    families = importlib.import_module("tomesd.families")
    entries = importlib.import_module("tomesd.layouts.entries")

    class Twice:
        __name__ = "twice"
        BLOCK_KINDS = (families.BLOCK_KINDS["BasicTransformerBlock"],)

    monkeypatch.setattr(families, "FAMILY_MODULES", families.FAMILY_MODULES + (Twice,))
    with pytest.raises(ValueError, match="BasicTransformerBlock is declared by"):
        families._gather()

    class Unknown:
        __name__ = "unknown"
        ROOT_KINDS = (entries.RootKind("Nowhere", ("NowhereModel",), "no_such_layout"),)

    monkeypatch.setattr(families, "FAMILY_MODULES", families.FAMILY_MODULES[:-1] + (Unknown,))
    with pytest.raises(ValueError, match="names layout 'no_such_layout'"):
        families._gather()

    class Unplaced:  # a unified sequence says where its image is: the runtime reads it at every call's blocks
        __name__ = "unplaced"
        ROOT_KINDS = (entries.RootKind("Unplaced", ("UnplacedModel",), "unified"),)

    monkeypatch.setattr(families, "FAMILY_MODULES", families.FAMILY_MODULES[:-1] + (Unplaced,))
    with pytest.raises(ValueError, match="layout 'unified' but no sequence"):
        families._gather()
