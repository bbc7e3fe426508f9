"""Reference tokens joined after the target's in one sequence (Flux Kontext): the pipeline says where the
target ends; ToMe merges the target's tokens only and passes the reference's whole.

FluxKontextPipeline joins its reference image's latents after the target's (`torch.cat([latents,
image_latents], dim=1)`) with `img_ids` rows of the same shape, so the transformer's inputs do not tell the
two apart by shape, and reading the ids' values would be a host read in every call. The pipeline knows on the
host: its `prepare_latents` returns the target's latents first. A `ReferenceSplit` wraps that method on the
pipeline instance (reversibly, as the step clock wraps the scheduler's methods) and hands the target's token
count to the layout of each of its patches; a call whose sequence holds more tokens then merges the first
ones and passes the rest whole (tome_core's TokenMerge.with_passing_tail), so no merged row ever mixes a
target token with a reference token. Which pipelines join references this way is data: roots.RootKind's
`joined_references`.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

from ..backends.frameworks import class_names

_METHOD = "prepare_latents"


def joins_references(pipeline: Any, kinds: List[Any]) -> bool:
    """Whether `pipeline` is one whose loop joins reference tokens after its denoisers' target tokens."""
    names = class_names(pipeline)
    return callable(getattr(pipeline, _METHOD, None)) and any(
        name in kind.joined_references for kind in kinds for name in names)


class ReferenceSplit:
    """Follows one pipeline's `prepare_latents` and sets `target` on its patches' layouts."""

    def __init__(self, pipeline: Any, layouts: List[Any]) -> None:
        self.pipeline, self.layouts = pipeline, layouts
        self._saved: Optional[Any] = None  # the instance's own prepare_latents, if another wrapper set one

    def attach(self) -> None:
        self._saved = self.pipeline.__dict__.get(_METHOD)
        setattr(self.pipeline, _METHOD, _Prepare(self))

    def detach(self) -> None:
        own = self.pipeline.__dict__.get(_METHOD)
        if isinstance(own, _Prepare) and own.split is self:
            del self.pipeline.__dict__[_METHOD]
            if self._saved is not None:
                self.pipeline.__dict__[_METHOD] = self._saved
        for layout in self.layouts:
            layout.target = None

    def prepare(self, args: tuple, kwargs: Dict[str, Any]) -> Any:
        original = self._saved or getattr(type(self.pipeline), _METHOD).__get__(self.pipeline)
        out = original(*args, **kwargs)
        latents = out[0] if isinstance(out, tuple) else out
        shape = tuple(getattr(latents, "shape", ()))
        # A packed latent [B, N, C]: its N tokens come first in every call of this run (a shape, no value read).
        target = int(shape[1]) if len(shape) == 3 else None
        for layout in self.layouts:
            layout.target = target
        return out


class _Prepare:
    """The pipeline's prepare_latents as the split sees it."""

    def __init__(self, split: ReferenceSplit) -> None:
        self.split = split

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.split.prepare(args, kwargs)
