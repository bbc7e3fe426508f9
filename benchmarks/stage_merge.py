"""Merging once per stage against merging in every block (issue 59, item 4), on the SDXL-shaped yardstick.

Per-block merging (`tomesd.apply_patch`) matches and merges inside each transformer block. Stage merging matches
once at the entry of a transformer's stack of blocks, runs every block of the stack on the merged tokens, and gives
each token its own input plus its row's update at the exit: out = x + unmerge(blocks(merge(x)) - merge(x)). Here it
is a prototype (forward hooks on each stack's first and last block, tome_core's matching with tomesd's random dst),
to decide whether it earns an option. Both run at the same ratio and levels; per-block merging with
`merge_crossattn=True, merge_mlp=True` runs every sub-layer on merged tokens, as a merged stage does (the same FLOPs
but for the matching).

With `prop`, a merged stage's self-attentions weigh each merged key by the tokens it holds (proportional attention):
here a bias on torch's SDPA call (an additive mask of log(size), for the prototype; the library puts it in one more
channel), for calls whose queries and keys are the stage's merged tokens.

Printed per setting: PSNR / SSIM against the unpatched samples from the same noise (the yardstick's own measure),
and what it adds to one forward per merged block: ops dispatched (eager CUDA: kernel launches) and Python calls.
Run: python benchmarks/stage_merge.py [--images 64] [--json PATH]
"""
import argparse
import json
import math

import torch

import tomesd
from tome_core import bipartite_soft_matching_random2d
from tomesd.bench.measures.host_cost import host_work
from tomesd.quality import metrics, sampling
from tomesd.quality import model as M


def stacks(unet):
    """Each transformer's stack of blocks."""
    return [module.transformer_blocks for module in unet.modules()
            if type(module).__name__ == "Transformer2DModel" and len(module.transformer_blocks)]


def merged_here(x, max_downsample):
    """Whether tokens x [B, N, C] of a square grid lie at a level merged with `max_downsample`."""
    return M.IMAGE // math.isqrt(x.shape[1]) <= max_downsample


class _Weighed:
    """torch's SDPA, adding log(size) of each merged key to the scores of self-attention over a stage's merged
    tokens."""

    def __init__(self, fn):
        self.fn, self.log_sizes = fn, None  # [B, M] while a merged stage runs

    def __call__(self, query, key, value, attn_mask=None, **kwargs):
        sizes = self.log_sizes
        if sizes is not None and attn_mask is None and key.shape[-2] == query.shape[-2] == sizes.shape[-1]:
            attn_mask = sizes[:, None, None, :].to(query.dtype)
        return self.fn(query, key, value, attn_mask=attn_mask, **kwargs)


def apply_stage_merge(unet, ratio, max_downsample, prop=False, seed=0):
    """Hooks that merge each stack at its entry and restore every token at its exit; returns a remover."""
    handles = []
    generator = torch.Generator().manual_seed(seed)
    weighed = None
    if prop:
        weighed = torch.nn.functional.scaled_dot_product_attention = _Weighed(
            torch.nn.functional.scaled_dot_product_attention)
    for blocks in stacks(unet):
        state = {}

        def pre(module, args, kwargs, state=state):
            x = args[0] if args else kwargs["hidden_states"]
            if not merged_here(x, max_downsample):
                state.clear()
                return None
            n, side = x.shape[1], math.isqrt(x.shape[1])
            m, u = bipartite_soft_matching_random2d(x, side, side, 2, 2, int(n * ratio), no_rand=False,
                                                    generator=generator)
            xm = m(x)
            state.update(x=x, xm=xm, u=u)
            if weighed is not None:
                weighed.log_sizes = -torch.log(m.__self__.inv_counts[..., 0])
            if args:
                return (xm,) + tuple(args[1:]), kwargs
            return args, dict(kwargs, hidden_states=xm)

        def post(module, args, kwargs, out, state=state):
            if not state:
                return None
            restored = state["x"] + state["u"](out - state["xm"])
            state.clear()
            if weighed is not None:
                weighed.log_sizes = None
            return restored

        handles.append(blocks[0].register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(blocks[-1].register_forward_hook(post, with_kwargs=True))

    def remove():
        for h in handles:
            h.remove()
        if weighed is not None:
            torch.nn.functional.scaled_dot_product_attention = weighed.fn
    return remove


def merged_blocks(unet, max_downsample, x, t, c):
    """How many transformer blocks run at the merged levels in one forward."""
    seen = []

    def count(module, args, kwargs, size):
        if merged_here(args[0] if args else kwargs["hidden_states"], max_downsample):
            seen.append(size)

    hooks = [blocks[0].register_forward_pre_hook(lambda m, a, k, n=len(blocks): count(m, a, k, n), with_kwargs=True)
             for blocks in stacks(unet)]
    with torch.no_grad():
        unet(x, t, c)
    for h in hooks:
        h.remove()
    return sum(seen)


# Each stage setting against the per-block setting of the same ratio, levels and attention weighing.
PER_BLOCK_OF = {"stage r=0.5 md4": "per-block r=0.5 md4 attn+xattn+mlp",
                "stage r=0.25 md4": "per-block r=0.25 md4 attn+xattn+mlp",
                "stage r=0.5 md2": "per-block r=0.5 md2 attn+xattn+mlp",
                "stage r=0.5 md4 prop": "per-block r=0.5 md4 attn+xattn+mlp prop",
                "stage r=0.75 md4 prop": "per-block r=0.75 md4 attn+xattn+mlp prop"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--images", type=int, default=64)
    p.add_argument("--json", default=None)
    p.add_argument("--only", default=None, help="comma-separated setting names")
    args = p.parse_args()
    unet, labels_embedding, _ = M.load(arch="sdxl")
    labels = torch.arange(args.images) % M.NUM_CLASSES
    noise = sampling.noise(args.images, 0, "sdxl")
    settings = [("per-block r=0.5 md4 attn+xattn+mlp", "block", dict(ratio=0.5, max_downsample=4, merge_crossattn=True,
                                                                      merge_mlp=True)),
                ("stage r=0.5 md4", "stage", dict(ratio=0.5, max_downsample=4)),
                ("per-block r=0.5 md4 merge_mlp prop", "block", dict(ratio=0.5, max_downsample=4, merge_mlp=True,
                                                                      proportional_attention=True)),
                ("per-block r=0.25 md4 attn+xattn+mlp", "block", dict(ratio=0.25, max_downsample=4,
                                                                       merge_crossattn=True, merge_mlp=True)),
                ("stage r=0.25 md4", "stage", dict(ratio=0.25, max_downsample=4)),
                ("per-block r=0.5 md2 attn+xattn+mlp", "block", dict(ratio=0.5, max_downsample=2, merge_crossattn=True,
                                                                      merge_mlp=True)),
                ("stage r=0.5 md2", "stage", dict(ratio=0.5, max_downsample=2)),
                ("per-block r=0.5 md4 attn+xattn+mlp prop", "block", dict(ratio=0.5, max_downsample=4,
                                                                           merge_crossattn=True, merge_mlp=True,
                                                                           proportional_attention=True)),
                ("stage r=0.5 md4 prop", "stage", dict(ratio=0.5, max_downsample=4, prop=True)),
                ("per-block r=0.75 md4 attn+xattn+mlp prop", "block", dict(ratio=0.75, max_downsample=4,
                                                                            merge_crossattn=True, merge_mlp=True,
                                                                            proportional_attention=True)),
                ("stage r=0.75 md4 prop", "stage", dict(ratio=0.75, max_downsample=4, prop=True))]
    if args.only:
        settings = [s for s in settings if s[0] in args.only.split(",")]

    def sample():
        out = []
        for s in range(0, args.images, 16):
            out.append(sampling.sample(unet, labels_embedding, labels[s:s + 16], noise[s:s + 16], arch="sdxl"))
        return torch.cat(out)

    base = sample()
    x = torch.randn(2, 1, M.IMAGE, M.IMAGE)
    t = torch.tensor(500)
    c = M.context(labels_embedding, torch.tensor([1, M.NULL_CLASS]))
    with torch.no_grad():
        plain = host_work(lambda: unet(x, t, c))
    rows, per_image = [], {}
    for name, kind, kw in settings:
        if kind == "block":
            tomesd.apply_patch(unet, **kw)
            remove = lambda: tomesd.remove_patch(unet)  # noqa: E731
        else:
            remove = apply_stage_merge(unet, kw["ratio"], kw["max_downsample"], kw.get("prop", False))
        try:
            images = sample()
            with torch.no_grad():
                added = host_work(lambda: unet(x, t, c)).minus(plain)
        finally:
            remove()
        blocks = merged_blocks(unet, kw["max_downsample"], x, t, c)
        close = metrics.closeness(images, base)
        per_image[name] = metrics.psnr_per_image(images, base)
        row = dict(name=name, **close, merged_blocks=blocks, **added.per(blocks))
        counterpart = PER_BLOCK_OF.get(name)
        if counterpart in per_image:
            # Paired over the same noise: the spread between images cancels, so a difference far below the
            # unpaired resolution is resolved.
            diff = per_image[name] - per_image[counterpart]
            row.update(vs=counterpart, paired_db=float(diff.mean()), paired_se=metrics.standard_error(diff))
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"yardstick": "sdxl", "images": args.images, "steps": sampling.STEPS, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
