"""The benchmark's paddle kit: ppdiffusers' image UNets built from their configs with random weights, their
inputs, a forward under no_grad, and ppdiffusers' built-in ToMe as the reference."""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, List, Optional, Tuple

from .configs import CONFIGS, TEXT_TOKENS
from .kit_base import MissingBackend, _Kit, loop_timesteps


class PaddleKit(_Kit):
    name = "paddle"
    reference_name = "ppdiffusers built-in"

    def __init__(self, device: str, dtype: str):
        try:
            # ppdiffusers first: it imports paddle, so a missing paddle is still named, and a folder called
            # `paddle` on sys.path is never imported as if it were the framework.
            import ppdiffusers  # noqa: F401
            import paddle
        except ImportError as exc:
            raise MissingBackend(f"--backend paddle needs paddlepaddle and ppdiffusers ({exc.name} is not installed)") from exc
        self.paddle = paddle
        self.gpu = device in ("cuda", "gpu")
        if self.gpu and not paddle.device.is_compiled_with_cuda():
            raise MissingBackend("--device gpu: this paddle build has no CUDA (install paddlepaddle-gpu)")
        paddle.set_device("gpu" if self.gpu else "cpu")
        self.dtype = self.dtype_name = dtype

    def build(self, config: str, seed: int, depth: Optional[int] = None) -> Any:
        from ppdiffusers import UNet2DConditionModel

        if config not in CONFIGS:
            raise MissingBackend(f"--arch {config} runs on torch only for now; the paddle benchmark builds the "
                                 f"SD1.5 UNet (and the tiny one)")

        self.paddle.seed(seed)
        model = UNet2DConditionModel(**CONFIGS[config])
        if self.dtype != "float32":
            model = model.to(dtype=self.dtype)
        model.eval()
        return model

    def inputs(self, config: str, batch: int, res: int, seed: int, frames: int = 16,
               width: Optional[int] = None) -> Tuple[Any, ...]:
        """(latent, timestep, text) of the image UNets this backend builds (`frames` is for video: none here)."""
        import numpy as np

        rng = np.random.RandomState(seed)
        latent = res // 8
        x = rng.standard_normal((batch, 4, latent, (width or res) // 8)).astype("float32")
        c = rng.standard_normal((batch, TEXT_TOKENS, CONFIGS[config]["cross_attention_dim"])).astype("float32")
        cast = lambda a: self.paddle.to_tensor(a).astype(self.dtype)  # noqa: E731
        return cast(x), self.paddle.to_tensor(500), cast(c)

    def timesteps(self, n: int) -> List[Any]:
        return [self.paddle.to_tensor(t) for t in loop_timesteps(n)]

    def forward(self, model: Any, inputs: Tuple[Any, ...]) -> Any:
        with self.paddle.no_grad():  # scoped: the caller's grad mode is left as it was
            return model(*inputs).sample

    def sync(self) -> None:
        if self.gpu:
            self.paddle.device.synchronize()

    def on_gpu(self) -> bool:
        return self.gpu

    def reset_peak(self) -> None:
        self.paddle.device.cuda.reset_max_memory_allocated()

    def peak_bytes(self) -> int:
        return int(self.paddle.device.cuda.max_memory_allocated())

    def to_numpy(self, x: Any) -> Any:
        return x.astype("float32").numpy()

    @contextlib.contextmanager
    def reference(self, model: Any, ratio: float, max_downsample: int) -> Iterator[None]:
        from ...apply_tome import builtin_methods

        with builtin_methods():
            model.apply_tome(ratio=ratio, max_downsample=max_downsample)
            try:
                yield
            finally:
                model.remove_tome()

    def reference_machinery(self) -> List[Tuple[Any, str]]:
        from ppdiffusers.patches import tomesd_patch_utils

        return [(tomesd_patch_utils, "bipartite_soft_matching_random2d")]

