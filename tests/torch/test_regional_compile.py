"""Regional compilation, as diffusers recommends it (`model.compile_repeated_blocks(fullgraph=True)`: each block compiled
on its own, the root's hooks run eagerly around them), on every family of tests/families.py whose class declares
repeated blocks: no graph break (fullgraph), no recompile after the first call, outputs equal eager ToMe's, ToMe applied
before or after the compile, in merge and downsample modes. Dynamo's graphs run eagerly ("eager" backend): the graphs
and their guards are what is tested, not a code generator."""
import pytest
import torch
import torch._dynamo

import tomesd
from families import FAMILIES, missing_host
from probes import CountingBackend

TOL = 1e-5
STEPS = (999.0, 500.0, 21.0)


def _repeated(family) -> bool:
    return bool(getattr(family.build(), "_repeated_blocks", None))  # a family that fails to build fails collection


# Which families declare repeated blocks is read from diffusers' classes (cheap tiny builds, once at collection).
REGIONAL = [name for name, family in FAMILIES.items() if not missing_host(family) and _repeated(family)]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _at(family, inputs, step):
    """`inputs` at another denoising step: the timestep input (named as the family names it) set to `step`."""
    out = dict(inputs)
    name = next(name for name in ("timestep", "timesteps", "t") if isinstance(out.get(name), torch.Tensor))
    out[name] = torch.full_like(out[name], step)
    return out


def _settings(family, mode):
    return dict(family.patch or dict(ratio=0.5)) if mode == "merge" else dict(mode="downsample")


def _refused(family, mode):
    """Why `family` refuses `mode` (a documented refusal, at apply time or at its first call), or ''."""
    model = family.build().eval()
    try:
        tomesd.apply_patch(model, **_settings(family, mode))
        family.run(model, family.inputs(model))
    except ValueError as error:
        return str(error)
    finally:
        tomesd.remove_patch(model)
    return ""


@pytest.mark.parametrize("order", ["patch-then-compile", "compile-then-patch"])
@pytest.mark.parametrize("mode", ["merge", "downsample"])
@pytest.mark.parametrize("name", REGIONAL)
def test_blocks_compiled_on_their_own_run_one_graph_set_and_equal_eager(name, mode, order):
    family = FAMILIES[name]
    if mode == "downsample":
        refusal = _refused(family, mode)
        if refusal:  # the family's documented refusal (its processor or its sequence cannot take pooled keys)
            assert "downsample" in refusal
            return
    model = family.build().eval()
    inputs = family.inputs(model)
    steps = [_at(family, inputs, t) for t in STEPS]
    plain = [family.run(model, x) for x in steps]
    tomesd.apply_patch(model, **_settings(family, mode))
    eager = [family.run(model, x) for x in steps]
    backend = CountingBackend()
    try:
        if order == "patch-then-compile":
            model.compile_repeated_blocks(fullgraph=True, backend=backend)
        else:
            tomesd.remove_patch(model)
            model.compile_repeated_blocks(fullgraph=True, backend=backend)
            assert torch.equal(family.run(model, steps[0]), plain[0])  # compiled without ToMe first
            tomesd.apply_patch(model, **_settings(family, mode))
        outs = [family.run(model, steps[0])]
        graphs = backend.graphs
        with torch._dynamo.config.patch(error_on_recompile=True):
            outs += [family.run(model, x) for x in steps[1:]] + [family.run(model, steps[0])]
    finally:
        tomesd.remove_patch(model)
    assert 0 < graphs == backend.graphs  # every graph made at the first call, none after
    for out, ref, base in zip(outs, eager + eager[:1], plain + plain[:1]):
        assert (ref - base).abs().max() > 1000 * TOL  # ToMe acts at every step, far beyond the tolerance below
        assert torch.allclose(out, ref, rtol=0, atol=TOL)
    assert torch.equal(family.run(model, steps[0]), plain[0])  # removed: the compiled blocks run unpatched again


def _deep(kind, depth):
    """A tiny model of `kind` whose repeated blocks come `depth` times as often (same classes, same shapes), its
    inputs, its forward, and the settings it is patched with besides the mode's."""
    import tiny_torch as T

    if kind == "unet":
        return T.unet(dict(T.SD1_UNET, layers_per_block=depth)), T.unet_inputs(), lambda m, x: m(*x).sample, {}
    if kind.startswith("flux"):
        from diffusers import FluxTransformer2DModel

        model = T.randomize_(FluxTransformer2DModel(**dict(T.FLUX, num_layers=2 * depth, num_single_layers=2 * depth)))
        # flux-blocks: one block picked by index (blocks=), the others left alone
        return model, T.flux_inputs(), lambda m, x: m(**x).sample, dict(blocks=[1]) if kind == "flux-blocks" else {}
    if kind == "z-image":  # blocks in three sections of its sequence (refiners and main layers)
        import tiny_unified_families as U
        from diffusers import ZImageTransformer2DModel

        model = T.randomize_(ZImageTransformer2DModel(**dict(U.ZIMAGE, n_layers=2 * depth, n_refiner_layers=depth)))
        return model, U.z_image_inputs(), lambda m, x: U.z_image_run(m, x), {}
    return T.wan(num_layers=2 * depth), T.wan_inputs(), lambda m, x: m(**x).sample, {}


GROWTH = [(kind, mode) for kind in ("unet", "flux", "flux-blocks", "wan", "z-image") for mode in ("merge", "downsample")
          if (kind, mode) != ("z-image", "downsample")]  # Z-Image refuses downsampling by name


@pytest.mark.parametrize("kind,mode", GROWTH)
def test_the_graphs_do_not_grow_with_the_blocks(kind, mode):
    """One graph set serves every block of a class at a shape: a model with twice the blocks compiles as many graphs
    (a graph per block, were a block's index read as a constant, would double them)."""
    graphs = []
    for depth in (1, 2):
        torch._dynamo.reset()
        model, inputs, run, extra = _deep(kind, depth)
        tomesd.apply_patch(model, **(dict(ratio=0.5) if mode == "merge" else dict(mode="downsample")), **extra)
        backend = CountingBackend()
        model.compile_repeated_blocks(fullgraph=True, backend=backend)
        try:
            with torch.no_grad():
                run(model, inputs)
        finally:
            tomesd.remove_patch(model)
        graphs.append(backend.graphs)
    assert graphs[0] == graphs[1]


def test_concurrent_calls_of_a_regionally_compiled_patch_each_merge_as_alone():
    """Blocks compiled on their own find their call without reading a thread's stack, so the calls of such a patch
    take turns (a lock from the root's entry to its exit): threads calling at once each get eager ToMe's output."""
    import tiny_torch as T
    from threads import run_in_threads

    unet = T.unet()
    inputs = [T.unet_inputs(seed=s) for s in range(3)]
    tomesd.apply_patch(unet, ratio=0.5)
    try:
        with torch.no_grad():
            eager = [unet(*x).sample for x in inputs]
            unet.compile_repeated_blocks(fullgraph=True, backend="eager")
            unet(*inputs[0])

            def job(i, sync):
                outs = []
                for _ in range(2):
                    sync()
                    with torch.no_grad():
                        outs.append(unet(*inputs[i]).sample)
                return outs

            results = run_in_threads(job, count=3)
    finally:
        tomesd.remove_patch(unet)
    for i, outs in results.items():
        assert all(torch.allclose(out, eager[i], rtol=0, atol=TOL) for out in outs)


def test_a_compile_that_fails_leaves_nothing_behind():
    """A patched model whose compile fails (its backend raises, or tracing meets a user's hook that raises) leaves
    nothing that changes another patched model's compiled calls (no recompile, the same outputs), or its own eager
    calls after."""
    import tiny_torch as T

    x, t, c = T.unet_inputs()

    def run(model):
        with torch.no_grad():
            return model(x, t, c).sample

    first, other = T.unet(), T.unet(seed=1)
    base = run(first)
    for model in (first, other):
        tomesd.apply_patch(model, ratio=0.5)
    expected, expected_other = run(first), run(other)
    assert (expected - base).abs().max() > 1000 * TOL
    backend = CountingBackend()
    other.compile_repeated_blocks(fullgraph=True, backend=backend)
    compiled_other = run(other)
    graphs = backend.graphs

    def failing(gm, example_inputs):
        raise RuntimeError("a compiler error")

    try:
        first.compile_repeated_blocks(fullgraph=True, backend=failing)
        with pytest.raises(Exception, match="a compiler error"):
            run(first)
        blocks = [m for m in first.modules() if type(m).__name__ == "BasicTransformerBlock"]
        hook = blocks[1].register_forward_pre_hook(lambda m, args: (_ for _ in ()).throw(ValueError("a user's hook")))
        first.compile_repeated_blocks(fullgraph=True, backend="eager")
        with pytest.raises(Exception, match="a user's hook"):
            run(first)
        hook.remove()
        with torch._dynamo.config.patch(error_on_recompile=True):
            assert torch.equal(run(other), compiled_other) and backend.graphs == graphs
        assert torch.allclose(compiled_other, expected_other, rtol=0, atol=TOL)
        for block in blocks:
            block._compiled_call_impl = None  # the failed model's blocks eager again
        assert torch.equal(run(first), expected)
    finally:
        tomesd.remove_patch(first)
        tomesd.remove_patch(other)


@pytest.mark.parametrize("setting", [dict(share_across_blocks=True), dict(reuse_steps=2), dict(restore_tokens=True,
                                                                                                 reuse_steps=3)])
def test_matchings_kept_across_blocks_or_steps_are_refused_by_name(setting):
    """What hands matchings from block to block or step to step through Python state cannot cross the edges of blocks
    compiled on their own: refused at apply_patch when the blocks are compiled already, else at the first call that
    finds them compiled, before anything changes, naming what works."""
    import tiny_torch as T

    x, t, c = T.unet_inputs()
    unet = T.unet()
    with torch.no_grad():
        plain = unet(x, t, c).sample
    unet.compile_repeated_blocks(fullgraph=True, backend="eager")
    with pytest.raises(ValueError, match=r"compile_repeated_blocks.*compile the whole model"):
        tomesd.apply_patch(unet, ratio=0.5, **setting)
    assert all(not m._forward_pre_hooks and "forward" not in vars(m) for m in unet.modules())
    unet = T.unet()
    tomesd.apply_patch(unet, ratio=0.5, **setting)
    unet.compile_repeated_blocks(fullgraph=True, backend="eager")
    try:
        with torch.no_grad(), pytest.raises(ValueError, match=r"patch without (share_across_blocks|reuse_steps)"):
            unet(x, t, c)
    finally:
        tomesd.remove_patch(unet)
    with torch.no_grad():
        assert torch.equal(unet(x, t, c).sample, plain)
