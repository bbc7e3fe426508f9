"""Token layouts of diffusers 0.42's later denoisers, each a variant of one layouts.py has; registered in
layouts.STRATEGIES by RootKind.layout as this module is imported (runtime.py imports it).

- "items" (JoyImage Edit): Wan's space-time grid over [B, C, F, H, W]; or, for an edit, [B, items, C, F, H, W] whose
  last item is the target and the others reference images. The model moves the target first and joins the items
  along the frames, so the target's tokens lead the sequence and the references' follow: they are its tail and pass
  whole (call.tail, TokenMerge.with_passing_tail), never merged with the target's.
- "ids_cond" (Flux.3): Flux's ids, the reference image's tokens after the target's in its single blocks only.
- "history" (Helios): Wan's grid; the history latents' tokens precede the target's and pass whole.
- "joint_ids" (Krea 2): Flux's ids layout where the ids cover the sequence the root joins, [text, image]: rows
  (t, row, col), the image's last, as many as the packed latent [B, N, C] has tokens.
"""
from __future__ import annotations

import weakref
from typing import Any, Tuple

from .layouts import STRATEGIES, Ids, SpaceTime, _spacetime_patch
from .roots import RootKind


class Items(SpaceTime):
    def __init__(self, root: Any, kind: RootKind, xp: Any) -> None:
        patch = _spacetime_patch(root)
        super().__init__(root, kind, xp, kind.frame_axis, patch or (1, 1, 1))
        self.known_patch = patch is not None

    def validate(self, patch: Any) -> None:
        if not self.known_patch:
            raise ValueError(f"ToMe reads {self.model}'s token grid from its config's patch_size (frames, rows, "
                             f"cols), which it cannot read on this model")

    def read(self, call: Any, module: Any, args: tuple, kwargs: dict, shape: Tuple[int, ...], name: str) -> None:
        if len(shape) != 6:  # one item: Wan's latent [B, C, F, H, W]
            super().read(call, module, args, kwargs, shape, name)
            return
        batch, items, channels, frames, height, width = shape
        call.grid = self._grid((batch, channels, frames, height, width))  # one item's grid: the target's
        f, h, w = call.grid
        call.tail = (items - 1) * f * h * w  # the reference images' tokens, after the target's


class JointIds(Ids):
    def read(self, call: Any, module: Any, args: tuple, kwargs: dict, shape: Tuple[int, ...], name: str) -> None:
        """ids [text + N, 3] over the joined sequence, the image's rows last, checked by shape only. They are kept
        whole with N (call.grid = (ids, N)) and sliced at the first block: a slice here, in the root's pre-hook, would
        be a graph of its own under torch.compile."""
        ids = self.spec.get(args, kwargs)
        rows = None if ids is None else self.xp.shape(ids)
        if len(shape) != 3 or rows is None or len(rows) != 2 or rows[0] < shape[1]:
            raise ValueError(
                f"ToMe needs {self.model}'s packed latent [B, N, C] and its {self.name} [text + N, 3] (the image's "
                f"rows last), got {list(shape)} and {None if rows is None else list(rows)}")
        call.ids = ids
        call.grid = (ids, shape[1])

    def _coords(self, call: Any, x: Any) -> Tuple[Any, ...]:
        ids = call.grid
        if isinstance(ids, tuple):  # (whole ids, N): the image's rows are the last N
            ids = ids[0][self.xp.shape(ids[0])[0] - ids[1]:]
        return self.xp.to_int64(ids[:, 1]), self.xp.to_int64(ids[:, 2])

    def downsample_grid(self, call: Any, plan: Any, host: Any) -> Tuple[int, int, int]:
        """Ids.downsample_grid on the image's rows, read on the host once per ids tensor (the whole one)."""
        whole, n = call.grid
        known = self._grids.get(id(whole))
        if known is not None and known[0]() is whole:
            return known[1]
        call.grid = whole[self.xp.shape(whole)[0] - n:]
        try:
            grid = super().downsample_grid(call, plan, host)
        finally:
            call.grid = (whole, n)
        self._grids = {key: value for key, value in self._grids.items() if value[0]() is not None}
        self._grids[id(whole)] = (weakref.ref(whole), grid)
        return grid


class CondIds(Ids):
    """Flux.3: Flux's ids. An image-to-image call's reference tokens (image_cond_hidden_states) follow the target's in
    its single blocks' input, [image, reference], but not in its image's per-mode blocks, which take the image alone:
    each block's tail is what its input holds beyond the image, passed whole."""

    def image_tokens(self, call: Any, x: Any, index: int = 0) -> Any:
        # Read by the runtime right after this, for this block's merge (runtime._settle: with_tail).
        call.tail = max(0, self.xp.shape(x)[1] - self.xp.shape(call.grid)[0])
        return super().image_tokens(call, x)


class History(SpaceTime):
    """Helios: Wan's space-time grid over its latent [B, C, F, H, W]; its history latents' tokens (long, mid, short)
    precede the target's in every block's sequence, so the target's are the last N, as layouts.py reads them, and the
    history passes whole."""

    def __init__(self, root: Any, kind: RootKind, xp: Any) -> None:
        super().__init__(root, kind, xp, kind.frame_axis, _spacetime_patch(root) or (1, 1, 1))
        self.amplified = bool(getattr(getattr(root, "config", None), "is_amplify_history", False))

    def validate(self, patch: Any) -> None:
        # Its self-attention then scales the first (sequence - original_context_length) keys as history's: with the
        # target's tokens merged that count would reach into the history, scaling too few.
        if self.amplified:
            raise ValueError(
                f"ToMe cannot merge {self.model} built with is_amplify_history=True: its attention finds the history's "
                f"keys by the target's unmerged length (original_context_length); run it without ToMe")


STRATEGIES["items"] = Items
STRATEGIES["joint_ids"] = JointIds
STRATEGIES["ids_cond"] = CondIds
STRATEGIES["history"] = History
