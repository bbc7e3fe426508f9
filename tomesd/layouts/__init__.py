"""Token layouts, the strategies a family's root kind names (RootKind.layout), and the entries families are written in.

A layout says how a call's token grid is read (from shapes only, at the root's entry), how the image tokens and
their grid coordinates are found at the first block (on the device of its input), and which blocks merge with
what r:
- "levels" (grids.py): a UNet. Blocks sit at several levels of the latent; tomesd's rule picks the levels (each
  block's grid is found from its token count); each sample is matched on its own.
- "patches" (grids.py): a diffusion transformer patchifying its latent once: every block sees one (h/p, w/p) grid.
- "ids" (coordinates.py): Flux. One token list whose grid is given by `img_ids`; text may come first in a block's
  input. A family whose pipelines join reference images after the target (RootKind.joined_references) marks each
  image by the ids' first axis: a call whose target no pipeline told (a bare model) keeps those images apart on the
  device.
- "patchgrid" (coordinates.py): as "patches", matched on grid coordinates (ComfyUI's Flux).
- "spacetime" (coordinates.py): Wan, CogVideoX. Every frame's tokens in one sequence (frames, rows, columns); dst
  strides per axis (st, sy, sx); "packed" (packed.py): such a grid read from the root's arguments; "unified"
  (unified.py): the image somewhere in one sequence with text and padding (Z-Image, Lumina 2).
- image_first.py: grids whose image tokens are followed, or preceded, by tokens that pass whole (HunyuanVideo's,
  HiDream's), the base of several families' own layouts.
The coordinate layouts match each sample on its own where every block's rotary rows can follow it, else once for the
batch (runtime/tome_patch.py: ToMePatch.per_sample). A family whose layout is a variant of these defines it in its
own module (its LAYOUTS); strategies.py builds a root's layout by name.

Nothing here imports the runtime or the families: both import this package.
"""
