"""What every framework's kit shares: the ToMe methods the benchmark compares (the baseline, this project's
patch, the framework's reference implementation), the denoiser call a compiled entry is made from, the loop's
timesteps and the timing of one piece of work."""
from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Dict, Iterator, List, Tuple

METHODS = ("baseline", "tome", "reference")


class MissingBackend(RuntimeError):
    pass


class _Kit:
    """The parts every framework shares: the baseline, our patch, and where our time goes."""

    name = ""

    @contextlib.contextmanager
    def method(self, model: Any, config: Any, settings: Any) -> Iterator[None]:
        """The model under one configuration (runner.Config) for the length of the block."""
        import tomesd

        from .caches import enabled

        if config.method == "baseline":
            with enabled(model, config.cache, settings.steps):
                yield
        elif config.method == "tome":
            with enabled(model, config.cache, settings.steps):  # the cache first, the patch's hooks inside it
                tomesd.apply_patch(model, **config.patch_kwargs(settings))
                try:
                    yield
                finally:
                    tomesd.remove_patch(model)
        else:
            # The references have no "finest attention level" default: theirs is 1.
            with self.reference(model, config.ratio, settings.max_downsample or 1):
                yield

    def patched_copy(self, model: Any, config: Any, settings: Any) -> Any:
        """A copy of the model that shares its weights, with the configuration's patch applied for good:
        one object per configuration to compile, so no patching ever changes a compiled model's hooks."""
        import tomesd

        model = self.share_copy(model)
        if config.method == "tome":
            tomesd.apply_patch(model, **config.patch_kwargs(settings))
        elif config.method == "reference":
            self.apply_reference(model, config.ratio, settings.max_downsample or 1)
        return model

    def compile(self, model: Any, backend: str, mode: Optional[str] = None, regional: bool = False) -> Any:
        raise MissingBackend(f"--compile needs torch (torch.compile); the {self.name} backend has none here")

    def machinery(self) -> Dict[str, List[Tuple[Any, str]]]:
        """(owner, attribute) of the reference's functions that do its ToMe work, for timing them. This
        project's own work is timed through its inspection seam (tomesd.observe), never by swapping."""
        reference = self.reference_machinery()
        return {"reference": reference} if reference else {}



def loop_timesteps(n: int) -> List[int]:
    """n distinct timesteps from 999 down, evenly spaced as a DDIM schedule's."""
    return [999 - (999 * i) // n for i in range(n)]


class _Compiled:
    """A configuration's compiled entry: called with the inputs as they are."""

    def __init__(self, call: Callable[..., Any]):
        self._call = call

    def __call__(self, *inputs: Any) -> Any:
        return self._call(*inputs)


def _call_model(model: Any, x: Any, t: Any, c: Any, extra: Dict[str, Any]) -> Any:
    """One denoiser call: a UNet takes (sample, timestep, text); a transformer takes keywords and a
    timestep per sample."""
    if "UNet" in type(model).__name__:
        return model(x, t, c, **extra).sample
    if type(model).__name__ == "ZImageTransformer2DModel":
        # Lists of per-sample latents [C, 1, H, W] and captions [L, D], as ZImagePipeline unbinds its batch; its
        # timestep runs from 1 (noise) to 0, (1000 - t) / 1000; the outputs (a list) stacked back into a batch.
        import torch

        out = model(list(x.unbind(0)), (1000 - t.expand(x.shape[0])) / 1000, list(c.unbind(0)), return_dict=False)[0]
        return torch.stack(out)
    if type(model).__name__ == "HunyuanVideo15Transformer3DModel":
        t = t.to(x.dtype)  # as its pipeline passes it (its time embedding takes no integer timestep)
    return model(hidden_states=x, timestep=t.expand(x.shape[0]), encoder_hidden_states=c, **extra).sample



def timed(kit: Any, fn: Callable[[], Any]) -> float:
    kit.sync()
    start = time.perf_counter()
    fn()
    kit.sync()
    return time.perf_counter() - start
