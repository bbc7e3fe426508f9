"""A function a host's block calls by its module-level name, as a seam (Span.unmerge_at): ComfyUI's
comfy.ldm.flux.layers.attention, which its DoubleStreamBlock calls after joining queries, keys and values.

HunyuanVideo's double blocks (flipped_img_txt=True) join [image, text] and split the attention's output at the
block input's image length (`attn[:, : img.shape[1]]`), a length ToMe does not change: merged image tokens there
would shift the split into the text. So the image's tokens unmerge at the attention function's output, before the
split, instead of at the output projection after it (a per-token linear layer: the same function of each token
either way). While a patch needs it, the module's name is bound to a wrapper that passes every unarmed call through
as it came; the span's start arms it for one call (the block's next attention), the span's end checks the call took
it. The wrapper goes when the last patch using it is closed (seam.py: users, the armed slot), and a name
rebound by other code since is left as that code bound it.
"""
from __future__ import annotations

import importlib
from typing import Any, Callable, Dict

from .torch_seam import Seam


class FunctionSeam(Seam):
    """The process's wrapped `module.name` (path "module:name"), shared by every patch that uses it."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path
        self.module_name, self.name = path.split(":")

    def __reduce__(self) -> Any:  # a copied patch shares the process's seam
        return function_seam, (self.path,)

    def _wrap(self) -> None:
        module = importlib.import_module(self.module_name)
        current = getattr(module, self.name)
        if not isinstance(current, _Wrapped):
            setattr(module, self.name, _Wrapped(self, current))

    def _unwrap(self) -> None:
        module = importlib.import_module(self.module_name)
        current = getattr(module, self.name, None)
        if isinstance(current, _Wrapped) and current.seam is self:
            setattr(module, self.name, current.fn)


class _Wrapped:
    __slots__ = ("seam", "fn", "__wrapped__", "__name__", "__qualname__")

    def __init__(self, seam: FunctionSeam, fn: Callable) -> None:
        self.seam, self.fn = seam, fn
        self.__wrapped__ = fn
        self.__name__ = self.__qualname__ = seam.name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        arming = self.seam.armed()
        if arming is None or not arming.take():
            return self.fn(*args, **kwargs)
        return arming.rewrite(self.fn, *args, **kwargs)


_SEAMS: Dict[str, FunctionSeam] = {}


def function_seam(path: str) -> FunctionSeam:
    """The one seam of this process for `path` ("module:name")."""
    if path not in _SEAMS:
        _SEAMS[path] = FunctionSeam(path)
    return _SEAMS[path]
