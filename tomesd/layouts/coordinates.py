"""The coordinate layouts: "ids" (Flux: the grid given per token by an ids input), "spacetime" (every frame's tokens in
one sequence: Wan, CogVideoX) and "patchgrid" (a latent patchified once, matched on coordinates: ComfyUI's Flux). The
image is the block input's last N tokens (under context parallelism, its band of them)."""
from __future__ import annotations

import weakref
from typing import Any, Dict, Optional, Tuple

from tome_core import band_range, image_cells

from .entries import RootKind
from .grids import Layout, cells_of
from .sequences import split_sequence
from .signatures import InputSpec


class _Coordinates(Layout):
    """Layouts whose grid is given per token: the image is the block input's last N tokens (under context
    parallelism, its band of them)."""

    bands = "tokens"

    def image_tokens(self, call: Any, x: Any, index: int = 0) -> Any:
        if call.coords is None:
            call.coords = self._coords(call, x)
        # The call's backend (CallState.xp: torch's eager variant reads a shape with no Python frame), else the layout's
        xp = call.xp or self.xp
        n = call.grid_tokens
        if n is None:  # the grid's token count, read once a call
            n = call.grid_tokens = xp.shape(call.coords[0])[0]
        s = xp.shape(x)[1]
        band, tail = call.band, call.tail  # tail: reference tokens after the image's (references.py)
        if band is None or band.index is None:
            if s < n + tail:
                raise split_sequence(self.model, s, n + tail)
            return x[:, s - n - tail:s - tail]
        if tail:
            raise ValueError(f"{self.model} under context parallelism cannot pass a reference image's tokens "
                             f"whole (Flux Kontext): run the edit on one process, or without ToMe")
        start, stop = band_range(n, band.count, band.index)
        if s >= n:  # the whole sequence: a block whose own forward splits it (diffusers' plan for Wan's blocks.0)
            return x[:, s - n + start:s - n + stop]
        return x[:, s - (stop - start):]

    def _coords(self, call: Any, x: Any) -> Tuple[Any, ...]:
        raise NotImplementedError


class Ids(_Coordinates):
    def __init__(self, root: Any, kind: RootKind, xp: Any) -> None:
        super().__init__(root, kind, xp)
        self.name = kind.ids
        self.spec = InputSpec.find(root, (kind.ids,), False)
        self._grids: Dict[int, Tuple[Any, Tuple[int, int, int]]] = {}  # id(ids) -> (weak ref, grid), see downsample_grid
        # The target's token count in this pipeline run, when the pipeline joins a reference image's tokens
        # after them (references.ReferenceSplit sets it); None: every image token is the target's.
        self.target: Optional[int] = None
        # Whether this family's sequences may join reference images after the target's, each image marked by the
        # ids' first axis (Flux Kontext: 0, then 1; Flux.2: 0, then 10, 20, ...; Bria FIBO Edit, LongCat-Image
        # Edit): a call whose target no pipeline told merges each image's tokens among themselves only.
        self.separates = bool(kind.joined_references)
        self.cell: Optional[Tuple[int, int]] = None  # (sy, sx), the patch's dst strides (validate; none to downsample)

    def validate(self, patch: Any) -> None:
        if self.spec is None:
            raise ValueError(f"{type(patch.root).__name__}.forward takes no {self.name!r}: ToMe reads the image "
                             f"tokens' grid from it")
        self.cell = (patch.args.sy, patch.args.sx) if patch.args.mode == "merge" else None

    def read(self, call: Any, module: Any, args: tuple, kwargs: dict, shape: Tuple[int, ...], name: str) -> None:
        """(ids [N, 3], N) of a packed latent's image tokens, checked by shape only: the root's pre-hook does
        no tensor work (a graph tracer then sees one graph); the first block reads the coordinates."""
        ids = self.spec.get(args, kwargs)
        if len(shape) != 3 or ids is None:
            raise ValueError(f"ToMe needs {type(module).__name__}'s packed latent [B, N, C] and its {self.name} [N, 3], "
                             f"got {list(shape)} and {None if ids is None else list(self.xp.shape(ids))}")
        ids_shape = self.xp.shape(ids)
        rows = ids_shape[1] if len(ids_shape) == 3 else ids_shape[0]  # older diffusers: ids with a batch axis
        if rows != shape[1]:
            raise ValueError(f"{self.name} has {rows} rows for {shape[1]} latent tokens: ToMe merges the latent's own "
                             f"tokens and reads their grid from {self.name}, one row each")
        call.ids = ids  # the whole tensor: it tells this run's grid from another's of one token count
        if self.target is not None and rows > self.target:  # a reference image's tokens follow the target's
            call.tail = rows - self.target
            ids = ids[..., :self.target, :]
        call.grid = ids

    def _coords(self, call: Any, x: Any) -> Tuple[Any, ...]:
        # A pipeline passes one ids tensor for a whole run: its coordinates (and images) are made once per tensor,
        # kept in the patch's constants between eager calls (a traced call's memo is its own).
        kept = call.memo.get("ids coordinates")
        if kept is not None and kept[0] is call.grid:
            call.images = kept[2]
            return kept[1]
        coords, call.images = self._coords_of(self._rows(call.grid))
        call.memo["ids coordinates"] = (call.grid, coords, call.images)
        return coords

    def _coords_of(self, ids: Any) -> Tuple[Tuple[Any, ...], Any]:
        rows, cols = self.xp.to_int64(ids[:, 1]), self.xp.to_int64(ids[:, 2])
        if not self.separates or self.target is not None or self.cell is None:
            # One image: the target's (a pipeline cut the ids to it), or a downsampled grid (which refuses several)
            return (rows, cols), None
        # A bare model: the ids may hold a target and references after it, told apart by their first axis, all on
        # the device. The partition's cells are each image's own and a src matches its own image's dst only
        # (call.images); one image gets the partition it always had.
        images = self.xp.to_int64(ids[:, 0])
        return image_cells(self.xp, images, rows, cols, self.cell[0], self.cell[1]), images

    def _rows(self, ids: Any) -> Any:
        return ids[0] if len(self.xp.shape(ids)) == 3 else ids  # rows (image, row, col[, ...]), on the device

    def host_downsample_grid(self, call: Any, host: Any) -> Optional[Tuple[int, int, int]]:
        return self.downsample_grid(call, None, host)

    def downsample_grid(self, call: Any, plan: Any, host: Any) -> Tuple[int, int, int]:
        """The image's (1, rows, cols). A packed latent's shape does not say them, so they are read from the
        ids on the host: once per ids tensor (a pipeline passes one per run), eagerly only."""
        if call.down_grid is not None:  # read by the eager root of blocks compiled on their own
            return call.down_grid
        ids = call.grid
        known = self._grids.get(id(ids))
        if known is not None and known[0]() is ids:
            return known[1]
        if host.is_compiling():
            raise RuntimeError("mode='downsample' on Flux reads the image's rows and columns from img_ids on the host "
                               "(its packed latent's shape does not give them), which a compiled graph cannot do; use "
                               "mode='merge' under torch.compile, or run this patch eagerly")
        whole = self._rows(ids)
        if self.separates and host.host_float(self.xp.to_float32((whole[:, 0] != whole[0, 0]).any())) == 1.0:
            raise ValueError(
                f"mode='downsample' cannot keep apart the images these {self.name} mark by their first axis (a "
                f"reference image's tokens after the target's, as Flux Kontext and Flux.2 edits join them): its keys "
                f"come from one grid. Use mode='merge', which merges each image's tokens among themselves, or patch "
                f"the pipeline with mode='merge', which merges the target's and passes the reference's whole")
        rows, cols = self.xp.to_int64(whole[:, 1]), self.xp.to_int64(whole[:, 2])
        # from the grid's corner, wherever the ids start (LongCat-Image's at 512), as the matching counts
        rows, cols = rows - rows.min(), cols - cols.min()
        n = self.xp.shape(rows)[0]
        h, w = int(host.host_float(rows.max())) + 1, int(host.host_float(cols.max())) + 1
        token = self.xp.arange(n, rows)
        row_major = n == h * w and host.host_float(
            self.xp.to_float32(((rows == token // w) & (cols == token % w)).all())) == 1.0
        if not row_major:
            raise ValueError(f"mode='downsample' needs {self.name} to be the image's grid in row-major order from its "
                             f"corner, as diffusers' Flux pipelines make it; these {n} ids are not a full {h}x{w} grid. "
                             f"Use mode='merge'")
        self._grids = {key: value for key, value in self._grids.items() if value[0]() is not None}
        self._grids[id(ids)] = (weakref.ref(ids), (1, h, w))
        return 1, h, w

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_grids"] = {}  # weak references to this process's tensors
        return state


class SpaceTime(_Coordinates):
    frames_in_sequence = True
    latent_dims = 5

    def __init__(self, root: Any, kind: RootKind, xp: Any, frame_axis: int, patch_size: Tuple[int, int, int]) -> None:
        super().__init__(root, kind, xp)
        self.frame_axis, self.patch_size = frame_axis, patch_size

    def _grid(self, shape: Tuple[int, ...]) -> Any:
        pt, ph, pw = self.patch_size
        return cells_of(shape[self.frame_axis], pt), cells_of(shape[-2], ph), cells_of(shape[-1], pw)

    def _coords(self, call: Any, x: Any) -> Tuple[Any, ...]:
        f, h, w = call.grid  # each token's (frame, row, col), on the device
        # Made once per grid and device, kept in the patch's constants between eager calls (a traced call's memo is
        # its own): one object for a run's calls, so the cells made from them are kept too (Matcher)
        key = f"spacetime coordinates {f} {h} {w} {getattr(x, 'device', None) or getattr(x, 'place', None)}"
        coords = call.memo.get(key)
        if coords is None:
            token = self.xp.arange(f * h * w, x)
            coords = call.memo[key] = (token // (h * w), (token // w) % h, token % w)
        return coords

    def reuse_shape(self, call: Any, plan: Any, batch: int) -> tuple:
        return batch, plan.h, plan.w, call.grid  # two grids of one token count are told apart

    def downsample_grid(self, call: Any, plan: Any, host: Any) -> Tuple[int, int, int]:
        return call.grid


class PatchGrid(SpaceTime):
    """A latent [B, C, H, W] patchified once, whose blocks take per-token rotary rows (ComfyUI's Flux): a
    space-time grid of one frame."""

    frames_in_sequence = False
    latent_dims = 4

    def __init__(self, root: Any, kind: RootKind, xp: Any, patch_size: int) -> None:
        super().__init__(root, kind, xp, 0, (1, patch_size, patch_size))

    def _grid(self, shape: Tuple[int, ...]) -> Any:
        _, ph, pw = self.patch_size
        return 1, cells_of(shape[-2], ph), cells_of(shape[-1], pw)
