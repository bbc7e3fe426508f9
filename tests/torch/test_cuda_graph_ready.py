"""Ready for CUDA graphs (`torch.compile(mode="reduce-overhead")`): once warmed up, a compiled patched model's call
reads no tensor value back to the host and copies nothing from the host to the device, whole-model compiled or with
its blocks compiled on their own (compile_repeated_blocks), in merge and downsample modes.

Shown on the CPU with the model on the meta device: every op a call dispatches is seen (the compiled graphs run as
aten ops, "aot_eager"), a host read is an `aten._local_scalar_dense` (`.item()`, `bool(tensor)`, ...) and a copy from
the host is an op given a CPU tensor while the model's tensors are on another device (what a CUDA graph cannot
replay: on a GPU each is a synchronous host-to-device copy)."""
import pytest
import torch
import torch._dynamo
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import tiny_torch as T
import tomesd

HOST_READS = ("aten._local_scalar_dense", "aten.item", "aten.is_nonzero", "aten.equal")


class HostTraffic(TorchDispatchMode):
    """The ops of a forward that read a value on the host, and those that take a CPU tensor into an op on another
    device."""

    def __init__(self) -> None:
        super().__init__()
        self.reads, self.copies, self.ops = [], [], 0

    @classmethod
    def is_infra_mode(cls) -> bool:
        return True  # dynamo runs compiled frames under it (it declines a user's mode), and the mode sees their ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        name = str(func.overloadpacket)
        out = func(*args, **(kwargs or {}))
        devices = {t.device.type for t in tree_leaves((args, kwargs or {}, out)) if isinstance(t, torch.Tensor)}
        if any(name.startswith(read) for read in HOST_READS):
            self.reads.append(name)
        if "cpu" in devices and len(devices) > 1 or name in ("aten.lift_fresh", "aten.lift_fresh_copy"):
            self.copies.append(name)
        return out


def _meta_unet():
    """A tiny SD1 UNet on the meta device, and its keyword inputs at a timestep."""
    from diffusers import UNet2DConditionModel

    with torch.device("meta"):
        unet = UNet2DConditionModel(**T.SD1_UNET).eval()
        x, c = torch.randn(2, 4, 16, 16), torch.randn(2, 7, 32)
    return unet, lambda t: dict(sample=x, timestep=torch.full((), t, device="meta"), encoder_hidden_states=c)


def _meta_transformer(kind):
    """A tiny Flux or Wan on the meta device, and its keyword inputs at a timestep."""
    from diffusers import FluxTransformer2DModel, WanTransformer3DModel

    cls, config, inputs = ((FluxTransformer2DModel, T.FLUX, T.flux_inputs()) if kind == "flux" else
                           (WanTransformer3DModel, T.WAN, T.wan_inputs()))
    with torch.device("meta"):
        model = cls(**config).eval()
    inputs = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    return model, lambda t: {**inputs, "timestep": torch.full(inputs["timestep"].shape, t, device="meta")}


MODELS = {"unet": _meta_unet, "flux": lambda: _meta_transformer("flux"), "wan": lambda: _meta_transformer("wan")}
SETTINGS = {"merge": dict(ratio=0.5), "downsample": dict(mode="downsample")}


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# Flux's downsampling reads its grid from its ids on the host, which a whole-model graph cannot: refused by name
# there (test_downsample_dispatch.py); for blocks compiled on their own, the eager root reads it once per ids tensor
# (a pipeline's run), which the meta device cannot: test_flux_downsampling_reads_its_ids_once_per_ids_tensor.
CASES = [(kind, mode, compiled) for kind in sorted(MODELS) for mode in sorted(SETTINGS) for compiled in
         ("whole", "regional") if (kind, mode) != ("flux", "downsample")]


@pytest.mark.parametrize("kind,mode,compiled", CASES)
def test_a_warmed_up_compiled_call_reads_nothing_back_and_copies_nothing_in(kind, mode, compiled):
    model, inputs = MODELS[kind]()
    steps = [inputs(t) for t in (999.0, 500.0, 21.0)]  # made before the count: the caller's tensors
    tomesd.apply_patch(model, **SETTINGS[mode])
    try:
        if compiled == "whole":
            forward = torch.compile(model, fullgraph=True, backend="aot_eager")
        else:
            model.compile_repeated_blocks(fullgraph=True, backend="aot_eager")
            forward = model
        with torch.no_grad():
            for step in steps[:2]:  # warm-up: compiles, keeps what a call keeps (index tensors on the device)
                forward(**step)
            seen = HostTraffic()
            with seen, torch._dynamo.config.patch(error_on_recompile=True):
                out = forward(**steps[2]).sample
    finally:
        tomesd.remove_patch(model)
    assert out.device.type == "meta" and seen.ops > 50  # the forward ran under the mode
    assert seen.reads == [] and seen.copies == []


def test_flux_downsampling_reads_its_ids_once_per_ids_tensor():
    """Flux's blocks compiled on their own, mode='downsample': the eager root reads the grid from the ids at the
    first call that brings them, and no call after reads anything (on the CPU: host reads are seen there too)."""
    model, inputs = T.flux(), T.flux_inputs()
    steps = [{**inputs, "timestep": torch.full_like(inputs["timestep"], t)} for t in (0.9, 0.5, 0.1)]
    tomesd.apply_patch(model, mode="downsample")
    model.compile_repeated_blocks(fullgraph=True, backend="aot_eager")
    try:
        with torch.no_grad():
            first = HostTraffic()
            with first:
                model(**steps[0])
            for step in steps[1:2]:
                model(**step)
            seen = HostTraffic()
            with seen, torch._dynamo.config.patch(error_on_recompile=True):
                model(**steps[2])
    finally:
        tomesd.remove_patch(model)
    assert first.reads and seen.ops > 50  # the first call read the ids; the forward ran under the mode
    assert seen.reads == []
