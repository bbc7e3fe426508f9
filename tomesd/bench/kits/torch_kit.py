"""The benchmark's torch kit: the denoisers built from their configs with random weights, their inputs, a
forward under no_grad, torch.compile of each configuration apart, and tomesd 0.1.3 as the reference."""
from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List, Optional, Tuple

from .configs import (ARCHS, FLUX_TEXT_TOKENS, HUNYUAN_VIDEO15_TEXT, QWEN_TEXT_TOKENS, TEXT_TOKENS, WAN_TEXT_TOKENS,
                      Z_IMAGE_TEXT_TOKENS)
from .kit_base import MissingBackend, _call_model, _Compiled, _Kit, loop_timesteps


class TorchKit(_Kit):
    name = "torch"
    reference_name = "tomesd 0.1.3"

    def __init__(self, device: str, dtype: str):
        try:
            import diffusers  # noqa: F401
            import torch
        except ImportError as exc:
            raise MissingBackend(f"--backend torch needs torch and diffusers ({exc.name} is not installed)") from exc
        self.torch = torch
        self.device = torch.device("cuda" if device in ("cuda", "gpu") else device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise MissingBackend("--device cuda: torch sees no CUDA device")
        self.dtype, self.dtype_name = getattr(torch, dtype), dtype

    def build(self, config: str, seed: int, depth: Optional[int] = None) -> Any:
        import diffusers

        arch = ARCHS[config]
        self.torch.manual_seed(seed)
        if arch.motion is not None:  # AnimateDiff: the image UNet with a motion adapter's modules between its blocks
            model = diffusers.UNetMotionModel.from_unet2d(diffusers.UNet2DConditionModel(**arch.config),
                                                          diffusers.MotionAdapter(**arch.motion))
            with self.torch.no_grad():  # the adapter's output layers start at zero: give them weights
                for name, p in model.named_parameters():
                    if "motion_modules" in name and name.endswith("proj_out.weight"):
                        p.normal_(0, p.shape[1] ** -0.5)
            model = model.to(self.device)
        elif self.device.type == "cuda":
            # Initialised on the GPU itself: full-size random weights on the host take minutes to draw
            # (the GPU report builds some twenty models), on the GPU a second or two.
            with self.torch.device(self.device):
                model = getattr(diffusers, arch.cls)(**arch.build_config(depth))
        else:
            model = getattr(diffusers, arch.cls)(**arch.build_config(depth)).to(self.device)
        if self.dtype != self.torch.float32:
            model = model.to(dtype=self.dtype)
        return model.eval()

    def inputs(self, config: str, batch: int, res: int, seed: int, frames: int = 16,
               width: Optional[int] = None) -> Tuple[Any, ...]:
        """(latent, timestep, text, extra keyword inputs): the timestep second, as the loop replaces it.
        `res` is the height (and the width unless `width` is given), in pixels. Video: a [batch, C,
        frames, H, W] latent and the text once per frame, as AnimateDiff's pipeline repeats it; Wan: its
        VAE's (frames - 1) / 4 + 1 latent frames and the text once."""
        arch, torch = ARCHS[config], self.torch
        gen = torch.Generator().manual_seed(seed)
        latent = res // arch.vae_factor
        latent_w = (width or res) // arch.vae_factor
        cast = lambda t: t.to(self.device, self.dtype)  # noqa: E731
        extra: Dict[str, Any] = {}
        if arch.extra == "flux":  # a packed latent: one token per 2x2 latent patch, 4x the channels
            side = latent // 2
            x = cast(torch.randn(batch, side * side, 4 * arch.latent_channels, generator=gen))
            c = cast(torch.randn(batch, FLUX_TEXT_TOKENS, arch.text_dim, generator=gen))
            ids = torch.zeros(side, side, 3)
            ids[..., 1] += torch.arange(side)[:, None]
            ids[..., 2] += torch.arange(side)[None, :]
            extra.update(img_ids=cast(ids.reshape(-1, 3)), txt_ids=cast(torch.zeros(FLUX_TEXT_TOKENS, 3)),
                         guidance=cast(torch.full((batch,), 3.5)))
        elif arch.extra == "flux2":  # as Flux2Pipeline packs it: ids (t, row, col, l) with a batch axis
            side = latent // 2
            x = cast(torch.randn(batch, side * side, 4 * arch.latent_channels, generator=gen))
            c = cast(torch.randn(batch, FLUX_TEXT_TOKENS, arch.text_dim, generator=gen))
            n = torch.arange
            img_ids = torch.cartesian_prod(n(1), n(side), n(side), n(1))
            txt_ids = torch.cartesian_prod(n(1), n(1), n(1), n(FLUX_TEXT_TOKENS))
            extra.update(img_ids=img_ids[None].expand(batch, -1, -1).to(self.device),
                         txt_ids=txt_ids[None].expand(batch, -1, -1).to(self.device),
                         guidance=cast(torch.full((batch,), 4.0)) if arch.config.get("guidance_embeds", True) else None)
        elif arch.extra == "qwen-image":  # as QwenImagePipeline packs it; its grid comes in img_shapes
            side = latent // 2
            x = cast(torch.randn(batch, side * side, 4 * arch.latent_channels, generator=gen))
            c = cast(torch.randn(batch, QWEN_TEXT_TOKENS, arch.text_dim, generator=gen))
            extra.update(img_shapes=[[(1, side, side)]] * batch, encoder_hidden_states_mask=None)
        elif arch.extra == "z-image":  # batched here; _call_model unbinds them into ZImagePipeline's per-sample lists
            x = cast(torch.randn(batch, arch.latent_channels, 1, latent, latent_w, generator=gen))
            c = cast(torch.randn(batch, Z_IMAGE_TEXT_TOKENS, arch.text_dim, generator=gen))
        elif arch.extra == "hunyuanvideo-1.5":  # [noise, the condition's latent, its mask] (zero for text-to-video)
            shape = (batch, arch.latent_channels, (frames - 1) // 4 + 1, latent, latent_w)
            x = cast(torch.cat([torch.randn(*shape, generator=gen), torch.zeros(*shape),
                                torch.zeros(*shape[:1], 1, *shape[2:])], dim=1))
            (n1, v1), (n2, v2), (n3, _) = HUNYUAN_VIDEO15_TEXT[config]  # (tokens, valid) per stream
            c = cast(torch.randn(batch, n1, arch.text_dim, generator=gen))
            cfg = arch.config
            extra.update(encoder_attention_mask=cast(torch.arange(n1).expand(batch, n1) < v1),
                         encoder_hidden_states_2=cast(torch.randn(batch, n2, cfg["text_embed_2_dim"], generator=gen)),
                         encoder_attention_mask_2=cast(torch.arange(n2).expand(batch, n2) < v2),
                         image_embeds=cast(torch.zeros(batch, n3, cfg["image_embed_dim"])))
        elif arch.extra == "svd":  # [B, F, C, H, W]: noise and the conditioning image's latent; one image embedding
            x = cast(torch.randn(batch, frames, 2 * arch.latent_channels, latent, latent_w, generator=gen))
            c = cast(torch.randn(batch, 1, arch.text_dim, generator=gen))
            # fps - 1, motion bucket id, noise augmentation strength, as SVD's pipeline passes them
            extra["added_time_ids"] = cast(torch.tensor([[6.0, 127.0, 0.02]] * batch))
        elif arch.extra == "wan":
            x = cast(torch.randn(batch, arch.latent_channels, (frames - 1) // 4 + 1, latent, latent_w, generator=gen))
            c = cast(torch.randn(batch, WAN_TEXT_TOKENS, arch.text_dim, generator=gen))
        elif arch.video:
            x = cast(torch.randn(batch, arch.latent_channels, frames, latent, latent, generator=gen))
            c = cast(torch.randn(batch, TEXT_TOKENS, arch.text_dim, generator=gen)).repeat_interleave(frames, 0)
        else:
            x = cast(torch.randn(batch, arch.latent_channels, latent, latent_w, generator=gen))
            c = cast(torch.randn(batch, TEXT_TOKENS, arch.text_dim, generator=gen))
        if arch.extra == "sdxl":  # pooled text and the six size/crop numbers, as SDXL pipelines pass them
            extra["added_cond_kwargs"] = {"text_embeds": cast(torch.randn(batch, arch.pooled_dim, generator=gen)),
                                          "time_ids": cast(torch.tensor([[res, res, 0, 0, res, res]] * batch))}
        elif arch.pooled_dim:
            extra["pooled_projections"] = cast(torch.randn(batch, arch.pooled_dim, generator=gen))
        if arch.extra == "pixart":
            extra["added_cond_kwargs"] = {"resolution": cast(torch.tensor([[res, res]] * batch)),
                                          "aspect_ratio": cast(torch.ones(batch, 1))}
        return x, torch.tensor(500, device=self.device), c, extra

    def timesteps(self, n: int) -> List[Any]:
        return [self.torch.tensor(t, device=self.device) for t in loop_timesteps(n)]

    def forward(self, model: Any, inputs: Tuple[Any, ...]) -> Any:
        with self.torch.no_grad():  # scoped: the caller's grad mode is left as it was
            return model(*inputs) if isinstance(model, _Compiled) else _call_model(model, *inputs)

    def sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()

    def on_gpu(self) -> bool:
        return self.device.type == "cuda"

    def reset_peak(self) -> None:
        self.torch.cuda.reset_peak_memory_stats()

    def peak_bytes(self) -> int:
        return int(self.torch.cuda.max_memory_allocated())

    def to_numpy(self, x: Any) -> Any:
        return x.float().cpu().numpy()

    def share_copy(self, model: Any) -> Any:
        """A deep copy whose parameters and buffers are the original's (no second set of weights)."""
        import copy
        import itertools

        memo = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
        return copy.deepcopy(model, memo)

    def compile_backends(self) -> List[str]:
        return list(self.torch._dynamo.list_backends(exclude_tags=()))

    def compile(self, model: Any, backend: str, mode: Optional[str] = None, regional: bool = False) -> Any:
        """torch.compile of one configuration, isolated from the others. Dynamo caches compiled code
        per code object, and every configuration runs the same UNet code: compiled directly, a patched
        copy was served the graph traced for the unpatched baseline (torch 2.13: its output was the
        baseline's), and a graph break inside the UNet's block loop makes dynamo fall back to eager for
        that code in every configuration compiled after it. So each configuration is compiled through
        its own entry function (a code object of its own) with fullgraph=True: one whole graph, or an
        error. tests/cli/test_bench_compile.py checks each compiled output against its eager copy.

        `mode` is inductor's ("reduce-overhead": the graph replayed as CUDA graphs). Each configuration's
        graphs are then their own CUDA-graph tree and the bench calls them in turn, so every call begins a
        new step (torch.compiler.cudagraph_mark_step_begin) and its output is copied before the next.

        `regional`: the repeated blocks of a copy of the model compiled each on its own (diffusers'
        compile_repeated_blocks), the rest eager. The blocks' code is shared by every configuration's copy; their graphs are told apart by their guards
        (ToMe's links are on the patched copies' blocks only), which the compiled-vs-eager check shows."""
        import types

        options = {} if mode is None else {"mode": mode}
        if regional:  # on a copy of its own (patch and weights shared): compiled in place, the eager copy stays eager
            model = self.share_copy(model)
            model.compile_repeated_blocks(fullgraph=True, backend=backend, **options)
            entry = _call_model
        else:
            self._entries = getattr(self, "_entries", 0) + 1
            code = _call_model.__code__.replace(co_name=f"{_call_model.__name__}_{self._entries}")
            entry = self.torch.compile(types.FunctionType(code, _call_model.__globals__), backend=backend,
                                       fullgraph=True, **options)
        if mode == "reduce-overhead":
            mark_step = self.torch.compiler.cudagraph_mark_step_begin

            def replayed(*args: Any) -> Any:
                mark_step()
                return entry(model, *args).clone()

            return _Compiled(replayed)
        return _Compiled(lambda *args: entry(model, *args))

    @contextlib.contextmanager
    def compile_settings(self, n_models: int) -> Iterator[None]:
        """Static shapes (each configuration always sees the same ones), and a recompile limit well
        above one entry per configuration."""
        config = self.torch._dynamo.config
        changes: Dict[str, Any] = {"automatic_dynamic_shapes": False}
        for names in (("recompile_limit", "cache_size_limit"), ("accumulated_recompile_limit", "accumulated_cache_size_limit")):
            name = next((n for n in names if hasattr(config, n)), None)
            if name is not None:
                changes[name] = max(getattr(config, name), 64 * n_models)
        with config.patch(changes):
            yield

    def apply_reference(self, model: Any, ratio: float, max_downsample: int) -> None:
        from .references import load_tomesd_ref

        load_tomesd_ref().apply_patch(model, ratio=ratio, max_downsample=max_downsample)

    @contextlib.contextmanager
    def reference(self, model: Any, ratio: float, max_downsample: int) -> Iterator[None]:
        from .references import load_tomesd_ref

        self.apply_reference(model, ratio, max_downsample)
        try:
            yield
        finally:
            load_tomesd_ref().remove_patch(model)

    def reference_machinery(self) -> List[Tuple[Any, str]]:
        from .references import load_tomesd_ref

        try:
            return [(load_tomesd_ref().merge, "bipartite_soft_matching_random2d")]
        except RuntimeError:
            return []

