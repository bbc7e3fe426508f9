"""The core and the public package import no framework; argument checks need none either."""
import subprocess
import sys

import pytest

from tome_core import ToMeArgs, downsample_level, plan_block
from tome_core.rng import stream_key


def test_importing_core_and_package_loads_no_framework():
    code = (
        "import sys, tome_core, tomesd, tomesd.merge, tomesd.patch\n"
        "loaded = [m for m in ('torch', 'paddle', 'diffusers', 'ppdiffusers') if m in sys.modules]\n"
        "assert not loaded, loaded\n"
        "print('clean')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "clean" in out.stdout


def test_core_sources_never_name_a_framework():
    import pathlib

    import tome_core

    for path in pathlib.Path(tome_core.__file__).parent.glob("*.py"):
        text = path.read_text()
        for name in ("import torch", "import paddle", "from torch", "from paddle"):
            assert name not in text, f"{path.name} contains {name!r}"


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
    assert downsample_level((64, 64), 4096) == 1
    assert downsample_level((64, 64), 1024) == 2
    assert downsample_level((65, 63), 33 * 32) == 2
    plan = plan_block(args, (65, 63), 2, 33 * 32, finest_level=1)
    assert (plan.h, plan.w, plan.r, plan.use_rand) == (33, 32, 528, True)
    assert plan_block(args, (64, 64), 2, 256, finest_level=1) is None  # level 4 > 2
    assert plan_block(args, (64, 64), 3, 4096, finest_level=1).use_rand is False  # odd batch


def test_default_max_downsample_follows_finest_attention_level():
    args = ToMeArgs()  # max_downsample=None
    assert plan_block(args, (128, 128), 2, 64 * 64, finest_level=2) is not None  # SDXL's top attention level
    assert plan_block(args, (128, 128), 2, 32 * 32, finest_level=2) is None
    assert plan_block(args, (64, 64), 2, 32 * 32, finest_level=1) is None  # SD1: as tomesd's default 1


def test_stream_keys_differ_by_seed_and_counter():
    keys = {stream_key(s, c) for s in range(20) for c in range(50)}
    assert len(keys) == 1000
    assert all(0 <= k < 2**31 - 1 for k in keys)
