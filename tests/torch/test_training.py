"""Training through a patched UNet: gradient checkpointing replays each block's merge exactly."""
import pytest
import torch

import tiny_torch as T
import tomesd
from references import load_tomesd_ref


def loss_and_grads(model, forward, seed=0):
    model.zero_grad(set_to_none=True)
    gen = torch.Generator().manual_seed(seed)
    out = forward(model)
    target = torch.randn(out.shape, generator=gen)
    loss = torch.nn.functional.mse_loss(out, target)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def assert_same(a, b, tol=1e-5):
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    assert torch.allclose(loss_a, loss_b, rtol=tol, atol=tol)
    assert grads_a.keys() == grads_b.keys() and len(grads_a) > 10
    overall = max(g.abs().max() for g in grads_a.values())
    for name in grads_a:
        # relative to each gradient, plus fp32 round-off of the largest (gradients that vanish in
        # exact arithmetic, such as a bias before a GroupNorm, are pure round-off)
        bound = tol * grads_a[name].abs().max() + 1e-6 * overall
        assert (grads_a[name] - grads_b[name]).abs().max() <= bound, name


def unet_forward(model):
    x, t, c = T.unet_inputs()
    return model(x, t, c).sample


def set_diffusers_checkpointing(unet, on):
    if on:
        unet.enable_gradient_checkpointing()
    else:
        unet.disable_gradient_checkpointing()


@pytest.mark.parametrize("use_rand", [False, True], ids=["top-left-dst", "random-dst"])
def test_diffusers_checkpointing_gives_the_same_loss_and_gradients(use_rand):
    unet = T.unet().train()
    base = loss_and_grads(unet, unet_forward)
    tomesd.apply_patch(unet, ratio=0.5, use_rand=use_rand)
    plain = loss_and_grads(unet, unet_forward)
    assert (plain[0] - base[0]).abs() > 1e-3  # ToMe acts in training
    set_diffusers_checkpointing(unet, True)
    assert_same(loss_and_grads(unet, unet_forward), plain)


def test_gradients_equal_tomesd_without_random_dst():
    ref = load_tomesd_ref()
    unet = T.unet().train()
    ref.apply_patch(unet, ratio=0.5, use_rand=False)
    theirs = loss_and_grads(unet, unet_forward)
    ref.remove_patch(unet)
    base = loss_and_grads(unet, unet_forward)
    assert (theirs[0] - base[0]).abs() > 1e-3
    tomesd.apply_patch(unet, ratio=0.5, use_rand=False)
    set_diffusers_checkpointing(unet, True)
    assert_same(loss_and_grads(unet, unet_forward), theirs, tol=1e-4)


def set_ldm_checkpointing(model, on):
    for module in model.modules():
        if hasattr(module, "checkpoint") and isinstance(module.checkpoint, bool):
            module.checkpoint = on
        if hasattr(module, "use_checkpoint"):
            module.use_checkpoint = on


def ldm_forward(model):
    x, t, c = T.unet_inputs()
    return model.model.diffusion_model(x, t.expand(x.shape[0]), c)


@pytest.mark.parametrize("use_rand", [False, True], ids=["top-left-dst", "random-dst"])
def test_ldm_use_checkpoint_gives_the_same_loss_and_gradients(use_rand):
    model = T.ldm_model().train()
    set_ldm_checkpointing(model, False)
    base = loss_and_grads(model, ldm_forward)
    tomesd.apply_patch(model, ratio=0.5, use_rand=use_rand)
    plain = loss_and_grads(model, ldm_forward)
    assert (plain[0] - base[0]).abs() > 1e-3
    set_ldm_checkpointing(model, True)
    assert_same(loss_and_grads(model, ldm_forward), plain)


def fine_tune(unet, steps=6):
    """Adapter-style: only the attention projections train (a small set), checkpointing on. Returns
    the losses and the query tokens of the first self-attention in each step's forward and recompute."""
    unet.enable_gradient_checkpointing()
    trainable = [p for name, p in unet.named_parameters() if name.endswith(("to_q.weight", "to_v.weight"))]
    for p in unet.parameters():
        p.requires_grad_(False)
    for p in trainable:
        p.requires_grad_(True)
    assert 0 < sum(p.numel() for p in trainable) < sum(p.numel() for p in unet.parameters()) / 5
    block = next(m for m in unet.modules() if type(m).__name__ == "BasicTransformerBlock")
    queries = []
    handle = block.attn1.to_q.register_forward_pre_hook(lambda m, a: queries.append(a[0].shape[1]))
    optimizer = torch.optim.Adam(trainable, lr=3e-3)
    x, t, c = T.unet_inputs()
    target = torch.randn(x.shape, generator=torch.Generator().manual_seed(9))
    losses = []
    for step in range(steps):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(unet(x, t + step, c).sample, target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    handle.remove()
    return losses, queries


def test_a_few_steps_of_adapter_style_fine_tuning_lower_the_loss():
    plain_losses, plain_queries = fine_tune(T.unet().train())
    unet = T.unet().train()
    tomesd.apply_patch(unet, ratio=0.5)
    losses, queries = fine_tune(unet)
    assert losses[-1] < 0.9 * losses[0], losses
    # Tokens were merged in every forward and in every checkpointed recompute (16x16 grid halved) ...
    assert plain_queries == [16 * 16] * len(plain_queries) and len(plain_queries) >= 2 * len(losses)
    assert queries == [16 * 16 // 2] * len(plain_queries)
    # ... and so the training itself differs from an unpatched run, at every step.
    assert all(abs(a - b) > 1e-3 * abs(b) for a, b in zip(losses, plain_losses)), (losses, plain_losses)
