"""The "unified" layout: transformers whose main layers run on one sequence joining each sample's image and text
tokens, padded to the batch's longest with a key-padding mask where the samples' lengths differ. Z-Image: per
sample [image, its padding to a multiple of 32, caption, its padding], then zeros to the batch's length; Lumina 2:
per sample [text (its own valid length), image, zeros]. Their refiners are blocks of the same class: a noise
refiner on the image alone (image first, then Z-Image's padding) and a context refiner on the text alone.

Which blocks see the image, and where, is data (RootKind.sequence): by the container the block sits in. Each sample's
image start is found on the device (0, or the text mask's sum per sample: Lumina 2's prompts of different lengths in one
batch), never read on the host; the image tokens are gathered from there and matched on the image's (rows, cols) grid,
and the matching is placed back into the whole sequence (tome_core's TokenMerge.placed): text, padding and every other
token pass whole, each its own row, so no merged row holds a token that is not the image's. Rotary rows (with a batch
axis) and the key-padding mask follow each merged row's representative (sites.MergeSite)."""
from __future__ import annotations

import inspect
from numbers import Integral
from typing import Any, Optional, Tuple

from .coordinates import SpaceTime
from .entries import RootKind
from .grids import int_patch
from .signatures import InputSpec


class Unified(SpaceTime):
    """SpaceTime's matching on the image's (1, rows, cols) grid, wherever the image sits in a block's sequence."""

    frames_in_sequence = False
    bands = ""  # the band rule would need the image's place in each rank's share of a unified sequence

    def __init__(self, root: Any, kind: RootKind, xp: Any) -> None:
        super().__init__(root, kind, xp, 0, (1, 1, 1))
        self.sequence = kind.sequence  # where each container's blocks see the image
        self.patch = int_patch(root)
        forward = inspect.signature(type(root).forward).parameters
        # Z-Image's patch sizes are forward arguments with defaults (read as the plain ints they are).
        self.sizes = [(InputSpec.find(root, (name,), False), getattr(forward.get(name), "default", None))
                      for name in ("patch_size", "f_patch_size")]
        self.text = InputSpec.find(root, (self.sequence.text_mask,), False) if self.sequence.text_mask else None
        self.sections: Tuple[str, ...] = ()

    def validate(self, patch: Any) -> None:
        if self.sequence.text_mask and self.text is None:
            raise ValueError(f"{self.model}.forward takes no {self.sequence.text_mask!r}: ToMe finds each sample's "
                             f"image after its text by it")
        names = {id(module): name for name, module in patch.host.named_modules(patch.root)}
        sections = []
        for block in patch.blocks:
            container = names[id(block)].split(".")[0]
            if container not in self.sequence.sections:
                raise ValueError(f"ToMe does not know where {self.model}'s block {names[id(block)]} sees the image "
                                 f"(it knows {', '.join(self.sequence.sections)}); apply_patch to a model of the "
                                 f"structure diffusers gives it")
            sections.append(self.sequence.sections[container])
        self.sections = tuple(sections)

    def latent_shape(self, latent: Any) -> Tuple[int, ...]:
        if not isinstance(latent, (list, tuple)):
            return self.xp.shape(latent)
        if not latent or isinstance(latent[0], (list, tuple)):
            raise ValueError(
                f"ToMe does not merge {self.model}'s omni mode (a list per sample of condition images and the target, "
                f"joined after the caption with SigLIP tokens under per-token noise masks: ZImageOmniPipeline) yet; "
                f"run it without ToMe, or use ZImagePipeline / ZImageImg2ImgPipeline, whose calls merge")
        shapes = {tuple(self.xp.shape(x)) for x in latent}
        if len(shapes) != 1:
            raise ValueError(f"{self.model} was given latents of different sizes in one batch ({sorted(shapes)}); ToMe "
                             f"matches one image grid per call: call it with one size per batch")
        return (len(latent),) + shapes.pop()

    def read(self, call: Any, module: Any, args: tuple, kwargs: dict, shape: Tuple[int, ...], name: str) -> None:
        if self.sequence.latent == "list":  # [B, C, F, H, W]: B latents [C, F, H, W]
            given = [None if spec is None else spec.get(args, kwargs) for spec, _ in self.sizes]
            p, pf = [default if value is None else value for value, (_, default) in zip(given, self.sizes)]
            dims, cells = 5, lambda: (shape[2] // pf, shape[3] // p, shape[4] // p)
        else:
            p, pf, dims, cells = self.patch, 1, 4, lambda: (1, shape[2] // p, shape[3] // p)
        if len(shape) != dims or not all(isinstance(v, Integral) and v > 0 for v in (p, pf)):
            latent = "latents [C, F, H, W]" if dims == 5 else "a latent [B, C, H, W]"
            raise ValueError(f"ToMe needs {self.model}'s '{name}' input to be {latent} and its patch sizes ints, got "
                             f"{list(shape)} and {(p, pf)}")
        call.grid = cells()
        if self.text is not None:
            text = self.text.get(args, kwargs)
            if text is None:
                raise ValueError(f"ToMe finds {self.model}'s image after each sample's text by its "
                                 f"{self.sequence.text_mask}, and this call passed None")
            call.unified["text"] = text  # read at the first block that needs it, on the device

    def _starts(self, call: Any, x: Any, section: str) -> Optional[Any]:
        """Each sample's first image token in a block's input of this section ([B], on the device), or None: 0."""
        if section != "after_text":
            return None
        starts = call.unified.get("starts")
        if starts is None:  # the text's valid length per sample, as the host counts it (the mask's sum)
            starts = call.unified["starts"] = self.xp.to_int64(call.unified["text"]).sum(1)
        return starts

    def image_tokens(self, call: Any, x: Any, index: int = 0) -> Any:
        section = self.sections[index]
        if not section:
            return x  # a text refiner's block: planned as none (plan)
        if call.coords is None:
            call.coords = self._coords(call, x)
        f, h, w = call.grid
        n, (b, s, c) = f * h * w, self.xp.shape(x)
        if s < n:
            raise ValueError(f"a block of {self.model} holds {s} tokens, fewer than the image's {n}: its sequence was "
                             f"split or cut by something ToMe cannot read; run it without ToMe")
        starts = self._starts(call, x, section)
        if starts is None:
            return x[:, :n]
        xp = self.xp
        rows = xp.reshape(starts, [b, 1]) + xp.reshape(xp.arange(n, x), [1, n])
        rows = rows + xp.reshape(xp.arange(b * s, x, step=s), [b, 1])  # sample k's tokens start at k * s
        with xp.no_grad():  # the matching's metric only: a gather saving nothing for backward, as a slice does
            return xp.reshape(xp.take(xp.reshape(x, [b * s, c]), xp.reshape(rows, [b * n]), 0), [b, n, c])

    def placed(self, call: Any, x: Any, index: int, matching: Any) -> Any:
        if matching is None or not self.sections[index]:
            return None
        b, s = self.xp.shape(x)[:2]
        starts = self._starts(call, x, self.sections[index])
        starts = self.xp.zeros([b], x, integer=True) if starts is None else starts
        if isinstance(matching, dict):  # per-site ratios: one merge per site
            return {flag: merge.placed(starts, s) for flag, merge in matching.items()}
        return matching.placed(starts, s)

    def plan(self, args: Any, call: Any, batch: int, num_tokens: int, index: int, bands: int = 1) -> Any:
        return super().plan(args, call, batch, num_tokens, index, bands) if self.sections[index] else None

    def block_class(self, index: int) -> Any:
        return self.sections[index]
