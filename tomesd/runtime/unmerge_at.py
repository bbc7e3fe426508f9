"""A span whose image unmerges at the output of a function its block calls by name (Span.unmerge_at), rather than
at its ends' outputs: ComfyUI's HunyuanVideo double blocks split their attention's output at the block input's image
length (`attn[:, : img.shape[1]]`), so the image's tokens must be whole by then (backends/torch_function_seam.py).

The span's start (after its merge) arms the host's seam for that function for one call, whose output's first tokens
(the merged image; the text after them passes) unmerge; each of the span's ends checks, before it runs, that the
call took the arming, so a function swapped in by other code is refused, never merged wrongly."""
from __future__ import annotations

from typing import Any

from .sites import unmerge_output
from .span_sites import _SpanHook


def open_call_seam(patch: Any, path: str) -> None:
    if patch.call_seam is None:
        make = getattr(patch.host, "function_seam", None)
        if make is None:
            raise ValueError(f"ToMe unmerges {patch.kind_names[0]}'s image at {path}, a seam this framework has not")
        patch.call_seam = make(path)
        patch.call_seam.open(patch)


class UnmergeAtFunction(_SpanHook):
    def arm(self, module: Any, args: tuple, output: Any) -> None:
        """After the span's start: the function's next call in this thread unmerges its output's image."""
        flag = self.span.flag
        if self.patch.site_merge(self.index, flag) is not None or self.patch.site_restore(self.index, flag) is not None:
            self.patch.call_seam.arm(self.rewrite)

    def rewrite(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        unmerged = unmerge_output(self, self.span.flag, (), out, head=True)
        return out if unmerged is None else unmerged

    def check(self, module: Any, args: tuple, kwargs: dict) -> None:
        """Before each of the span's ends: the armed call happened (the image reaching the end is whole)."""
        if not self.patch.call_seam.disarm():
            raise RuntimeError(
                f"ToMe armed {self.span.unmerge_at} to unmerge the merged image of block {self.index}'s attention, but "
                f"the block made no call of it (another node or extension replaced it?); bypass the ToMe node for "
                f"this model")
