"""The floor of a merged block's host time where compute is negligible: the kernels one block of merge mode cannot do
without (normalise, take, bmm, max, sort, the index map's six, the mean merge, the unmerge), called straight on torch
with no Python of ours between them, at a yardstick's tiny shapes (host_cost.NARROW, batch 2, an 8x8 latent).

Three copies of one model (weights shared) are timed interleaved in one process on this CPU: unpatched, ToMe r=0.5,
and unpatched with a pre-hook on every transformer block that runs those bare kernels once on the block's tokens
(the result dropped). The third is the floor in the model's own context (the same kernels timed in a tight loop,
printed beside it, run 1.6-2.4x faster: caches stay warm there).

It answers whether item 3's goal (ToMe's added host time at most 15% of the unpatched forward's on SD3, Flux and
Wan) can be met by cutting Python and views alone: if the bare kernels already cost more, it cannot.

    TOME_REFS_DIR=.refs python benchmarks/host_floor.py [--models sd3,flux,wan] [--repeats 21]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def bare_block(torch, x, order, position, num_src: int, r: int, loops: int) -> float:
    """Seconds per merged block of the bare kernel sequence (match, index map, merge, unmerge) on `x` [B, N, C]."""
    b, n, c = x.shape
    m, num_dst, num_unm = n - r, n - num_src, num_src - r
    first = (torch.arange(b) * m).reshape(b, 1)
    unmerged = torch.arange(num_unm).reshape(1, num_unm) + first
    dst = torch.arange(num_dst).reshape(1, num_dst) + first + num_unm
    times = []
    for _ in range(loops):
        started = time.perf_counter()
        unit = torch.index_select(x / torch.linalg.vector_norm(x, dim=-1, keepdim=True), 1, order)
        scores = torch.bmm(unit[:, :num_src], unit[:, num_src:].transpose(1, 2))
        node_max, node_idx = torch.max(scores, -1)
        edge = torch.sort(node_max, dim=-1, descending=True, stable=True).indices
        merged = torch.gather(node_idx, 1, edge[:, :r]) + first + num_unm
        src_rows = torch.empty_like(edge).scatter_(1, edge, torch.cat([merged, unmerged.expand(b, num_unm)], 1))
        rows = torch.index_select(torch.cat([src_rows, dst.expand(b, num_dst)], 1), 1, position).reshape(b * n)
        flat = x.reshape(b * n, c)
        out = torch.empty((b * m, c)).scatter_reduce_(0, rows.unsqueeze(1).expand(flat.shape), flat, "mean",
                                                       include_self=False)
        torch.index_select(out, 0, rows)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="sd3,flux,wan")
    parser.add_argument("--repeats", type=int, default=21)
    opts = parser.parse_args()

    import torch

    import tomesd
    from host_time import interleaved
    from tomesd.bench.kits.torch_kit import TorchKit
    from tomesd.bench.measures.host_cost import build_narrow, narrow_inputs, reduced_blocks

    torch.set_num_threads(1)
    kit = TorchKit("cpu", "float32")
    for name in opts.models.split(","):
        base = build_narrow(name)
        inputs = narrow_inputs(name)
        tome = kit.share_copy(base)
        tomesd.apply_patch(tome, ratio=0.5)
        bare = kit.share_copy(base)
        hooked = _hook_bare_kernels(torch, bare)
        forward = lambda model: model(**inputs)  # noqa: E731
        models = {"unpatched": base, "ToMe r=0.5": tome, "bare kernels": bare}
        with torch.no_grad():
            blocks = reduced_blocks(tome, lambda: forward(tome))
            for model in models.values():
                forward(model)
            times = interleaved(models, forward, opts.repeats)
            tight = bare_block(torch, *hooked["last"], 200)
        unpatched, patched, floor = (statistics.median(times[k]) for k in models)
        print(f"{name}: {blocks} merged blocks, {hooked['count']} with the bare kernels, tokens "
              f"{list(hooked['last'][0].shape)}; unpatched {unpatched * 1e3:.2f} ms; ToMe adds "
              f"{(patched - unpatched) * 1e3:.2f} ms ({(patched / unpatched - 1) * 100:.0f}%), "
              f"{(patched - unpatched) / blocks * 1e6:.0f} us per merged block; the bare kernels add "
              f"{(floor - unpatched) * 1e3:.2f} ms ({(floor / unpatched - 1) * 100:.0f}%), "
              f"{(floor - unpatched) / hooked['count'] * 1e6:.0f} us per block (in a tight loop {tight * 1e6:.0f} us)")


def _hook_bare_kernels(torch, model):
    """A forward pre-hook on each transformer block of `model` running bare_block once on the block's image tokens
    (the result dropped): ToMe's kernels in the model's own context, with one hook's Python around them."""
    names = ("transformer_blocks", "single_transformer_blocks", "blocks")
    blocks = [b for n in names for b in getattr(model, n, [])]
    seen = {"count": len(blocks), "last": None}
    partitions = {}

    def pre(module, args, kwargs):
        x = kwargs.get("hidden_states", args[0] if args else None)
        n = x.shape[1]
        if n not in partitions:
            num_dst = n // 4
            order = torch.cat([torch.arange(num_dst, n), torch.arange(num_dst)])
            partitions[n] = (order, torch.argsort(order), n - num_dst, min(n // 2, n - num_dst))
        seen["last"] = (x, *partitions[n])
        bare_block(torch, *seen["last"], 1)

    for block in blocks:
        block.register_forward_pre_hook(pre, with_kwargs=True)
    return seen


if __name__ == "__main__":
    main()
