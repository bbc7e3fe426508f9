"""Reproduces the yardstick's shipped weights: `python -m tomesd.quality.train [--out PATH]`.

Trains, on scikit-learn's digits upscaled to 32x32, (1) the classifier that scores samples and (2) the
class-conditional denoiser (10% of labels dropped for classifier-free guidance, EMA weights kept): with `--arch
sd1` (default) the UNet, epsilon prediction (`--arch sdxl`: the SDXL-structured UNet, likewise); with `--arch sd3`
the SD3 transformer, rectified flow (velocity prediction, noise levels drawn logit-normal as SD3 trains); with
`--arch video` AnimateDiff's motion UNet, from the `sd1` weights, on moving digits; with `--arch wan` Wan's
transformer, rectified flow, on the same clips. Every arch but `sd1` reuses the shipped `sd1` file's classifier so
that all yardsticks are judged by the same one. Everything is seeded; on the project's 2-core CPU it took the time
printed at the end (stored in the file's metadata).
Never run in tests or CI."""
from __future__ import annotations

import argparse
import copy
import math
import os
import time

from . import model as M
from . import sampling


def train_classifier(x, y, seed: int, epochs: int = 30):
    import torch

    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(len(x), generator=g)
    val, tr = perm[: len(x) // 5], perm[len(x) // 5:]
    clf = M.Classifier()
    opt = torch.optim.AdamW(clf.parameters(), 2e-3, weight_decay=1e-4)
    for epoch in range(epochs):
        clf.train()
        order = tr[torch.randperm(len(tr), generator=g)]
        for i in range(0, len(order), 64):
            idx = order[i:i + 64]
            # Mild noise so that slightly imperfect samples are still read as what they show.
            xb = x[idx] + 0.1 * torch.randn(x[idx].shape, generator=g)
            loss = torch.nn.functional.cross_entropy(clf(xb), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    clf.eval()
    with torch.no_grad():
        acc = (clf(x[val]).argmax(1) == y[val]).float().mean().item()
    print(f"classifier: held-out accuracy {acc:.3f} on {len(val)} digits", flush=True)
    return clf, acc


def train_denoiser(x, y, seed: int, steps: int, batch: int, lr: float, arch: str = "sd1"):
    import torch
    from diffusers import DDPMScheduler

    torch.manual_seed(seed)
    spec = M.spec(arch)
    unet, labels, _ = M.build(arch)
    # Start from `init_from`'s trained weights (the video arch: AnimateDiff's motion modules join the image UNet)
    if spec.init_from is not None:
        image_unet, image_labels, _ = M.load(arch=spec.init_from)
        unet.load_state_dict(image_unet.state_dict(), strict=False)
        labels.load_state_dict(image_labels.state_dict())
        for module in (unet, labels):
            module.train()
            for p in module.parameters():
                p.requires_grad_(True)
    ema_unet, ema_labels = copy.deepcopy(unet), copy.deepcopy(labels)
    params = list(unet.parameters()) + list(labels.parameters())
    opt = torch.optim.AdamW(params, lr, weight_decay=0.0)
    warm = max(1, min(100, steps // 10))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    noise_sched = DDPMScheduler(num_train_timesteps=1000, beta_schedule="squaredcos_cap_v2")
    g = torch.Generator().manual_seed(seed + 1)
    start = time.time()
    for step in range(steps):
        if spec.frames is None:
            idx = torch.randint(0, len(x), (batch,), generator=g)
            x0, lab = x[idx], y[idx].clone()
        else:
            x0, lab = M.moving_digits(x, y, batch, g, spec.frames)
        lab[torch.rand(batch, generator=g) < 0.1] = M.NULL_CLASS
        eps = torch.randn(x0.shape, generator=g)
        if spec.objective == "epsilon":
            t = torch.randint(0, 1000, (batch,), generator=g)
            x_t, target = noise_sched.add_noise(x0, eps, t), eps
        else:  # rectified flow: x_t = (1 - s) x0 + s eps, velocity eps - x0, timestep 1000 s
            s = torch.sigmoid(torch.randn(batch, generator=g))
            s_ = s.reshape((batch,) + (1,) * (x0.dim() - 1))
            x_t, target, t = (1 - s_) * x0 + s_ * eps, eps - x0, 1000 * s
        pred = M.predict(arch, unet, x_t, t, M.context(labels, lab))
        loss = torch.nn.functional.mse_loss(pred, target)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        decay = min(0.999, (1 + step) / (10 + step))
        with torch.no_grad():
            for ema, live in ((ema_unet, unet), (ema_labels, labels)):
                for pe, pl in zip(ema.parameters(), live.parameters()):
                    pe.lerp_(pl, 1 - decay)
        if step % 50 == 0 or step == steps - 1:
            print(f"step {step:5d}/{steps}  loss {loss.item():.4f}  {time.time() - start:7.0f} s", flush=True)
    return ema_unet.eval(), ema_labels.eval(), time.time() - start


def main(argv=None) -> None:
    import torch
    from safetensors.torch import save_file

    p = argparse.ArgumentParser(prog="python -m tomesd.quality.train", description=__doc__)
    p.add_argument("--arch", choices=M.ARCHS, default="sd1")
    p.add_argument("--out", help="default: the shipped file for --arch")
    defaults = {name: f"{name} {s.steps} steps of {s.batch} at lr {s.lr:g}" for name, s in M.ARCH_SPECS.items()}
    p.add_argument("--steps", type=int, help="default: per arch (" + "; ".join(defaults.values()) + ")")
    p.add_argument("--batch", type=int, help="default: per arch (clips for video archs)")
    p.add_argument("--lr", type=float, help="default: per arch (lower where training starts from an image model)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    arch = args.arch
    out = args.out or M.WEIGHTS_BY_ARCH[arch]
    steps = args.steps or M.spec(arch).steps
    batch = args.batch or M.spec(arch).batch
    args.lr = args.lr or M.spec(arch).lr

    x, y = M.digits()
    if arch == "sd1":
        clf, _ = train_classifier(x, y, args.seed)
    else:
        clf = M.load(arch="sd1")[2]
    unet, labels, seconds = train_denoiser(x, y, args.seed, steps, batch, args.lr, arch)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    tensors = {k: v.half() for k, v in M.state_dicts(unet, labels, clf, arch).items()}
    save_file(tensors, out, metadata={"command": f"python -m tomesd.quality.train --arch {arch} --steps {steps} "
                                      f"--batch {batch} --lr {args.lr} --seed {args.seed}",
                                      "train_seconds": f"{seconds:.0f}"})
    print(f"wrote {out} ({os.path.getsize(out) / 1e6:.1f} MB); {arch} training took {seconds / 60:.1f} min")
    # Sanity check: do the samples read as their labels?
    unet, labels, clf = M.load(out, arch)
    if M.spec(arch).frames is not None:  # the classifier reads centred digits, not clips
        return
    lab = torch.arange(100) % 10
    imgs = sampling.sample(unet, labels, lab, sampling.noise(100, 1234), arch=arch)
    with torch.no_grad():
        acc = (clf(imgs).argmax(1) == lab).float().mean().item()
    print(f"samples read as their label: {acc:.2f}")


if __name__ == "__main__":
    main()
