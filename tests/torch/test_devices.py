"""The patched model across devices on one machine: offloaded (diffusers' group offloading to memory and to
disk, accelerate's sequential offload and `dispatch_model` with blocks on disk) it equals the patched model
kept in place; split over two devices (accelerate's device hooks, a `meta` device standing in for the second)
each block merges on the device its tokens are on."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import tiny_torch as T
import tomesd

KINDS = ("sd3", "flux")


def build(kind):
    return T.transformer("sd3") if kind == "sd3" else T.flux()


def inputs(kind):
    return T.transformer_inputs("sd3") if kind == "sd3" else T.flux_inputs()


def run(kind, model):
    with torch.no_grad():
        return model(**inputs(kind), return_dict=False)[0]


def blocks(model):
    return list(model.transformer_blocks) + list(getattr(model, "single_transformer_blocks", []))


def offload(model, how, tmp_path):
    cpu = torch.device("cpu")
    if how == "group-block":
        model.enable_group_offload(cpu, offload_device=cpu, offload_type="block_level", num_blocks_per_group=1)
    elif how == "group-leaf":
        model.enable_group_offload(cpu, offload_device=cpu, offload_type="leaf_level")
    elif how == "group-disk":
        model.enable_group_offload(cpu, offload_device=cpu, offload_type="block_level", num_blocks_per_group=1,
                                   offload_to_disk_path=str(tmp_path))
    elif how == "sequential":
        from accelerate import cpu_offload

        cpu_offload(model, execution_device=cpu)
    elif how == "dispatch-disk":
        from accelerate import dispatch_model

        names = [n for n, _ in model.named_children()]
        device_map = {n: "cpu" for n in names}
        device_map["transformer_blocks"] = "disk"
        dispatch_model(model, device_map=device_map, main_device="cpu", offload_dir=str(tmp_path))
    return model


@pytest.mark.parametrize("how", ["group-block", "group-leaf", "group-disk", "sequential", "dispatch-disk"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("patch_first", [False, True], ids=["offload-then-patch", "patch-then-offload"])
def test_offloaded_patched_model_equals_the_patched_model(kind, how, patch_first, tmp_path, unpatch):
    base = run(kind, build(kind))
    kept = build(kind)
    tomesd.apply_patch(kept, ratio=0.5)
    unpatch(kept)
    expected = run(kind, kept)
    assert (expected - base).abs().max().item() > 1e-2  # the patch acts
    model = build(kind)
    unpatch(model)
    if patch_first:
        tomesd.apply_patch(model, ratio=0.5)
    offload(model, how, tmp_path)
    if not patch_first:
        tomesd.apply_patch(model, ratio=0.5)
    assert torch.equal(run(kind, model), expected)


def split(model, device, first):
    """Blocks from `first` on (and the output layers) moved to `device`, each with accelerate's device hook,
    which moves the module's inputs to its device inside the module's forward (what `dispatch_model` puts
    on each module of a device map)."""
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    for module in blocks(model)[first:] + [model.norm_out, model.proj_out]:
        module.to(device)
        add_hook_to_module(module, AlignDevicesHook(execution_device=device))
    return model


class MixedDevices(TorchDispatchMode):
    """The ops that read tensors (not 0-d ones) on more than one device."""

    def __init__(self):
        super().__init__()
        self.ops = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat = list(args) + list(kwargs.values())
        flat += [t for a in flat if isinstance(a, (list, tuple)) for t in a]
        devices = {t.device.type for t in flat if isinstance(t, torch.Tensor) and t.dim() > 0}
        if len(devices) > 1:
            self.ops.add(str(func))
        return func(*args, **kwargs)


@pytest.mark.parametrize("kind", KINDS)
def test_a_model_split_over_devices_merges_each_block_on_its_tokens_device(kind, unpatch):
    """The second device is `meta` (no values, so no second real device is needed): before the fix the
    merge of the first block on it was built from the input recorded on the first device (index_add: self
    meta, index cpu). The same split with every block on CPU, through the same hooks, equals the unsplit
    patched model."""
    unsplit = build(kind)
    tomesd.apply_patch(unsplit, ratio=0.5)
    unpatch(unsplit)
    expected = run(kind, unsplit)

    model = split(build(kind), "meta", first=1)
    tomesd.apply_patch(model, ratio=0.5)
    unpatch(model)
    with tomesd.observe(model) as seen, MixedDevices() as mixed:
        out = run(kind, model)
    assert out.device.type == "meta"
    assert seen.calls[0].computed == len(blocks(model))  # every block merged, those on meta too
    # meta kernels take a CPU index where a CUDA kernel would refuse one: each block's partition and index maps
    # must be on its own device all the same
    assert not mixed.ops, f"ops reading tensors of two devices: {sorted(mixed.ops)}"

    model = split(build(kind), "cpu", first=1)
    tomesd.apply_patch(model, ratio=0.5)
    unpatch(model)
    assert torch.equal(run(kind, model), expected)
