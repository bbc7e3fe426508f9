"""Deterministic class-conditional sampling with the yardstick UNet: DDIM with classifier-free guidance,
the two halves in one batch as SD pipelines run them (so ToMe sees SD's batch-2 shape)."""
from __future__ import annotations

from . import model as M

STEPS = 20
GUIDANCE = 2.0


def scheduler():
    from diffusers import DDIMScheduler

    return DDIMScheduler(num_train_timesteps=1000, beta_schedule="squaredcos_cap_v2", clip_sample=True)


def noise(count: int, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randn(count, 1, M.IMAGE, M.IMAGE, generator=g)


def sample(unet, labels_embedding, labels, x, steps: int = STEPS, guidance: float = GUIDANCE):
    """Images in [-1, 1] from starting noise `x` [N, 1, 32, 32] for `labels` [N]."""
    import torch

    sched = scheduler()
    sched.set_timesteps(steps)
    null = torch.full_like(labels, M.NULL_CLASS)
    context = M.context(labels_embedding, torch.cat([labels, null]))
    with torch.no_grad():
        for t in sched.timesteps:
            eps = unet(torch.cat([x, x]), t, context).sample
            cond, uncond = eps.chunk(2)
            x = sched.step(uncond + guidance * (cond - uncond), t, x).prev_sample
    return x.clamp(-1, 1)
