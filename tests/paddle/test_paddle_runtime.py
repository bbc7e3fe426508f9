"""A patched ppdiffusers UNet at run time: training with recompute, EMA copies, deepcopy, no host
reads per call, and paddle.jit.to_static (SOT runs ToMe as dynamic mode does; AST is refused)."""
import copy
import pickle

import numpy as np
import paddle
import pytest

import tiny_paddle as P
import tome_core
import tomesd
from paddle_probes import count_host_reads
from tomesd.runtime.tome_patch import PATCH_ATTR

TOL = 1e-5  # gradients: fp32 round-off of a recomputed forward (reentrant recompute)


@pytest.fixture(scope="module")
def unet(tmp_path_factory):
    return P.unet(tmp_path_factory.mktemp("unet"))


@pytest.fixture(scope="module")
def inputs():
    x, t, c = P.unet_inputs()  # batch 2: use_rand really draws a random dst
    target = paddle.to_tensor(np.random.RandomState(0).randn(*x.shape).astype("float32"))
    return x, t, c, target


@pytest.fixture
def clean(unet):
    """The module's UNet, unpatched, in eval mode without checkpointing, after the test too."""
    yield unet
    tomesd.remove_patch(unet)
    unet.disable_gradient_checkpointing()
    unet.eval()
    unet.clear_gradients()


def train_step(model, inputs):
    """(loss, {parameter name: gradient}) of one MSE step in train mode; gradients cleared after."""
    x, t, c, target = inputs
    model.train()
    loss = ((model(x, t, c).sample - target) ** 2).mean()
    loss.backward()
    grads = {n: p.grad.numpy().copy() for n, p in model.named_parameters() if p.grad is not None}
    model.clear_gradients()
    return float(loss), grads


def max_diff(a, b):
    assert a[1].keys() == b[1].keys() and len(a[1]) > 0
    return max(abs(a[0] - b[0]), max(float(np.abs(a[1][k] - b[1][k]).max()) for k in a[1]))


def hooks_and_flags(model):
    tables = (
        "_forward_pre_hooks", "_forward_post_hooks", "_forward_pre_hooks_with_kwargs_flag",
        "_forward_post_hooks_with_kwargs_flag", "_forward_post_hooks_always_called",
    )
    return sum(len(getattr(m, name, {})) for _, m in model.named_sublayers(include_self=True) for name in tables)


def has_patch_attr(model):
    return any(PATCH_ATTR in vars(m) for _, m in model.named_sublayers(include_self=True))


def infer(model, x, t, c):
    with paddle.no_grad():
        return model(x, t, c, return_dict=False)[0].numpy()


# ---- training -------------------------------------------------------------------------------


@pytest.mark.parametrize("reentrant", [False, True], ids=["hooks-recompute", "reentrant-recompute"])
@pytest.mark.parametrize("use_rand", [False, True])
def test_checkpointed_training_equals_plain_training(clean, inputs, monkeypatch, use_rand, reentrant):
    """ppdiffusers checkpoints each transformer block with paddle.distributed.fleet.utils.recompute
    (non-reentrant by default: saved-tensor hooks that re-run the block in backward, after the
    UNet's call has ended). The recomputed block must merge exactly as its forward did."""
    import ppdiffusers.models.transformer_2d as t2d

    unet = clean
    monkeypatch.setenv("FLAG_RECOMPUTE_USE_REENTRANT", str(reentrant))
    calls = []
    recompute = t2d.recompute
    monkeypatch.setattr(t2d, "recompute", lambda *a, **k: calls.append(k) or recompute(*a, **k))

    base = train_step(unet, inputs)
    tomesd.apply_patch(unet, ratio=0.5, use_rand=use_rand)
    plain = train_step(unet, inputs)
    assert max_diff(plain, base) > 1000 * TOL  # ToMe changes loss and gradients
    assert not calls
    unet.enable_gradient_checkpointing()
    checkpointed = train_step(unet, inputs)
    assert len(calls) > 0 and all(("use_reentrant" in k) != reentrant for k in calls)  # really recomputed
    assert max_diff(checkpointed, plain) < TOL
    assert checkpointed[0] == plain[0]


def test_ema_copy_is_patched_independent_and_trains_alike(clean, inputs):
    unet = clean
    base = train_step(unet, inputs)
    unet.apply_tome(ratio=0.5)
    unet.enable_gradient_checkpointing()
    ema = copy.deepcopy(unet)

    patch, ema_patch = getattr(unet, PATCH_ATTR), getattr(ema, PATCH_ATTR)
    assert ema_patch is not patch and ema_patch.root is ema
    assert all(b is not o for b, o in zip(ema_patch.blocks, patch.blocks))
    first = next(iter(ema.parameters()))
    assert first is not next(iter(unet.parameters()))

    original, copied = train_step(unet, inputs), train_step(ema, inputs)
    assert max_diff(original, base) > 1000 * TOL
    assert max_diff(copied, original) == 0.0  # same loss and gradients, checkpointing included

    ema.remove_tome()
    assert hooks_and_flags(ema) == 0 and not has_patch_attr(ema)
    assert getattr(unet, PATCH_ATTR) is patch and hooks_and_flags(unet) > 0
    assert max_diff(train_step(unet, inputs), original) == 0.0  # the original still merges
    assert max_diff(train_step(ema, inputs), base) < TOL  # the copy does not

    with paddle.no_grad():  # the copy's weights are its own
        first.set_value(first + 1.0)
    assert max_diff(train_step(unet, inputs), original) == 0.0


# ---- copies ---------------------------------------------------------------------------------


@pytest.mark.parametrize("copier", [copy.deepcopy, lambda m: pickle.loads(pickle.dumps(m))], ids=["deepcopy", "pickle"])
def test_copy_of_patched_layer(clean, inputs, copier):
    unet = clean
    x, t, c, _ = inputs
    assert hooks_and_flags(unet) == 0
    base = infer(unet, x, t, c)
    unet.apply_tome(ratio=0.5)
    merged = infer(unet, x, t, c)
    twin = copier(unet)

    out = infer(twin, x, t, c)
    assert np.abs(out - base).max() > 1e-2  # the copy merges tokens
    np.testing.assert_array_equal(out, merged)

    twin.remove_tome()
    assert hooks_and_flags(twin) == 0 and not has_patch_attr(twin)
    np.testing.assert_array_equal(infer(twin, x, t, c), base)
    assert hooks_and_flags(unet) > 0 and getattr(unet, PATCH_ATTR).root is unet
    np.testing.assert_array_equal(infer(unet, x, t, c), merged)


# ---- no host reads ---------------------------------------------------------------------------

@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
def test_patched_forward_reads_nothing_from_the_device(clean, inputs, monkeypatch, grad):
    """ppdiffusers itself reads shapes back (paddle.reshape with tensor dims calls .item()), so the
    unpatched count is the baseline: ToMe must add no read, and none may come from our code."""
    unet = clean
    x, t, c, _ = inputs

    def forward():
        with paddle.set_grad_enabled(grad):
            outputs.append(unet(x, t, c).sample)

    outputs = []
    plain_reads, plain_ours = count_host_reads(monkeypatch, forward)
    unet.apply_tome(ratio=0.5)  # use_rand on, random dst keyed by the timestep tensor
    tome_reads, tome_ours = count_host_reads(monkeypatch, forward)
    assert tome_ours == [] and plain_ours == []
    assert sorted(tome_reads) == sorted(plain_reads)
    assert np.abs(outputs[1].numpy() - outputs[0].numpy()).max() > 1e-2


# ---- paddle.jit.to_static -------------------------------------------------------------------


class Wrapper(paddle.nn.Layer):
    """A parent layer: to_static converts it, and the patched UNet is called inside."""

    def __init__(self, unet):
        super().__init__()
        self.unet = unet

    def forward(self, x, t, c):
        return self.unet(x, t, c, return_dict=False)[0]


@pytest.fixture
def small_unet(tmp_path):
    """A fresh two-level UNet: to_static changes the layer it converts."""
    return P.unet(tmp_path / "small", P.SMALL_UNET)


@pytest.mark.parametrize("converted", ["unet", "parent"])
def test_to_static_full_graph_is_refused_clearly(small_unet, inputs, converted):
    """AST tracing would run a converted UNet's own pre-hook outside the program (its blocks then
    silently merged nothing), and bake Python state into it: refused at conversion, the first call."""
    unet = small_unet
    x, t, c, _ = inputs
    base = infer(unet, x, t, c)
    unet.apply_tome(ratio=0.5)
    merged = infer(unet, x, t, c)
    assert np.abs(merged - base).max() > 1e-2  # ToMe acts, far beyond the tolerance
    model = unet if converted == "unet" else Wrapper(unet)
    static = paddle.jit.to_static(model, full_graph=True)
    try:
        with pytest.raises(RuntimeError, match=r"to_static\(full_graph=True\)"):
            with paddle.no_grad():
                static(x, t, c) if converted == "parent" else static(x, t, c, return_dict=False)
        if converted == "parent":  # the failed call left no state behind: dynamic mode still merges
            np.testing.assert_array_equal(infer(unet, x, t, c), merged)
    finally:
        unet.remove_tome()  # paddle's program cache keeps the converted layer alive after the test
    assert hooks_and_flags(unet) == 0


def sot_runs_tome_as_dynamic_mode(folder: str) -> None:
    """SOT (to_static's default) runs the layer hooks eagerly between compiled graphs: patching a converted
    UNet reaches what it runs, its outputs equal dynamic mode's at every timestep in merge and downsample
    mode, and removing the patch reaches it too. One conversion serves both modes."""
    import pathlib

    unet = P.unet(pathlib.Path(folder), P.SMALL_UNET)
    x, _, c = P.unet_inputs()
    t1, t2 = paddle.to_tensor([10.0]), paddle.to_tensor([500.0])
    bases = [infer(unet, x, t, c) for t in (t1, t2)]
    static = paddle.jit.to_static(unet)
    np.testing.assert_allclose(infer(static, x, t1, c), bases[0], atol=1e-6)
    for kwargs in (dict(ratio=0.5), dict(mode="downsample")):
        unet.apply_tome(**kwargs)
        dynamic = [infer(unet, x, t, c) for t in (t1, t2)]
        for out, base in zip(dynamic, bases):
            assert np.abs(out - base).max() > 1e-2, kwargs  # ToMe acts at both timesteps, far beyond the tolerance
        if "ratio" in kwargs:  # the random pattern follows the timestep (downsampling has none)
            assert np.abs(dynamic[0] - dynamic[1]).max() > 1e-2
        for t, expected in zip((t1, t2), dynamic):
            np.testing.assert_allclose(infer(static, x, t, c), expected, atol=1e-6, err_msg=str(kwargs))
        unet.remove_tome()
        np.testing.assert_allclose(infer(static, x, t1, c), bases[0], atol=1e-6, err_msg=str(kwargs))
    print("SOT ok")


def test_to_static_default_mode_runs_tome_as_dynamic_mode(tmp_path):
    """sot_runs_tome_as_dynamic_mode in a fresh process: SOT's first translation of the UNet is most of this
    test's time, and inside a worker that has run the other test files it took 212 s instead of 132 s."""
    import os
    import subprocess
    import sys

    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = (f"import sys; sys.path[:0] = [{tests!r}, {os.path.join(tests, 'paddle')!r}]; "
              f"import test_paddle_runtime as t; t.sot_runs_tome_as_dynamic_mode({str(tmp_path)!r})")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0 and "SOT ok" in out.stdout, out.stderr[-3000:]


@pytest.mark.parametrize("layout", ["sd1", "sdxl"])
def test_default_patch_is_deterministic_across_save_load_and_the_global_rng(tmp_path, inputs, layout):
    """Default arguments (random dst, no seed): the same outputs across calls, after paddle's global RNG
    has drawn, and from a model saved and loaded again and patched the same way; seed 1 differs."""
    from ppdiffusers import UNet2DConditionModel

    import tiny_torch as T

    model = P.unet(tmp_path / "a", T.SD1_UNET if layout == "sd1" else T.SDXL_UNET)
    x, t, c, _ = inputs
    plain = infer(model, x, t, c)
    tomesd.apply_patch(model, ratio=0.5)
    first = infer(model, x, t, c)
    paddle.seed(123)
    paddle.rand([100])
    assert np.array_equal(infer(model, x, t, c), first)
    assert np.abs(first - plain).max() > 1e-2
    tomesd.remove_patch(model)
    model.save_pretrained(str(tmp_path / "saved"))
    loaded = UNet2DConditionModel.from_pretrained(str(tmp_path / "saved"))
    loaded.eval()
    paddle.rand([7])
    tomesd.apply_patch(loaded, ratio=0.5)
    assert np.array_equal(infer(loaded, x, t, c), first)
    tomesd.apply_patch(loaded, ratio=0.5, seed=1)
    assert not np.array_equal(infer(loaded, x, t, c), first)


def test_a_paddle_without_the_needed_layer_hooks_gets_a_clear_error(monkeypatch):
    """Paddle before 3.2 has no always_call/with_kwargs layer hooks: refused by name and version."""
    import importlib

    import paddle

    import tomesd.backends.paddle as backend_module

    def old_register_forward_post_hook(self, hook):
        raise AssertionError("not to be called")

    monkeypatch.setattr(paddle.nn.Layer, "register_forward_post_hook", old_register_forward_post_hook)
    with pytest.raises(ImportError, match=r"paddlepaddle>=3\.2"):
        importlib.reload(backend_module)
    monkeypatch.undo()
    importlib.reload(backend_module)
    tome_core.register_backend("paddle", backend_module.backend)  # the reloaded module's, as tomesd would
