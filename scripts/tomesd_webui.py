"""The AUTOMATIC1111 web UI extension: this repository cloned into the web UI's `extensions` folder (Extensions ->
Install from URL). The web UI's own token merging (its three ratio settings and their infotext) then runs this
project's ToMe, with the choices of Settings -> "Token merging (tomesd)": ToDo, the levels that merge (auto makes
SDXL merge), proportional attention, or the recommended setting. On Forge the same settings answer its own token
merging (its TomePatcher) on its UNets and Flux. The logic is tomesd/webui/ (a1111.py, forge.py); this
file is the web UIs' side of it (settings, the script hook, loading the packages from the clone).

The packages load from this clone, so the launcher's reinstall of its pinned tomesd 0.1.3 replaces nothing used
here; that copy stays imported where the web UI imported it, and `modules.sd_models.tomesd` is pointed at this one."""
import importlib.util
import os

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("tomesd_extension_entry", os.path.join(_ROOT, "__init__.py"))
_entry = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_entry)
_entry.load_packages(replace_foreign=True)

import gradio as gr  # noqa: E402
from modules import script_callbacks, scripts, sd_models, shared  # noqa: E402

from tomesd.webui.a1111 import LEVELS, METHODS, PREFIX, WebUIChoice, WebUITomesd, install  # noqa: E402

_SECTION = ("tomesd", "Token merging (tomesd)")
_OPTIONS = {
    "tomesd_method": ("ToMe", "Token merging method (the ratios are the Optimizations page's: above 0 turns it on)",
                      gr.Radio, {"choices": list(METHODS)}, "Token merging method"),
    "tomesd_levels": ("auto", "Levels that merge (max_downsample; auto: 1 on SD1/SD2, 2 on SDXL)", gr.Radio,
                      {"choices": list(LEVELS)}, "Token merging levels"),
    "tomesd_proportional_attention": (False, "Proportional attention (ToMe: closer to the unmerged model)",
                                      gr.Checkbox, {}, "Token merging proportional attention"),
    "tomesd_todo_factor": (2, "ToDo factor per side", gr.Slider, {"minimum": 1, "maximum": 4, "step": 1},
                           "Token downsampling factor"),
}
_pass = {"p": None}  # the generation under way (before_process), whose pass the patch is made for


def _size():
    """The pass's image size (the high-res pass's once it runs): recommend picks by it."""
    p = _pass["p"]
    if p is None:
        return None
    if getattr(p, "is_hr_pass", False) and getattr(p, "hr_upscale_to_x", 0):
        return (p.hr_upscale_to_y, p.hr_upscale_to_x)
    return (p.height, p.width)


def _choice() -> WebUIChoice:
    data = shared.opts.data
    return WebUIChoice(method=data.get("tomesd_method", "ToMe"), levels=str(data.get("tomesd_levels", "auto")),
                       proportional_attention=bool(data.get("tomesd_proportional_attention", False)),
                       todo_factor=int(data.get("tomesd_todo_factor", 2)))


def _unweighed_attention():
    """A1111's cross-attention optimization where it makes no torch SDPA call (proportional attention needs one)."""
    from modules import sd_hijack

    name = getattr(sd_hijack.model_hijack, "optimization_method", None)
    return None if name in ("sdp", "sdp-no-mem") else (name or "its plain attention (no optimization)")


_webui_tomesd = WebUITomesd(_choice, size=_size, attention=_unweighed_attention)
_forge_patcher = None
try:  # A1111: its sd_models.tomesd, called by its apply_token_merging
    install(sd_models, _webui_tomesd)
except RuntimeError:
    try:  # Forge: its backend.misc.tomesd.TomePatcher, looked up at each pass
        import backend.misc.tomesd as _forge_misc
        from tomesd.webui.forge import forge_tome_patcher, install as install_forge

        _forge_patcher = forge_tome_patcher(_choice, size=_size)
        install_forge(_forge_misc, _forge_patcher)
    except (ImportError, RuntimeError) as refusal:
        print(f"{PREFIX} this web UI calls no token merging the extension can answer ({refusal}): it does nothing")


def _on_ui_settings() -> None:
    for key, (default, label, component, args, infotext) in _OPTIONS.items():
        shared.opts.add_option(key, shared.OptionInfo(default, label, component, args, section=_SECTION,
                                                      infotext=infotext))


script_callbacks.on_ui_settings(_on_ui_settings)


class Script(scripts.Script):
    def title(self):
        return "tomesd"

    def show(self, is_img2img):
        return scripts.AlwaysVisible

    def before_process(self, p, *args):  # before the web UI's first apply_token_merging of this generation
        _pass["p"] = p
        if _forge_patcher is None:
            _webui_tomesd.refresh(p.sd_model)

    def process(self, p, *args):
        merging = p.get_token_merging_ratio() > 0 or (getattr(p, "enable_hr", False)
                                                      and p.get_token_merging_ratio(for_hr=True) > 0)
        if merging:
            p.extra_generation_params.update(_choice().infotext())

    def process_before_every_sampling(self, p, *args, **kwargs):  # Forge: after its built-in extensions' own
        if _forge_patcher is None or p.get_token_merging_ratio(for_hr=getattr(p, "is_hr_pass", False)) <= 0:
            return
        from tomesd.webui.forge import rechain

        p.sd_model.forge_objects.unet = rechain(p.sd_model.forge_objects.unet, _forge_patcher.last)
