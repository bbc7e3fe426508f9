"""What the nodes refuse, in the node's own terms and before anything is patched: a ratio past the point where
merging stops, `levels` / `blocks` that do not fit the model (echoing what was typed), a per-site ratio the model
has no site for, and the ToDo node on models whose attention gives it no seam.

The library's own refusals (tomesd.runtime, tomesd.families) name its Python arguments and diffusers' remedies; a ComfyUI user
sees widgets, so the cases a node can meet are checked here first and worded for the node.
"""
from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Tuple

from tome_core import ToMeArgs

from ..backends.frameworks import framework_of, host_ops
from ..families import UNET, block_kind, foreign_to_unets, root_kind
from ..runtime.tome_patch import transformer_blocks

# One dst token stays in each sx x sy (x st) cell and every other token can only merge into a dst, so at most
# 1 - 1/(sx*sy*st) of the image tokens merge (tome_core.matching caps r at the src count): any larger ratio gives
# the same tokens. The nodes expose no stride, so the library's default (2x2) sets the cap: 0.75.
_STRIDE = ToMeArgs()
CELL = f"{_STRIDE.sy}x{_STRIDE.sx}"
CELL_SIZE = _STRIDE.sx * _STRIDE.sy * _STRIDE.st
MAX_RATIO = 1.0 - 1.0 / CELL_SIZE

# The per-site ratio inputs: the block-kind flag each turns on (tome_core.schedule.SITES), and what a model
# whose blocks lack that site does instead.
SITE_INPUTS = {
    "crossattn_ratio": ("merge_crossattn", "no cross-attention: text and image tokens meet in the attention that "
                                           "ratio reduces"),
    "mlp_ratio": ("merge_mlp", "no MLP apart from the attention span that ratio reduces"),
}

_ROTATES = ("ComfyUI's {} rotates its keys inside each attention, after projecting them, and calls attention as "
            "a plain function, so no step hands ToDo the keys to downsample")
# Why ToDo cannot run on ComfyUI's block kinds that refuse it (the block kinds' reasons name diffusers' remedies).
_NO_TODO = {
    "JointBlock": "ComfyUI's SD3 / SD3.5 (MMDiT) projects queries, keys and values with one fused layer (qkv), "
                  "so its keys cannot be downsampled apart from its queries",
    "DoubleStreamBlock": _ROTATES.format("{}"),  # Flux's blocks, and HunyuanVideo's: named by the model's family
    "SingleStreamBlock": _ROTATES.format("{}"),
    "WanAttentionBlock": _ROTATES.format("Wan"),
    "QwenImageTransformerBlock": _ROTATES.format("Qwen-Image"),
    # (Kinds of these names that refuse ToDo are ComfyUI's NextDiT's and LTX-Video's: families/image/lumina.py, video/ltx.py.)
    "JointTransformerBlock": "ComfyUI's Lumina 2 / Z-Image (NextDiT) projects queries, keys and values with one fused "
                             "layer (qkv) and rotates them inside its attention, so its keys cannot be downsampled "
                             "apart from its queries",
    "BasicTransformerBlock": _ROTATES.format("LTX-Video"),
    "HiDreamImageTransformerBlock": _ROTATES.format("HiDream"),
    "HiDreamImageSingleTransformerBlock": _ROTATES.format("HiDream"),
}


# Why a block kind has no site for a per-site ratio, where SITE_INPUTS' reason is not it (by the model's first block).
_NO_SITE = {("mlp_ratio", "Block"): "an MLP run on the token grid [B, T, H, W, D] (Cosmos Predict2), which no site "
                                    "merges: only its attentions are given the tokens as a sequence"}


def parse_blocks(text: str) -> Optional[Tuple[int, ...]]:
    """'0-9, 12' -> (0, ..., 9, 12); '' -> None (every block)."""
    text = text.strip()
    if not text:
        return None
    blocks = set()
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if match is None:
            raise ValueError(f"blocks must be indices and ranges such as '0-9, 12', got {text!r}")
        first = int(match.group(1))
        last = int(match.group(2)) if match.group(2) else first
        if last < first:
            raise ValueError(f"blocks: the range {part.strip()!r} runs backwards; write it as '{last}-{first}'")
        blocks.update(range(first, last + 1))
    return tuple(sorted(blocks))


def parse_schedule(text: str) -> Optional[Tuple[Tuple[float, float], ...]]:
    """'0:0.6, 0.5:0.3' -> ((0.0, 0.6), (0.5, 0.3)): from each share of the steps on, that ratio."""
    text = text.strip()
    if not text:
        return None
    try:
        return tuple((float(a), float(b)) for a, b in (piece.split(":") for piece in text.split(",")))
    except ValueError:
        raise ValueError(f"ratio_schedule must read 'share:ratio, share:ratio', such as '0:0.6, 0.5:0.3', "
                         f"got {text!r}") from None


def check_ratio(source: str, value: float) -> None:
    """Refuse a ratio above MAX_RATIO: the widget would promise a merge that cannot happen."""
    if value > MAX_RATIO + 1e-9:  # widgets step in 0.05s; float noise is not a request
        raise ValueError(
            f"{source} asks for {value:g}, above {MAX_RATIO:g}, where merging stops: each {CELL} cell of image "
            f"tokens keeps one token for the others to merge into, so at most {MAX_RATIO:g} of them can merge and "
            f"a higher ratio merges the same tokens. Use {MAX_RATIO:g} or less")


@contextmanager
def refusals(node: str) -> Iterator[None]:
    """Raise every refusal met while a node runs as '<node> node: ...', so the user knows which node to fix."""
    try:
        yield
    except (ValueError, TypeError) as error:
        cls = TypeError if isinstance(error, TypeError) else ValueError
        raise cls(f"{node} node: {error}") from None


@dataclass(frozen=True)
class ModelFacts:
    """What the checks need of a diffusion model: its family, whether its blocks share one token grid
    (a diffusion transformer) and its blocks of a kind ToMe knows, in the order `blocks` numbers them."""

    family: str
    one_grid: bool
    blocks: List[Any]

    @classmethod
    def of(cls, net: Any) -> "ModelFacts":
        framework = framework_of(net)
        blocks = transformer_blocks(host_ops(framework), net) if framework else []
        kind = root_kind(net)
        if kind is UNET and foreign_to_unets(blocks):
            # A class in no family of the tables, read as a UNet, with a transformer family's blocks: the library
            # refuses it by its own name; no check here may call it a UNet or send the user to another node.
            return cls(type(net).__name__, True, [])
        return cls(kind.family.replace(" (ComfyUI)", ""), kind.layout != "levels", blocks)

    def numbering(self) -> str:
        """'0-3' or, with several block classes, '0-3 (DoubleStreamBlock 0-1, SingleStreamBlock 2-3)'."""
        runs: List[List[Any]] = []  # [class name, first, last]
        for index, block in enumerate(self.blocks):
            name = type(block).__name__
            if runs and runs[-1][0] == name:
                runs[-1][2] = index
            else:
                runs.append([name, index, index])
        whole = f"0-{len(self.blocks) - 1}"
        if len(runs) < 2:
            return whole
        return f"{whole} ({', '.join(f'{name} {first}-{last}' for name, first, last in runs)})"


def check_where(facts: ModelFacts, levels: str, typed: str, blocks: Optional[Tuple[int, ...]]) -> None:
    """`levels` only on a UNet, `blocks` only on a diffusion transformer and within the blocks it has."""
    if not facts.blocks:
        return  # a model the pack does not cover: the library's refusal names the covered ones
    if facts.one_grid and levels != "auto":
        raise ValueError(
            f"levels {levels} picks a UNet's blocks by how far their level is downsampled; this model ({facts.family}) "
            f"is a diffusion transformer, whose blocks all see one token grid. Set levels to auto and pick blocks by "
            f"index in blocks (this model has blocks {facts.numbering()}; empty: every block)")
    if not facts.one_grid and blocks is not None:
        raise ValueError(
            f"blocks {typed!r} picks a diffusion transformer's blocks by index; this model is a UNet, whose blocks "
            f"are picked by levels. Leave blocks empty and set levels (auto: the finest level with "
            f"attention)")
    if blocks is not None and blocks[-1] >= len(facts.blocks):
        raise ValueError(
            f"blocks {typed!r} reaches block {blocks[-1]}, but this model ({facts.family}) has blocks "
            f"{facts.numbering()}. Type indices within 0-{len(facts.blocks) - 1}, or leave blocks empty for every "
            f"block")


def check_sites(facts: ModelFacts, ratios: Dict[str, float]) -> None:
    """A per-site ratio for a site none of the model's blocks has would change nothing: refuse it by name."""
    flags = {part.flag for block in facts.blocks for kind in (block_kind(block),)
             for part in kind.sublayers + kind.spans}
    for name, (flag, instead) in SITE_INPUTS.items():
        instead = _NO_SITE.get((name, type(facts.blocks[0]).__name__), instead) if facts.blocks else instead
        if facts.blocks and ratios.get(name, 0.0) > 0 and flag not in flags:
            raise ValueError(f"{name} {ratios[name]:g} would change nothing: this model's blocks ({facts.family}) have "
                             f"{instead}. Set {name} to 0")


def check_todo(facts: ModelFacts) -> None:
    """ToDo on a model whose attention gives no seam for downsampled keys: name the node that works there."""
    for block in facts.blocks:
        kind = block_kind(block)
        if kind.no_downsample:
            reason = _NO_TODO.get(kind.class_name, f"its {kind.class_name} blocks hand ToDo no image keys alone")
            reason = reason.replace("{}", facts.family)
            raise ValueError(
                f"{reason}. Use the ToMe node on this model ({facts.family}) instead: its ratio (0.5 to start, up to "
                f"{MAX_RATIO:g}) merges image tokens before attention, so queries, keys and values all shrink")
