"""The core and the public package import no framework; the core finds a tensor's backend in a registry that
names no module above it; argument checks and the counter-based generator need no framework either."""
import math
import struct
import subprocess
import sys

import numpy as np
import pytest

import tome_core
from tome_core import ToMeArgs, level_of, plan_level_block, rng
from tome_core.backend import backend_for_name, get_backend, register_backend, registered_backends
from tome_core.rng import stream_key


def run_python(code):
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_importing_core_and_package_loads_no_framework():
    code = (
        "import sys, tome_core, tomesd, tomesd.merge, tomesd.patch\n"
        "loaded = [m for m in ('torch', 'paddle', 'diffusers', 'ppdiffusers') if m in sys.modules]\n"
        "assert not loaded, loaded\n"
        # the package registers both framework backends, by loader: neither is loaded, nor its framework
        "from tome_core.backend import _LOADED, registered_backends\n"
        "assert {'torch', 'paddle'} <= set(registered_backends()), registered_backends()\n"
        "assert not {'torch', 'paddle'} & set(_LOADED), _LOADED\n"
        # a framework's backend modules (backends/frameworks.py, which names none, may load)
        "assert not [m for m in sys.modules if m.startswith(('tomesd.backends.torch', 'tomesd.backends.paddle'))]\n"
        "print('clean')\n"
    )
    assert "clean" in run_python(code)


def test_core_alone_knows_no_backend_and_says_how_to_register_one():
    """tome_core imported without the application: no backend at all, and a tensor gets an error naming
    register_backend rather than an import of some package above the core."""
    code = (
        "import sys, numpy\n"
        "before = set(sys.modules)\n"
        "import tome_core\n"
        "assert tome_core.registered_backends() == (), tome_core.registered_backends()\n"
        "try:\n"
        "    tome_core.bipartite_soft_matching_random2d(numpy.zeros((1, 4, 2)), 2, 2, 2, 2, 1)\n"
        "except TypeError as e:\n"
        "    print(e)\n"
        "imported = {m.split('.')[0] for m in set(sys.modules) - before} - {'tome_core'}\n"
        "assert imported <= sys.stdlib_module_names, imported  # no package, not even on the error path\n"
    )
    message = run_python(code)
    assert "no ToMe backend is registered for 'numpy' tensors (registered: none)" in message
    assert "tome_core.register_backend('numpy', backend)" in message
    assert "register_backend('numpy', loader=" in message


def test_core_sources_never_name_a_module_above_them():
    import pathlib

    for path in pathlib.Path(tome_core.__file__).parent.glob("*.py"):
        text = path.read_text()
        for name in ("import torch", "import paddle", "from torch", "from paddle", "tomesd"):
            assert name not in text, f"{path.name} contains {name!r}"


class FakeTensor:
    pass


FakeTensor.__module__ = "fakeframework.tensor"  # a tensor of a framework nobody registered


def test_a_tensor_of_an_unregistered_framework_gets_a_clear_error(fw):
    with pytest.raises(TypeError) as info:
        get_backend(FakeTensor())
    message = str(info.value)
    assert "no ToMe backend is registered for 'fakeframework' tensors" in message
    assert "tome_core.register_backend('fakeframework', backend)" in message
    assert f"registered: {', '.join(sorted(registered_backends()))}" in message and fw.name in message
    assert "fakeframework" not in registered_backends()


def test_a_loader_runs_once_on_the_first_tensor_and_a_new_registration_replaces_it(fw):
    calls = []
    first, second = type("First", (), {"name": "first"})(), type("Second", (), {"name": "second"})()
    try:
        register_backend("fakeframework", loader=lambda: calls.append(1) or first)
        assert calls == [] and "fakeframework" in registered_backends()  # registering loads nothing
        assert get_backend(FakeTensor()) is first and backend_for_name("fakeframework") is first
        assert calls == [1]  # loaded once, then served from the registry
        register_backend("fakeframework", second)
        assert get_backend(FakeTensor()) is second
        with pytest.raises(TypeError, match="not both"):
            register_backend("fakeframework", first, loader=lambda: first)
        with pytest.raises(TypeError, match="not neither"):
            register_backend("fakeframework")
        with pytest.raises(TypeError, match="callable"):
            register_backend("fakeframework", loader=first)
    finally:
        from tome_core import backend as registry

        registry._LOADERS.pop("fakeframework", None)
        registry._LOADED.pop("fakeframework", None)
    assert get_backend(fw.tensor(np.zeros(1))) is fw.xp  # the frameworks' own entries are untouched


# ----------------------------------------------------------------------------- the counter-based generator

PRIME = 2**31 - 1


def python_randint(n, high, key):
    """rng.randint's documented hash of (key, i), in Python integers: two Lehmer steps and an xor-shift."""
    out = []
    for i in range(n):
        x = (i * 16_807 + key) % PRIME
        x = (x * 48_271) % PRIME
        out.append((x ^ (x // 65_536)) % high)
    return out


def python_timestep_key(t):
    t32 = struct.unpack("<f", struct.pack("<f", t))[0]
    return math.floor(t32 * 1024 + 0.5) % PRIME


@pytest.mark.parametrize("seed", [0, 1, 12345, 2**40 + 7])
def test_random_tables_equal_the_python_integer_formula_on_every_backend(fw, seed):
    """The same draws on every backend, bit for bit: the int64 arithmetic never overflows or rounds."""
    like = fw.tensor(np.zeros(1, dtype=np.float32))
    key = rng.call_key(fw.xp, seed, None)
    assert key == stream_key(seed, 0) and isinstance(key, int)
    for shape, high in (((9, 13), 4), ((117,), 9), ((2, 3, 5), 2**31 - 2)):
        draws = fw.numpy(rng.randint(fw.xp, like, list(shape), high, key))
        assert draws.dtype == np.int64 and draws.shape == shape
        assert draws.reshape(-1).tolist() == python_randint(math.prod(shape), high, key)
    assert len(set(python_randint(64, 4, key))) == 4  # the formula does spread over [0, high)


@pytest.mark.parametrize("row", [0, 1, 5])
def test_one_row_drawn_alone_equals_that_row_of_the_whole_table(fw, row):
    """A block compiled on its own draws its row alone (its index a tensor on the device): the same integers as the
    call's [blocks, cells] table gives it."""
    like = fw.tensor(np.zeros(1, dtype=np.float32))
    key = rng.call_key(fw.xp, 3, 500.0)
    whole = fw.numpy(rng.randint(fw.xp, like, [6, 11], 4, key))
    index = fw.tensor(np.array([row], dtype=np.int64))
    for at in (row, index):
        alone = fw.numpy(rng.randint(fw.xp, like, [1, 11], 4, key, rng.row_counters(fw.xp, like, 11, at)))
        assert alone.tolist() == whole[row:row + 1].tolist()
    assert whole[0].tolist() != whole[1].tolist()  # the rows do differ


# 3/2048 - 1e-12 keys as 2 through float32 (where it rounds to 3/2048) and as 1 in float64.
@pytest.mark.parametrize("timestep", [0.0, 1.0, 999.0, 781.25, 0.3, 13.0009765625, 8191.5, 3 / 2048 - 1e-12, -7.25, 1e10])
def test_a_timestep_tensor_keys_as_its_python_number(fw, timestep):
    assert rng.timestep_key(fw.xp, timestep) == python_timestep_key(timestep)
    for dtype in (np.float32, np.float64, np.int64):
        value = np.array(timestep).astype(dtype)
        if value != timestep:
            continue  # an integer dtype cannot hold this timestep
        for t in (value.reshape(()), np.array([value, value + 3])):  # a 0-d tensor, or its first element
            key = fw.numpy(rng.timestep_key(fw.xp, fw.tensor(t)))
            assert key.dtype == np.int64 and key.tolist() == [python_timestep_key(timestep)]
            call = fw.numpy(rng.call_key(fw.xp, 5, fw.tensor(t)))
            assert call.tolist() == [rng.call_key(fw.xp, 5, timestep)]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"ratio": -0.1}, {"ratio": 1.5}, {"ratio": "half"}, {"ratio": True}, {"sx": 0}, {"sy": 1.5},
        {"max_downsample": 0}, {"max_downsample": 2.0}, {"use_rand": "yes"}, {"merge_mlp": 1}, {"seed": "x"},
    ],
)
def test_bad_arguments_are_refused(kwargs):
    (name,) = kwargs
    with pytest.raises(ValueError, match=name):  # one error type for every bad value, naming it
        ToMeArgs(**kwargs)


def test_schedule_matches_tomesd_rule():
    args = ToMeArgs(ratio=0.5, max_downsample=2)
    assert level_of((64, 64), 4096) == 1
    assert level_of((64, 64), 1024) == 2
    assert level_of((65, 63), 33 * 32) == 2
    plan = plan_level_block(args, (65, 63), 2, 33 * 32, finest_level=1)
    assert (plan.h, plan.w, plan.r, plan.use_rand) == (33, 32, 528, True)
    assert plan_level_block(args, (64, 64), 2, 256, finest_level=1) is None  # level 4 > 2
    # An odd batch keeps random dst (tomesd turned it off): draws keyed by (seed, timestep, block) are the
    # same in every call of a step, so a batch split over calls merges as one call.
    assert plan_level_block(args, (64, 64), 3, 4096, finest_level=1).use_rand is True


def test_default_max_downsample_follows_finest_attention_level():
    args = ToMeArgs()  # max_downsample=None
    assert plan_level_block(args, (128, 128), 2, 64 * 64, finest_level=2) is not None  # SDXL's top attention level
    assert plan_level_block(args, (128, 128), 2, 32 * 32, finest_level=2) is None
    assert plan_level_block(args, (64, 64), 2, 32 * 32, finest_level=1) is None  # SD1: as tomesd's default 1


def test_stream_keys_differ_by_seed_and_counter():
    keys = {stream_key(s, c) for s in range(20) for c in range(50)}
    assert len(keys) == 1000
    assert all(0 <= k < 2**31 - 1 for k in keys)
