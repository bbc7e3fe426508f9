"""The strategy's interface (Layout) and the grid layouts: "levels" (a UNet's levels, tomesd's rule) and "patches" (a
diffusion transformer patchifying its latent once); and how a root's patch size is read, for every layout."""
from __future__ import annotations

from typing import Any, Optional, Tuple

from tome_core import block_grid, plan_level_block, plan_grid_block

from .entries import RootKind
from .sequences import split_sequence, with_head, with_tail


def config_value(root: Any, key: str) -> Any:
    config = getattr(root, "config", None)
    return config.get(key) if hasattr(config, "get") else getattr(config, key, None)


class Layout:
    one_grid = True  # every block sees one grid (blocks are chosen by index, not by level)
    plans_by_grid = False  # whether `plan` reads call.grid (the matcher keeps plans by what they read)
    frames_in_sequence = False  # st (a dst stride along time) applies
    latent_dims = 4
    # How the band rule (bands.py) can split this layout's tokens: "" (not at all), "rows" (bands of whole rows of
    # one patch grid, on one process), "tokens" (any contiguous bands, as context parallelism cuts a per-token grid).
    bands = "rows"

    def __init__(self, root: Any, kind: RootKind, xp: Any) -> None:
        self.xp, self.model = xp, type(root).__name__

    def validate(self, patch: Any) -> None:
        """Raise at apply time for a root this layout cannot read."""

    def read(self, call: Any, module: Any, args: tuple, kwargs: dict, shape: Tuple[int, ...], name: str) -> None:
        """Set `call.grid` from this call's latent (its `shape`; `name`: the latent input's name)."""
        if len(shape) != self.latent_dims:
            layout = "a latent [B, C, H, W]" if self.latent_dims == 4 else "a video latent (frames, then H and W last)"
            raise ValueError(f"ToMe needs {type(module).__name__}'s '{name}' input to be {layout}, got shape {list(shape)}")
        call.grid = self._grid(shape)

    def _grid(self, shape: Tuple[int, ...]) -> Any:
        return shape[-2], shape[-1]

    def latent_shape(self, latent: Any) -> Tuple[int, ...]:
        return self.xp.shape(latent)  # a list of latents (Z-Image) has its own (unified.py)

    def image_tokens(self, call: Any, x: Any, index: int = 0) -> Any:
        """The image tokens of block `index`'s input `x` (all of them, or its last N)."""
        return x

    def placed(self, call: Any, x: Any, index: int, matching: Any) -> Any:
        if not call.tail and not call.head:
            return matching
        return with_head(with_tail(matching, call.tail), call.head)  # over its whole input: a head and a tail pass whole

    def plan(self, args: Any, call: Any, batch: int, num_tokens: int, index: int, bands: int = 1) -> Any:
        """Block `index`'s plan for `num_tokens` image tokens (one band's, when `bands` of them are matched)."""
        return plan_grid_block(args, (num_tokens, 1), batch, num_tokens, index, call.ratio)

    def reuse_shape(self, call: Any, plan: Any, batch: int) -> tuple:
        """What a kept matching must have been computed for (besides the grid object itself)."""
        return batch, plan.h, plan.w, None

    def downsample_grid(self, call: Any, plan: Any, host: Any) -> Tuple[int, int, int]:
        """(frames, rows, cols) of the image tokens mode='downsample' shrinks, each frame on its own."""
        return 1, plan.h, plan.w

    def block_class(self, index: int) -> Any:
        """What this layout tells of block `index` that its plan or token placing reads (blocks alike share it): the
        first block of each class stands in for the others in blocks compiled on their own (CallState.like)."""
        return None

    def host_downsample_grid(self, call: Any, host: Any) -> Optional[Tuple[int, int, int]]:
        """downsample_grid where it reads the host (the latent's shape does not give it), read by an eager root for
        its blocks compiled on their own (call.down_grid); None where the shapes give it."""
        return None


class Levels(Layout):
    one_grid = False
    plans_by_grid = True
    bands = ""

    def __init__(self, root: Any, kind: RootKind, xp: Any, supported: str = "") -> None:
        super().__init__(root, kind, xp)
        self.latent_dims = 5 if kind.video else 4
        self.supported = supported  # the supported-model list, named to a root read as a UNet by guess
        # A root of no family in tomesd/families/ whose blocks ToMe knows is read as a UNet (LDM's, ComfyUI's and
        # others' UNets have class names of their own): one whose input is no latent is named as unknown.
        self.guessed = kind.family == "UNet" and not any(word in self.model for word in ("UNet", "ControlNet"))

    def read(self, call: Any, module: Any, args: tuple, kwargs: dict, shape: Tuple[int, ...], name: str) -> None:
        if self.guessed and len(shape) != self.latent_dims:
            raise ValueError(f"ToMe does not know {self.model}: its transformer blocks are of a kind ToMe merges, but "
                             f"its family is not among ToMe's (tomesd/families/), so it was read as a UNet, "
                             f"whose '{name}' input is a latent [B, C, H, W]; it got {list(shape)}. Supported: "
                             f"{self.supported}")
        super().read(call, module, args, kwargs, shape, name)

    def plan(self, args: Any, call: Any, batch: int, num_tokens: int, index: int, bands: int = 1) -> Any:
        if call.finest_level is None:  # the call's first attention block: the finest level that has attention
            grid = block_grid(call.grid, num_tokens)
            call.finest_level = None if grid is None else grid[0]
        if call.finest_level is None:
            return None
        plan = plan_level_block(args, call.grid, batch, num_tokens, call.finest_level, call.ratio)
        if plan is None:
            grid = block_grid(call.grid, num_tokens)
            limit = call.finest_level if args.max_downsample is None else args.max_downsample
            if grid is not None and grid[0] > limit:  # a level below those ToMe merges, at any resolution
                call.idle.append(index)
        return plan


class Patches(Layout):
    plans_by_grid = True

    def __init__(self, root: Any, kind: RootKind, xp: Any, patch_size: int) -> None:
        super().__init__(root, kind, xp)
        self.patch_size = patch_size

    def _grid(self, shape: Tuple[int, ...]) -> Any:
        return cells_of(shape[-2], self.patch_size), cells_of(shape[-1], self.patch_size)

    def plan(self, args: Any, call: Any, batch: int, num_tokens: int, index: int, bands: int = 1) -> Any:
        h, w = call.grid
        if bands > 1:  # a band is h / bands whole rows of the grid
            if h % bands:
                raise ValueError(f"bands={bands} splits the patch grid's {h} rows into bands of whole rows; "
                                 f"choose bands dividing {h}")
            h //= bands
        elif num_tokens < h * w and (h * w) % num_tokens == 0:
            raise split_sequence(self.model, num_tokens, h * w)
        return plan_grid_block(args, (h, w), batch, num_tokens, index, call.ratio)


def cells_of(size: int, patch: int) -> int:
    # Hosts padding the latent to whole patches (ComfyUI) see the rounded-up count; others need a multiple.
    return -(-size // patch)


def int_patch(root: Any) -> Optional[int]:
    size = config_value(root, "patch_size")
    size = getattr(root, "patch_size", None) if size is None else size
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None


def spacetime_patch(root: Any) -> Optional[Tuple[int, int, int]]:
    size = config_value(root, "patch_size")
    size = getattr(root, "patch_size", None) if size is None else size  # ComfyUI's Wan: an attribute, (1, 2, 2)
    if isinstance(size, int):  # CogVideoX: a square spatial patch, and patch_size_t frames (1.5) or one (1.0)
        size = (config_value(root, "patch_size_t") or 1, size, size)
    if isinstance(size, (tuple, list)) and len(size) == 3 and all(isinstance(p, int) and p > 0 for p in size):
        return tuple(size)
    return None
