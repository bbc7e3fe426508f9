"""`pipe.apply_tome()` / `remove_tome()` on ppdiffusers pipelines and paddle layers.

ppdiffusers attaches its own copies of these methods to `DiffusionPipeline` and `paddle.nn.Layer`
when it is imported. We replace them with ours right after that: at once if ppdiffusers is
already imported, else through a one-shot import hook, so that neither paddle nor ppdiffusers is
imported on our account.
"""
from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import inspect
import sys
import threading
from typing import Any, Iterator, List, Tuple, Union

from .hosts import targets
from .patch import apply_patch, resolve

_TARGET = "ppdiffusers"
_lock = threading.Lock()
# ppdiffusers' own methods, kept as the reference for parity tests and benchmarks.
BUILTIN: dict = {}


# ppdiffusers' own apply_tome takes these by position, in this order (ppdiffusers/patches/tomesd_patch_utils.py).
POSITIONAL = ("ratio", "max_downsample", "sx", "sy", "use_rand", "merge_attn", "merge_crossattn", "merge_mlp")


def apply_tome(model_or_pipe: Any, *args: Any, config: Any = None, **kwargs: Any) -> Any:
    """ppdiffusers' `apply_tome`, served by this project: `tomesd.apply_patch`'s arguments (its
    signature, below; `config=`, `mode="downsample"`, `reuse_steps` and `share_across_blocks` included)
    and, in merge mode, ppdiffusers' ratio limit. By position only ppdiffusers' own arguments, in its
    order (ratio, max_downsample, sx, sy, use_rand, merge_attn, merge_crossattn, merge_mlp); `seed` and
    the rest by keyword. max_downsample=None reduces at the finest level that has attention (1 on
    SD1/SD2, as ppdiffusers' default of 1). Without `seed`, the random dst pattern uses the fixed
    tome_core.DEFAULT_SEED (0): deterministic, the same as on torch.
    """
    if len(args) > len(POSITIONAL):
        raise TypeError(
            f"apply_tome() takes at most {len(POSITIONAL)} settings by position, ppdiffusers' "
            f"({', '.join(POSITIONAL)}), but {len(args)} were given: give seed and the others by keyword"
        )
    for name, value in zip(POSITIONAL, args):
        if name in kwargs:
            raise TypeError(f"apply_tome() got multiple values for argument {name!r}")
        kwargs[name] = value
    args = resolve(config, kwargs, caller="apply_tome")
    largest = max(dict(args.ratio).values()) if args.per_site else args.ratio
    if args.mode == "merge" and largest >= 1 - 1 / (args.sx * args.sy):
        raise ValueError(f"The tome ratio must be less than {1 - 1 / (args.sx * args.sy)} !")
    return targets.apply(model_or_pipe, args)[0]


def _signature_of_apply_patch() -> inspect.Signature:
    params = list(inspect.signature(apply_patch).parameters.values())
    return inspect.Signature([inspect.Parameter("model_or_pipe", inspect.Parameter.POSITIONAL_OR_KEYWORD)] + params[1:])


apply_tome.__signature__ = _signature_of_apply_patch()  # type: ignore[attr-defined]


def remove_tome(model_or_pipe: Any, only_return_self: bool = True) -> Union[Any, Tuple[Any, List[Any]]]:
    """ppdiffusers' `remove_tome`: returns the object, or (object, its models) as ppdiffusers does."""
    obj, _ = targets.remove(model_or_pipe)
    return obj if only_return_self else (obj, targets.candidate_models(model_or_pipe))


@contextlib.contextmanager
def builtin_methods() -> Iterator[None]:
    """Run ppdiffusers' own apply_tome/remove_tome inside this block (for references and benchmarks).

    Their apply_tome calls `obj.remove_tome(...)` to find its models, so both methods must be
    ppdiffusers' while it runs. Swaps class attributes: not for use while other threads patch.
    """
    for cls, (apply, remove) in BUILTIN.items():
        cls.apply_tome, cls.remove_tome = apply, remove
    try:
        yield
    finally:
        for cls in BUILTIN:
            cls.apply_tome, cls.remove_tome = apply_tome, remove_tome


def _attach(_module: Any = None) -> None:
    import paddle
    from ppdiffusers.pipelines.pipeline_utils import DiffusionPipeline

    for cls in (DiffusionPipeline, paddle.nn.Layer):
        if cls.__dict__.get("apply_tome") not in (None, apply_tome):
            BUILTIN[cls] = (cls.apply_tome, cls.remove_tome)
        cls.apply_tome = apply_tome
        cls.remove_tome = remove_tome


class _AttachAfterLoad(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        _attach(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps ppdiffusers' own loader so `_attach` runs once it has loaded."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None):
        if fullname != _TARGET:
            return None
        with _lock:
            if self in sys.meta_path:
                sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _AttachAfterLoad(spec.loader)
        return spec


def install() -> None:
    module = sys.modules.get(_TARGET)
    if module is not None:
        _attach(module)
        return
    with _lock:
        if not any(isinstance(finder, _PostImportFinder) for finder in sys.meta_path):
            sys.meta_path.insert(0, _PostImportFinder())
