"""The AUTOMATIC1111 web UI's token merging answered by this project (the extension: scripts/tomesd_webui.py).

A1111 keeps its own token merging: three ratio settings (txt2img, img2img, high-res pass), their infotext, and
`modules.sd_models.apply_token_merging`, which per pass calls `tomesd.remove_patch(sd_model)` and
`tomesd.apply_patch(sd_model, ratio=r, use_rand=False, merge_attn=True, merge_crossattn=False, merge_mlp=False)` on
the module it imported as `tomesd`. The extension points that one name at a `WebUITomesd`, which takes the web UI's
call with the user's choice of this project's settings (`WebUIChoice`: ToMe, ToDo or the recommended setting, the
levels that merge, proportional attention). What the model cannot run is said in one console line and the pass runs
unpatched, with nothing left on the model."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Optional, Tuple

METHODS = ("ToMe", "ToDo", "recommended")
LEVELS = ("auto", "1", "2", "4", "8")
PREFIX = "[tomesd]"
# What this project raises for a model or setting it cannot run (recommend's NoRecommendation is a LookupError): a web
# UI says it in one line and runs the pass without ToMe.
REFUSALS = (ValueError, TypeError, LookupError, RuntimeError)


@dataclasses.dataclass(frozen=True)
class WebUIChoice:
    """The extension's settings, as the web UI's settings page holds them."""
    method: str = "ToMe"  # ToMe: the web UI's ratio; ToDo: its ratio above 0 turns ToDo on; recommended: tomesd.recommend
    levels: str = "auto"  # max_downsample; auto: this project's default (1 on SD1/SD2, 2 on SDXL, where 1 merges nothing)
    proportional_attention: bool = False
    todo_factor: int = 2

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"token merging method {self.method!r}: one of {', '.join(METHODS)}")
        if str(self.levels) not in LEVELS:
            raise ValueError(f"token merging levels {self.levels!r}: one of {', '.join(LEVELS)}")

    def infotext(self) -> Dict[str, Any]:
        """What differs from plain ToMe, for the generation's parameters (the ratio is the web UI's own)."""
        found: Dict[str, Any] = {}
        if self.method != "ToMe":
            found["Token merging method"] = self.method
        if self.method == "ToDo" and self.todo_factor != 2:
            found["Token downsampling factor"] = self.todo_factor
        if str(self.levels) != "auto" and self.method != "recommended":
            found["Token merging levels"] = int(self.levels)
        if self.proportional_attention and self.method == "ToMe":
            found["Token merging proportional attention"] = True
        return found


class WebUITomesd:
    """Stands where the web UI's `tomesd` module stood: `apply_patch` and `remove_patch` as the web UI calls them,
    every other name of this project's `tomesd`."""

    def __init__(self, choice: Callable[[], WebUIChoice], size: Callable[[], Optional[Tuple[int, int]]] = lambda: None,
                 say: Callable[[str], None] = print, attention: Callable[[], Optional[str]] = lambda: None) -> None:
        import tomesd

        self._tomesd = tomesd
        self._choice = choice
        self._size = size
        self._say = say
        self._attention = attention  # the web UI's attention where it cannot weigh merged keys (see choice_arguments)
        self._applied: Optional[tuple] = None  # what the patch on the model was made for (refresh)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tomesd, name)

    def apply_patch(self, model: Any, ratio: float = 0.5, **webui_arguments: Any) -> Any:
        self._applied = self._made_for()
        try:
            arguments = self.arguments(model, ratio, webui_arguments)
            self._tomesd.apply_patch(model, **arguments)
        except REFUSALS as refusal:
            self._tomesd.remove_patch(model)
            self._say(refusal_line(refusal))
        return model

    def refresh(self, model: Any) -> None:
        """Before a generation: the web UI patches again only when its ratio changes, so a patch made for another
        choice (or, for the recommended setting, another size) is taken off, and the web UI's next pass patches anew."""
        if getattr(model, "applied_token_merged_ratio", 0) and self._applied != self._made_for():
            self._tomesd.remove_patch(model)
            model.applied_token_merged_ratio = 0

    def _made_for(self) -> tuple:
        choice = self._choice()
        return (choice, self._size()) if choice.method == "recommended" else (choice,)

    def remove_patch(self, model: Any) -> Any:
        return self._tomesd.remove_patch(model)

    def arguments(self, model: Any, ratio: float, webui_arguments: Dict[str, Any]) -> Dict[str, Any]:
        """This project's `apply_patch` arguments for the web UI's call under the current choice."""
        return choice_arguments(self._choice(), ratio, webui_arguments,
                                family=lambda: "sdxl" if _is_sdxl(model) else "sd1", device=lambda: _device_of(model),
                                size=self._size, attention=self._attention)


def choice_arguments(choice: WebUIChoice, ratio: float, webui_arguments: Dict[str, Any], family: Callable[[], str],
                     device: Callable[[], str], size: Callable[[], Optional[Tuple[int, int]]],
                     attention: Callable[[], Optional[str]] = lambda: None) -> Dict[str, Any]:
    """`apply_patch` arguments for a web UI's ratio (and the arguments its call gave) under `choice`; the model's
    facts are asked for only where the choice needs them (the recommended setting: family, device and size; it keeps
    the web UI's use_rand, which A1111 fixes at False).
    `attention` names the web UI's attention where it makes no call of torch's SDPA, which weighs merged keys
    (xformers, sub-quadratic, ...; None where it does): proportional attention is refused there, before the pass,
    instead of at its first call."""
    import tomesd

    levels = None if str(choice.levels) == "auto" else int(choice.levels)
    if choice.method == "recommended":
        config = tomesd.recommend(family=family(), size=size(), device=device())
        if isinstance(config, tomesd.ToMeConfig) and "use_rand" in webui_arguments:
            config = dataclasses.replace(config, use_rand=webui_arguments["use_rand"])
        return dict(config=config)
    if choice.method == "ToDo":
        return dict(mode="downsample", downsample_factor=choice.todo_factor, max_downsample=levels)
    arguments = dict(webui_arguments, ratio=ratio)
    if levels is not None:
        arguments["max_downsample"] = levels
    if choice.proportional_attention:
        unweighed = attention()
        if unweighed:
            raise ValueError(f"proportional attention needs torch's SDPA, and this web UI's attention is {unweighed}: "
                             f"pick sdp in Settings -> Optimizations (Forge: its pytorch attention), or turn "
                             f"proportional attention off")
        arguments["proportional_attention"] = True
    return arguments


def _is_sdxl(model: Any) -> bool:
    """A1111 marks its models (`is_sdxl`); an SGM model holding a `conditioner` is one too."""
    return bool(getattr(model, "is_sdxl", False) or hasattr(model, "conditioner"))


def _device_of(model: Any) -> str:
    for parameter in model.parameters():
        return parameter.device.type
    return "cpu"


def refusal_line(refusal: Exception) -> str:
    return f"{PREFIX} token merging is off for this pass, the generation runs without it: {refusal}"


def install(sd_models: Any, webui_tomesd: WebUITomesd) -> Any:
    """Points the web UI's `sd_models.tomesd` at `webui_tomesd`; returns what it was, for `uninstall`."""
    if not hasattr(sd_models, "apply_token_merging") or not hasattr(sd_models, "tomesd"):
        raise RuntimeError("this web UI's modules.sd_models has no apply_token_merging calling tomesd (Forge's "
                           "apply_token_merging runs its own copy, which tomesd.webui.forge answers)")
    previous = sd_models.tomesd
    _unpatch_loaded(sd_models, previous)  # a model the old module patched: unpatched by it, patched anew next pass
    sd_models.tomesd = webui_tomesd
    return previous


def uninstall(sd_models: Any, previous: Any) -> None:
    _unpatch_loaded(sd_models, sd_models.tomesd)
    sd_models.tomesd = previous


def _unpatch_loaded(sd_models: Any, module: Any) -> None:
    """The web UI's loaded model, if `module` patched it, unpatched and marked so (its next pass patches again)."""
    loaded = getattr(getattr(sd_models, "model_data", None), "sd_model", None)
    if loaded is not None and getattr(loaded, "applied_token_merged_ratio", 0):
        module.remove_patch(loaded)
        loaded.applied_token_merged_ratio = 0
