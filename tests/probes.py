"""Instruments the torch tests share: a dynamo backend that counts graphs, a dispatch mode that counts
ops (kernel launches on a GPU), and the checkpointing check every model kind runs."""
from collections import Counter

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode


class CountingBackend:
    """A dynamo backend that counts the graphs with any op it is given, and runs them as traced."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += any(node.op.startswith("call_") for node in gm.graph.nodes)
        return gm.forward


class OpCounter(TorchDispatchMode):
    """Counts every op dispatched inside it, by name (`ops`) and in all (`total`)."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def assert_checkpointing_keeps_loss_and_gradients(build, inputs, patch_kwargs):
    """A patched model trains alike with and without gradient checkpointing (the recomputed blocks
    merge as the forward did), and the patch acts on the loss."""

    def loss_and_grads(model):
        model.zero_grad(set_to_none=True)
        out = model(**inputs()).sample
        loss = F.mse_loss(out, torch.randn(out.shape, generator=torch.Generator().manual_seed(0)))
        loss.backward()
        return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    import tomesd

    model = build().train()
    base_loss, _ = loss_and_grads(model)
    tomesd.apply_patch(model, **patch_kwargs)
    try:
        loss, grads = loss_and_grads(model)
        model.enable_gradient_checkpointing()
        loss_ckpt, grads_ckpt = loss_and_grads(model)
    finally:
        tomesd.remove_patch(model)
    assert abs(loss - base_loss) > 1e-3  # ToMe acts in training
    assert abs(loss - loss_ckpt) < 1e-6 * max(1.0, abs(loss))
    assert grads.keys() == grads_ckpt.keys() and len(grads) > 10
    for name in grads:
        assert (grads[name] - grads_ckpt[name]).abs().max() <= 1e-5 * grads[name].abs().max() + 1e-7, name


def assert_patch_equals_hooks_by_hand(model, run, base, handles, tol=1e-5, **patch_kwargs):
    """The reference is `run()` with hooks placed by hand (`handles`, removed here); the patched model
    must equal it within `tol`, and the reference must differ from the unpatched `base` by 1000x that."""
    import tomesd

    try:
        expected = run()
    finally:
        for handle in handles:
            handle.remove()
    tomesd.apply_patch(model, **patch_kwargs)
    try:
        ours = run()
    finally:
        tomesd.remove_patch(model)
    assert (expected - base).abs().max().item() > 1000 * tol
    assert (ours - expected).abs().max().item() < tol


def assert_loop_compiles_once_and_equals_eager(model, run, steps, **patch_kwargs):
    """Patched `model` over `steps` (keyword inputs of each call): torch.compile(fullgraph=True) traces one
    graph (a graph break would raise) and never recompiles, and equals eager at every step, where the patch
    acts. One trace: torch._dynamo.explain would trace the same graph a second time and prove nothing more."""
    import tomesd

    torch._dynamo.reset()
    plain = [run(model, inputs) for inputs in steps]
    tomesd.apply_patch(model, **patch_kwargs)
    try:
        eager = [run(model, inputs) for inputs in steps]
        backend = CountingBackend()
        compiled = torch.compile(model, fullgraph=True, backend=backend)
        outs = [run(compiled, steps[0])]
        with torch._dynamo.config.patch(error_on_recompile=True):
            outs += [run(compiled, inputs) for inputs in steps[1:]]
    finally:
        tomesd.remove_patch(model)  # diffusers' attention registry is the process's: leave it as found
        torch._dynamo.reset()
    assert backend.graphs == 1
    for out, ref, base in zip(outs, eager, plain):
        assert (ref - base).abs().max() > 1e-2  # the patch acts at every step
        assert_compiled_equals_eager(out, ref)


def assert_round_off_apart(out, ref, plain, rel=1e-3):
    """`out` equals `ref` (the same patched run by another path: compiled, or split over ranks) to round-off grown
    through a loop (denoising steps, a VAE), where `plain` is the unpatched output: the bound follows ToMe's effect,
    `rel` of the largest change the patch made, and never falls below fp32 round-off at the output's scale. The
    effect is checked to stand far past the bound first, so the comparison can still tell the patch off from on."""
    effect = float(abs(ref - plain).max())
    bound = max(rel * effect, 1e-5 * max(1.0, float(abs(ref).max())))
    assert effect > 100 * bound, f"the patch changes the output by {effect:.3g}, too little to test against {bound:.3g}"
    gap = float(abs(out - ref).max())
    assert gap <= bound, f"{gap:.3g} apart, past {bound:.3g} ({rel} of the patch's effect {effect:.3g})"


def assert_compiled_equals_eager(out, ref):
    """A compiled ToMe forward against the eager one: equal to fp32 round-off. Under a graph compiler a merge's mean is
    a sum times the inverse counts it keeps (tome_core.token_merge: the kernels inductor lowers), eagerly torch's own
    mean (one host call) where no counts are known: a product where the other divides."""
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-5 * max(1.0, ref.abs().max().item())), \
        (out - ref).abs().max().item()


HOST_READ = "aten._local_scalar_dense.default"  # what .item(), float(t), int(t), bool(t) and .tolist() run


def count_host_reads(fn):
    """(fn(), how many tensor values it read on the host), counted by the dispatcher: every host read of a
    tensor's value, wherever in the process it happens, runs aten._local_scalar_dense."""
    with OpCounter() as counter:
        out = fn()
    return out, counter.ops[HOST_READ]


def around_the_patch(modules, patch, run, output=False):
    """(before, after): the first tensor entering each of `modules` (or, with `output`, the first of its
    output) as the patch's own hook on it receives it and as it leaves that hook, over one `run()` under
    `patch()`. ToMe's hooks sit innermost in the module's forward chain (torch_links), so the probe on the
    module's own side is seated there too, inside the patch's: for inputs it sees what the module's own
    forward gets ("after"), for outputs what it returns ("before"); the other probe is a forward hook."""
    import tomesd
    from tomesd.backends import torch_links

    seen, handles = {"before": [], "after": []}, []

    def first(value):
        return value[0] if isinstance(value, tuple) else value

    owner = object()
    patch()
    if output:  # after the patch's own forward hook (a span's start merges there)
        handles += [m.register_forward_hook(lambda m, a, out: seen["after"].append(first(out))) for m in modules]
    else:
        handles += [m.register_forward_pre_hook(lambda m, a: seen["before"].append(a[0]), prepend=True)
                    for m in modules]
    for m in modules:
        if output:
            torch_links.seat(m, None, lambda m, a, out: seen["before"].append(first(out)), owner)
        else:
            torch_links.seat(m, lambda m, a, k: seen["after"].append(a[0] if a else k["hidden_states"]), None, owner)
    try:
        run()
    finally:
        for handle in handles:
            handle.remove()
        for m in modules:
            torch_links.unseat(m, lambda o: o is owner)
    return seen["before"], seen["after"]


def assert_padding_changes_nothing_under_tome(model, run, padded, short, merged_blocks, tol=1e-5):
    """A padded prompt (masked padding after the prompt's tokens) gives, merged, what the prompt alone gives,
    while ToMe itself changes the output by far more than `tol`; `merged_blocks` are the blocks whose attention
    merged. The patch is removed however the check ends."""
    import tomesd

    base = run(model, short)
    tomesd.apply_patch(model, ratio=0.5)
    try:
        with tomesd.observe(model) as seen:
            merged_short = run(model, short)
        merged_padded = run(model, padded)
    finally:
        tomesd.remove_patch(model)
    assert seen.calls[0].merged_blocks("attn") == list(merged_blocks)
    assert (merged_short - base).abs().max().item() > 1000 * tol  # ToMe changed the output
    torch.testing.assert_close(merged_padded, merged_short, atol=tol, rtol=tol)
