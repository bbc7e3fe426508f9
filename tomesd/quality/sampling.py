"""Deterministic class-conditional sampling with a yardstick denoiser and classifier-free guidance, the two
halves in one batch as SD pipelines run them (so ToMe sees SD's batch-2 shape): DDIM for the `sd1` and
`video` UNets, flow-matching Euler steps for the `sd3` and `wan` transformers (SD3's own scheduler, at shift
1 for a 32x32 image)."""
from __future__ import annotations

from . import model as M

STEPS = 20
GUIDANCE = 2.0


def scheduler(arch: str = "sd1"):
    if M.spec(arch).objective == "flow":
        from diffusers import FlowMatchEulerDiscreteScheduler

        return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0)
    from diffusers import DDIMScheduler

    return DDIMScheduler(num_train_timesteps=1000, beta_schedule="squaredcos_cap_v2", clip_sample=True)


def pipeline(denoiser, arch: str = "sd1"):
    """A diffusers pipeline that holds the denoiser and a fresh scheduler and runs nothing itself: what a
    setting patches when it needs a pipeline's loop (a `ratio_schedule` follows the run's progress, which
    only the scheduler's steps tell on the host). `sample(..., sched=pipe.scheduler)` drives that loop."""
    from diffusers import DiffusionPipeline

    class YardstickPipeline(DiffusionPipeline):
        def __init__(self, denoiser, scheduler):
            super().__init__()
            self.register_modules(denoiser=denoiser, scheduler=scheduler)

    return YardstickPipeline(denoiser, scheduler(arch))


def noise(count: int, seed: int, arch: str = "sd1"):
    """Starting noise for `count` samples: [count, 1, 32, 32], or [count, 1, frames, 32, 32] for a video arch."""
    import torch

    g = torch.Generator().manual_seed(seed)
    frames = M.spec(arch).frames
    return torch.randn((count, 1) + (() if frames is None else (frames,)) + (M.IMAGE, M.IMAGE), generator=g)


def sample(unet, labels_embedding, labels, x, steps: int = STEPS, guidance: float = GUIDANCE, arch: str = "sd1",
           sched=None):
    """Images (clips) in [-1, 1] from starting noise `x` ([N, 1, 32, 32], or [N, 1, F, 32, 32]) for `labels` [N]."""
    import torch

    sched = scheduler(arch) if sched is None else sched  # a patched pipeline's scheduler: its clock counts the steps
    sched.set_timesteps(steps)
    null = torch.full_like(labels, M.NULL_CLASS)
    context = M.context(labels_embedding, torch.cat([labels, null]))
    with torch.no_grad():
        for t in sched.timesteps:
            out = M.predict(arch, unet, torch.cat([x, x]), t, context)
            cond, uncond = out.chunk(2)
            x = sched.step(uncond + guidance * (cond - uncond), t, x).prev_sample
    return x.clamp(-1, 1)
