"""The bench's configurations traced on the meta device for the device-time model (tomesd/devicetime): the
architecture built at full width with no weights, its inputs at the run's size, each configuration applied as
the bench applies it (runner.Config, kit.method) around one traced forward."""
from __future__ import annotations

from dataclasses import fields
from typing import Any, Dict, List

from ..devicetime.trace import Launch, TraceRefused, trace
from .kits.configs import ARCHS
from .measures.report import label
from .measures.runner import Config, Settings, configurations


def settings_from(values: Dict[str, Any]) -> Settings:
    """A bench JSON's settings (or the command line's) as runner.Settings; unknown keys are left out."""
    names = {f.name for f in fields(Settings)}
    given = {k: (tuple(v) if isinstance(v, list) else v) for k, v in values.items() if k in names}
    return Settings(**given)


class ForwardTracer:
    """One architecture at one size, built on the meta device once; `launches(...)` traces a configuration."""

    def __init__(self, values: Dict[str, Any]):
        import torch

        from .kits.torch_kit import TorchKit

        self.settings = settings_from(values)
        s = self.settings
        reads = ARCHS[s.config].host_reads
        if reads:
            raise TraceRefused(f"{s.config}'s forward reads tensors on the host ({reads}), which the meta device "
                               f"cannot run")
        self.kit = TorchKit("meta", s.dtype)
        with torch.device("meta"):
            self.model = self.kit.build(s.config, s.seed, s.depth)
        self.inputs = self.kit.inputs(s.config, s.batch, s.res, s.seed + 1, s.frames, s.width or None)

    def configs(self) -> List[Config]:
        return [c for c in configurations(self.settings) if c.cache is None]

    def launches(self, which: Any) -> List[Launch]:
        """The kernels one forward launches under a configuration: a runner.Config or its label."""
        config = which if isinstance(which, Config) else self._by_label(which)
        name = config.kwargs or label(config, self.kit.reference_name)
        if config.reuse_steps > 1:
            raise TraceRefused(f"{name}: a matching reused over steps spans several forwards; the trace sees one")
        try:
            with self.kit.method(self.model, config, self.settings):
                return trace(lambda: self.kit.forward(self.model, self.inputs))
        except TraceRefused as exc:
            raise TraceRefused(f"{name} on {self.settings.config}: its forward "
                               f"reads a tensor's value on the host ({exc}), which the meta device cannot run") from exc

    def _by_label(self, name: str) -> Config:
        for config in self.configs():
            if label(config, self.kit.reference_name) == name:
                return config
        raise KeyError(f"no configuration of these settings is labelled {name!r}")


def gpu_dtype(arch: Any) -> str:
    """The dtype an architecture runs at on a GPU, as the GPU report times it: float16 for the UNets, SD3 and PixArt
    (whose pipelines are published in it), bfloat16 for the later transformers (Flux, Wan, Qwen-Image, ...)."""
    return "float16" if not arch.transformer or arch.cls in ("SD3Transformer2DModel", "PixArtTransformer2DModel") \
        else "bfloat16"
