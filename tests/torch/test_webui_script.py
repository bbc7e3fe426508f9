"""The extension's script (scripts/tomesd_webui.py) loaded as the web UIs load an extension's scripts (by file path),
in a fresh interpreter where tomesd 0.1.3 is installed and imported first, as A1111's sd_models imports it. The web
UI's modules it uses (gradio, modules.scripts, script_callbacks, shared, sd_models, sd_hijack; Forge's
backend.misc.tomesd) are stand-ins with the names and signatures the script calls: the web UIs are not installable."""
from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TESTS = os.path.join(REPO, "tests")
REFERENCE = os.path.join(REPO, ".refs", "tomesd-0.1.3")

_WEB_UI = """
import importlib.metadata, importlib.util, json, sys, types
sys.path[:0] = [{reference!r}, {tests!r}]
import tomesd as shipped  # the web UI's pinned tomesd 0.1.3, imported by its sd_models
assert not hasattr(shipped, "__version__")

def module(name, **names):
    m = types.ModuleType(name)
    m.__dict__.update(names)
    sys.modules[name] = m
    return m

class Component:
    def __init__(self, *a, **k): pass

module("gradio", Radio=Component, Checkbox=Component, Slider=Component)
class OptionInfo:
    def __init__(self, default=None, label="", component=None, component_args=None, onchange=None, section=None,
                 refresh=None, comment_before="", comment_after="", infotext=None):
        self.default, self.section, self.infotext = default, section, infotext
class Options:
    def __init__(self):
        self.data, self.infos = {{}}, {{}}
    def add_option(self, key, info):
        self.infos[key] = info
        self.data.setdefault(key, info.default)
callbacks = []
class Script:
    pass
modules = module("modules")
modules.__path__ = []
shared = module("modules.shared", OptionInfo=OptionInfo, opts=Options())
module("modules.scripts", Script=Script, AlwaysVisible=object())
module("modules.script_callbacks", on_ui_settings=callbacks.append)
module("modules.sd_hijack", model_hijack=types.SimpleNamespace(optimization_method="sdp"))
if {forge!r}:
    module("modules.sd_models", apply_token_merging=lambda sd_model, ratio: None)
    for name in ("backend", "backend.misc"):
        module(name).__path__ = []
    class ForgesOwn:
        pass
    misc = module("backend.misc.tomesd", TomePatcher=ForgesOwn)
else:
    sd_models = module("modules.sd_models", tomesd=shipped, apply_token_merging=None,
                       model_data=types.SimpleNamespace(sd_model=None))
for name in ("scripts", "script_callbacks", "sd_models", "shared", "sd_hijack"):
    setattr(modules, name, sys.modules["modules." + name])

path = {script!r}
spec = importlib.util.spec_from_file_location("tomesd_webui.py", path)  # as the web UIs' script_loading does
script = importlib.util.module_from_spec(spec)
spec.loader.exec_module(script)
for callback in callbacks:
    callback()
import tomesd
out = dict(ours=getattr(sys.modules["tomesd"], "__version__", None), tomesd_file=tomesd.__file__,
           installed=importlib.metadata.version("tomesd"),
           options={{k: [i.default, i.section[0], i.infotext] for k, i in shared.opts.infos.items()}})
if {forge!r}:
    out["forge_patcher"] = misc.TomePatcher.__module__
    unet = types.SimpleNamespace(model_options={{"model_function_wrapper": lambda apply_model, params: None}})
    p = types.SimpleNamespace(get_token_merging_ratio=lambda for_hr=False: 0.5, is_hr_pass=False,
                              sd_model=types.SimpleNamespace(forge_objects=types.SimpleNamespace(unet=unet)))
    script.Script().before_process(p)
    script.Script().process_before_every_sampling(p)  # no patch this pass: the UNet patcher stays as it was
    out["unet_kept"] = p.sd_model.forge_objects.unet is unet
else:
    out["answered_by"] = type(sd_models.tomesd).__name__
    import tiny_torch as T, torch
    model, (x, t, c) = T.ldm_model(), T.unet_inputs(2, 16, 16)
    run = lambda: model.model.diffusion_model(x, t.expand(2), c)
    with torch.no_grad():
        plain = run()
        shared.opts.data["tomesd_method"] = "ToDo"
        p = types.SimpleNamespace(height=512, width=512, extra_generation_params={{}},
                                  get_token_merging_ratio=lambda: 0.5)
        script.Script().process(p)
        sd_models.tomesd.apply_patch(model, ratio=0.5, use_rand=False, merge_attn=True, merge_crossattn=False,
                                     merge_mlp=False)
        out["change"] = float((run() - plain).abs().max())
        sd_models.tomesd.remove_patch(model)
        out["removed"] = bool(torch.equal(run(), plain))
    out["infotext"] = p.extra_generation_params
print(json.dumps(out))
"""


def _load(forge: bool) -> dict:
    if not os.path.isdir(REFERENCE):
        raise RuntimeError(f"tomesd 0.1.3 is missing at {REFERENCE}: run `make envs`")
    code = _WEB_UI.format(reference=REFERENCE, tests=TESTS, forge=forge,
                          script=os.path.join(REPO, "scripts", "tomesd_webui.py"))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONDONTWRITEBYTECODE="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a1111_loads_the_extension_over_its_pinned_tomesd():
    out = _load(forge=False)
    assert out["ours"] == "0.2.0" and out["tomesd_file"].startswith(os.path.join(REPO, "tomesd"))
    assert out["installed"] == "0.1.3"  # the launcher's pin is still met: nothing reinstalled
    assert out["answered_by"] == "WebUITomesd"
    assert set(out["options"]) == {"tomesd_method", "tomesd_levels", "tomesd_proportional_attention",
                                   "tomesd_todo_factor"}
    assert all(section == "tomesd" and infotext for _, section, infotext in out["options"].values())
    assert out["change"] > 1e-2 and out["removed"]
    assert out["infotext"] == {"Token merging method": "ToDo"}


def test_forge_loads_the_extension_in_place_of_its_own_patcher():
    out = _load(forge=True)
    assert out["forge_patcher"] == "tomesd.webui.forge" and out["unet_kept"]
    assert len(out["options"]) == 4
