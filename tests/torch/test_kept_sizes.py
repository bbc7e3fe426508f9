"""A patch serving many sizes keeps what it keeps across calls (index constants, plans) for its `kept_sizes` most
recent sizes and devices only: flat after the first N, and a size that comes back rebuilds the same constants."""
import pytest
import torch

import tiny_torch as T
import tomesd
from tomesd.runtime.tome_patch import PATCH_ATTR

SIZES = [(h, w) for h in range(8, 38, 2) for w in range(8, 38, 2)][:200]


def _bytes(*values):
    """Bytes of the tensors in `values` (dicts, tuples, lists and objects walked), each tensor counted once."""
    seen, total, stack = set(), 0, list(values)
    while stack:
        value = stack.pop()
        if isinstance(value, torch.Tensor):
            if id(value) not in seen:
                seen.add(id(value))
                total += value.numel() * value.element_size()
        elif isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, (tuple, list)):
            stack.extend(value)
        elif hasattr(value, "__dict__") or hasattr(value, "__slots__"):
            stack.extend(getattr(value, name, None) for name in (getattr(value, "__slots__", ()) or vars(value)))
    return total


def test_constants_stay_flat_over_200_sizes_and_a_returning_size_rebuilds_them():
    unet = T.unet()
    limit = 6
    tomesd.apply_patch(unet, ratio=0.5, kept_sizes=limit)
    kept = getattr(unet, PATCH_ATTR).matcher.kept
    first, own, held = {}, [], []
    c = torch.randn(1, 7, 32, generator=torch.Generator().manual_seed(2))
    try:
        with torch.no_grad():
            for i, (h, w) in enumerate(SIZES):
                x = torch.randn(1, 4, h, w, generator=torch.Generator().manual_seed(i))
                first[(h, w)] = (x, unet(x, torch.tensor(500.0), c).sample)
                newest = next(reversed(kept._sizes.values()))
                own.append(_bytes(newest.memo, newest.plans))  # what this size keeps
                held.append((len(kept), _bytes(*[(size.memo, size.plans) for size in kept._sizes.values()])))
            again = {size: unet(first[size][0], torch.tensor(500.0), c).sample for size in SIZES[:3]}
    finally:
        tomesd.remove_patch(unet)
    assert min(own) > 0  # every size keeps constants
    for i, (count, total) in enumerate(held):
        # exactly the `limit` most recent sizes' constants, nothing of the sizes before them
        assert count == min(i + 1, limit) and total == sum(own[max(0, i - limit + 1):i + 1]), i
    assert max(total for _, total in held) <= limit * max(own)  # flat: bounded by `limit` sizes, not by 200
    for size, out in again.items():  # evicted long ago, rebuilt: the same outputs
        assert torch.equal(out, first[size][1])


def test_kept_sizes_is_validated_and_defaults_to_16():
    unet = T.unet()
    with pytest.raises(ValueError, match="kept_sizes must be a positive int"):
        tomesd.apply_patch(unet, ratio=0.5, kept_sizes=0)
    assert tomesd.ToMeConfig().args.kept_sizes == 16 and tomesd.ToDoConfig(kept_sizes=3).args.kept_sizes == 3
    tomesd.apply_patch(unet, ratio=0.5)
    try:
        assert getattr(unet, PATCH_ATTR).matcher.kept.limit == 16
    finally:
        tomesd.remove_patch(unet)


def test_a_comfyui_wrapper_holds_the_patches_of_its_kept_sizes_most_recent_models():
    from tome_core import ToMeArgs
    from tomesd.hosts.comfyui_patcher import ComfyToMe

    wrapper = ComfyToMe(ToMeArgs(ratio=0.5, kept_sizes=2))
    nets = [T.unet(seed=i) for i in range(4)]
    patches = [wrapper.prepare(net) for net in nets]
    assert [patch.root for patch in wrapper.patches] == nets[-2:]
    assert wrapper.prepare(nets[3]) is patches[3] and wrapper.prepare(nets[0]) is not patches[0]  # rebuilt
