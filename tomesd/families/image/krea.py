"""Krea 2: one stream, [text, image] joined by the root, under rotary ids over both (layout "joint_ids": JointIds,
Flux's ids layout over the joined sequence, the image's rows last)."""
from __future__ import annotations

import weakref
from typing import Any, Tuple

from ...layouts.coordinates import Ids
from ...layouts.entries import BlockKind, Downsample, RootKind, Sublayer


BLOCK_KINDS: Tuple[BlockKind, ...] = (
    # Krea 2: one stream, [text, image] joined by the root. Its gated attention rotates queries and keys by rows
    # (cos, sin) [text + image, D] with diffusers' apply_rotary_emb on [B, S, heads, D] and calls the dispatch
    # (per-sample rows there, keys shrinkable there: the image's last); its SwiGLU sees the joined sequence too. Its
    # pipeline's text mask reaches the attention as the root's [B, 1, 1, text + image], ones over the image: sliced
    # to the merged image's keys (the first text + M entries: every image entry is True, so the slice is exact).
    BlockKind(
        "Krea2TransformerBlock",
        sublayers=(Sublayer("attn", "merge_attn", tokens=("hidden_states",), rotary="image_rotary_emb",
                            rotates="cos_sin"),
                   Sublayer("ff", "merge_mlp", tokens=("hidden_states",))),
        downsample=(Downsample("attn", "dispatch"),),
        mask="image_ones_last",
        module="diffusers.",
    ),
)


ROOT_KINDS: Tuple[RootKind, ...] = (
    # Krea 2: the root joins [text, image] before its blocks and gives `position_ids` rows (t, h, w) for both; the
    # image's rows are the last (rows, cols) of a packed latent [B, N, C]. Its pipeline passes a text padding mask
    # for padded prompts, joined over [text, image]: sliced to the merged keys (the block kind's "image_ones_last").
    RootKind(family="Krea 2", classes=("Krea2Transformer2DModel",), layout="joint_ids", ids="position_ids",
             supported="the Krea 2 transformer (torch)"),
)


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
        if call.down_grid is not None:  # read by the eager root of blocks compiled on their own
            return call.down_grid
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


LAYOUTS = {"joint_ids": JointIds}
