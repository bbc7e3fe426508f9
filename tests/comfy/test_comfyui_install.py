"""The node pack installed the way ComfyUI users install node packs: this repository's files (what a clone holds)
in a `custom_nodes` folder, found and loaded by ComfyUI 0.3.75's own start-up loader with the code of that copy, its
Comfy Registry table read by ComfyUI's own parser, its requirements as ComfyUI-Manager reads them. Each case runs in
a fresh interpreter, as ComfyUI starts, so that nothing this suite imported stands in for the copy."""
from __future__ import annotations

import json
import re
import os
import shutil
import subprocess
import sys

import pytest

import comfy_host

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REFERENCE_TOMESD = os.path.join(REPO, ".refs", "tomesd-0.1.3")

# In the child: ComfyUI imported as comfy_host does (on CPU, torchvision stubbed), then everything of this project
# it imported on the way is forgotten, so the pack's own loader must bring tomesd and tome_core from the copy.
_START = """
import asyncio, json, logging, os, sys
sys.path.insert(0, {tests!r})
import comfy_host
comfy_host.import_comfy()
for name in [n for n in sys.modules if n.split(".")[0] in ("tomesd", "tome_core")]:
    del sys.modules[name]
if {foreign!r}:
    sys.path.insert(0, {foreign!r})
    import tomesd
    sys.path.remove({foreign!r})
records = []
handler = logging.Handler()
handler.emit = lambda record: records.append(record.getMessage() + (str(record.exc_info[1]) if record.exc_info else ""))
logging.getLogger().addHandler(handler)
logging.getLogger().setLevel(logging.DEBUG)
import folder_paths, nodes
from comfy_config import config_parser  # what ComfyUI's loader imports for every pack
folder_paths.folder_names_and_paths["custom_nodes"] = ([{custom_nodes!r}], set())
before = {{n.split(".")[0] for n in sys.modules}}
asyncio.run(nodes.init_external_custom_nodes())
import importlib.metadata
new = {{n.split(".")[0] for n in sys.modules}} - before - set(sys.stdlib_module_names) - {{"tomesd", "tome_core"}}
distributions = importlib.metadata.packages_distributions()
pack_imports = {{name: distributions.get(name, [name]) for name in sorted(new)
                if not name.startswith("_") and os.sep not in name}}  # ComfyUI names the pack by its path
"""

_RUN = """
import torch
import tomesd
from comfy_config import config_parser
found = {{name: cls for name, cls in nodes.NODE_CLASS_MAPPINGS.items() if name.startswith("Tomesd")}}
node = found["TomesdToMe"]
required = node.INPUT_TYPES()["required"]
inputs = {{k: spec[1]["default"] for k, spec in required.items() if k != "model"}}
model = comfy_host.sd1_patcher()[0]
patched = getattr(node(), node.FUNCTION)(model=model, **inputs)[0]
with tomesd.observe(patched) as seen:
    merged = comfy_host.sample(patched, steps=2)
plain = comfy_host.sample(model, steps=2)
config = config_parser.extract_node_configuration({pack!r})
print(json.dumps(dict(
    nodes=sorted(found), node_files=sorted({{sys.modules[c.__module__].__file__ for c in found.values()}}),
    tomesd=tomesd.__file__, tome_core=sys.modules["tome_core"].__file__,
    changed=float((merged - plain).abs().max()), merged_blocks=sum(len(c.merged_blocks("attn")) for c in seen.calls),
    publisher=config.tool_comfy.publisher_id, display=config.tool_comfy.display_name,
    project=config.project.name, version=config.project.version,
    pack_dependencies=config.project.dependencies, pack_imports=pack_imports,
    log=records)))
"""


@pytest.fixture(scope="module")
def custom_nodes(tmp_path_factory):
    """A `custom_nodes` folder holding this repository's files as a clone has them: the tracked ones and those not
    yet committed that git does not ignore (no environments, no .refs, no caches)."""
    comfy_host.import_comfy()  # the ComfyUI copy exists (make envs)
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, check=True,
                            capture_output=True).stdout.decode().split("\0")
    root = tmp_path_factory.mktemp("comfyui") / "custom_nodes"
    pack = root / "ComfyUI-tomesd"
    for name in filter(None, listed):
        source = os.path.join(REPO, name)
        if os.path.isfile(source):
            os.makedirs(pack / os.path.dirname(name), exist_ok=True)
            shutil.copy2(source, pack / name)
    return root, pack


def _start(custom_nodes, extra: str = "", foreign: str = "") -> dict:
    root, pack = custom_nodes
    script = _START.format(tests=TESTS, custom_nodes=str(root), foreign=foreign) + extra.format(pack=str(pack))
    if not extra:
        script += "print(json.dumps(dict(log=records, nodes=sorted(n for n in nodes.NODE_CLASS_MAPPINGS "
        script += "if n.startswith('Tomesd')))))\n"
    done = subprocess.run([sys.executable, "-c", script], cwd=str(root.parent), capture_output=True, text=True,
                          timeout=600, env=dict(os.environ, PYTHONDONTWRITEBYTECODE="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_comfyuis_start_up_loads_the_pack_from_a_clone_in_custom_nodes(custom_nodes):
    _, pack = custom_nodes
    out = _start(custom_nodes, _RUN)
    assert out["nodes"] == ["TomesdToDo", "TomesdToMe"], out["log"][-5:]
    # the copy's code, not the editable install this suite runs on
    for path in out["node_files"] + [out["tomesd"], out["tome_core"]]:
        assert path.startswith(str(pack) + os.sep), path
    assert out["merged_blocks"] > 0 and out["changed"] > 1e-3
    # the Comfy Registry's table, as ComfyUI's own parser reads it on load
    assert out["project"] == "tomesd" and out["publisher"] and out["display"]
    assert out["version"] == __import__("tomesd").__version__
    # ComfyUI-Manager installs requirements.txt's lines: whatever loading the pack imported (past what ComfyUI had
    # imported by then) comes from ComfyUI's own requirements or from those lines
    assert not out["pack_dependencies"]
    requirements = _names(pack / "requirements.txt") | _names(os.path.join(comfy_host.COMFY_ROOT, "requirements.txt"))
    unlisted = {module: dists for module, dists in out["pack_imports"].items()
                if not {_normal(d) for d in dists} & requirements}
    assert not unlisted, f"the pack imports {unlisted}: list them in requirements.txt"


def _normal(name: str) -> str:
    return name.strip().replace("_", "-").lower()


def _names(path) -> set:
    """A requirements file's distribution names, as pip reads its lines (comments and versions dropped)."""
    with open(path) as f:
        lines = [line.split("#")[0].strip() for line in f]
    return {_normal(re.split(r"[<>=~!\[; ]", line)[0]) for line in lines if line}


def test_a_foreign_tomesd_already_imported_is_refused_by_name(custom_nodes):
    """tomesd 0.1.3 (imported by another pack first) is not shadowed: the pack fails to load, saying what to do."""
    out = _start(custom_nodes, foreign=REFERENCE_TOMESD)
    assert out["nodes"] == []
    said = "\n".join(out["log"])
    assert "another tomesd (version 0.1.3" in said and "pip uninstall tomesd" in said, said
