"""pipe.apply_tome(config=...) and tomesd.apply_patch(paddle_layer, config=...): the same as the settings by
keyword, bit for bit; apply_tome's positional arguments are ppdiffusers' own, in its order, and no more."""
import inspect

import numpy as np
import paddle
import pytest

import tiny_paddle as TP
import tomesd
from tomesd import ToDoConfig, ToMeConfig
from tomesd import apply_tome as pp_adapter

TOL = 2e-4


@pytest.fixture(scope="module")
def paddle_unet(tmp_path_factory):
    return TP.unet(tmp_path_factory.mktemp("unet"))


@pytest.fixture(scope="module")
def inputs():
    return TP.unet_inputs()


def forward(unet, inputs):
    with paddle.no_grad():
        return unet(*inputs).sample.numpy()


def through_apply_tome(unet, inputs, *args, **kwargs):
    unet.apply_tome(*args, **kwargs)
    try:
        return forward(unet, inputs)
    finally:
        unet.remove_tome()


def through_apply_patch(unet, inputs, **kwargs):
    tomesd.apply_patch(unet, **kwargs)
    try:
        return forward(unet, inputs)
    finally:
        tomesd.remove_patch(unet)


def assert_untouched(unet, inputs, base):
    assert all(not m._forward_pre_hooks and not m._forward_post_hooks for m in unet.sublayers(include_self=True))
    np.testing.assert_array_equal(forward(unet, inputs), base)  # not patched


@pytest.mark.parametrize(
    "config,settings",
    [(ToMeConfig(ratio=0.5), dict(ratio=0.5)), (ToMeConfig(ratio=0.4, max_downsample=2, sy=1, seed=3),
                                                dict(ratio=0.4, max_downsample=2, sy=1, seed=3)),
     (ToDoConfig(), dict(mode="downsample")),
     (ToDoConfig(downsample_factor=3, downsample_method="avg"),
      dict(mode="downsample", downsample_factor=3, downsample_method="avg"))],
    ids=["ratio", "many", "todo", "todo-avg3"],
)
def test_config_equals_settings_bit_for_bit(paddle_unet, inputs, config, settings):
    base = forward(paddle_unet, inputs)
    ours = through_apply_tome(paddle_unet, inputs, **settings)
    assert np.abs(ours - base).max() > 1000 * TOL  # the patch acts: comparing it is not comparing a no-op
    np.testing.assert_array_equal(through_apply_tome(paddle_unet, inputs, config=config), ours)
    np.testing.assert_array_equal(through_apply_patch(paddle_unet, inputs, config=config), ours)


def test_positional_arguments_are_ppdiffusers_own_in_its_order(paddle_unet, inputs):
    builtin = pp_adapter.BUILTIN[paddle.nn.Layer][0]  # ppdiffusers' own apply_tome
    theirs = list(inspect.signature(builtin).parameters)[1:]
    assert list(pp_adapter.POSITIONAL) == theirs
    base = forward(paddle_unet, inputs)
    # sx != sy, so a swapped pair would show.
    by_position = through_apply_tome(paddle_unet, inputs, 0.4, 2, 2, 1, False)
    assert np.abs(by_position - base).max() > 1000 * TOL
    np.testing.assert_array_equal(
        by_position, through_apply_tome(paddle_unet, inputs, ratio=0.4, max_downsample=2, sx=2, sy=1, use_rand=False))
    with pp_adapter.builtin_methods():
        paddle_unet.apply_tome(0.4, 2, 2, 1, False)
        builtin_out = forward(paddle_unet, inputs)
        paddle_unet.remove_tome()
    assert np.abs(by_position - builtin_out).max() < TOL
    np.testing.assert_array_equal(through_apply_tome(paddle_unet, inputs, 0.5, 1, 2, 2, False),
                                  through_apply_tome(paddle_unet, inputs, ratio=0.5, use_rand=False))


def test_seed_and_later_arguments_are_refused_by_position(paddle_unet, inputs):
    base = forward(paddle_unet, inputs)
    with pytest.raises(TypeError, match=r"apply_tome\(\) takes at most 8 settings by position, ppdiffusers' \(ratio, "
                                        r"max_downsample, sx, sy, use_rand, merge_attn, merge_crossattn, merge_mlp\), "
                                        r"but 9 were given: give seed and the others by keyword"):
        paddle_unet.apply_tome(0.5, 1, 2, 2, True, True, False, False, 3)
    assert_untouched(paddle_unet, inputs, base)


@pytest.mark.parametrize(
    "call,error,message",
    [(lambda u: u.apply_tome(0.5, config=ToMeConfig(ratio=0.5)), ValueError,
      r"apply_tome\(\) got config and ratio: give the settings either as config or as arguments, not both"),
     (lambda u: u.apply_tome(config=ToDoConfig(), mode="downsample", seed=1), ValueError,
      r"apply_tome\(\) got config and seed, mode: give the settings"),
     (lambda u: tomesd.apply_patch(u, sx=2, config=ToMeConfig()), ValueError,
      r"apply_patch\(\) got config and sx: give the settings"),
     (lambda u: u.apply_tome(config={"ratio": 0.5}), TypeError,
      "config must be a tomesd.ToMeConfig or tomesd.ToDoConfig, got dict"),
     (lambda u: u.apply_tome(0.5, ratio=0.5), TypeError, r"apply_tome\(\) got multiple values for argument 'ratio'"),
     (lambda u: u.apply_tome(rate=0.5), TypeError, r"apply_tome\(\) got an unexpected keyword argument 'rate'"),
     (lambda u: u.apply_tome(config=ToMeConfig(ratio=0.8)), ValueError, "The tome ratio must be less than 0.75")],
    ids=["config+ratio", "config+seed+mode", "apply_patch-config+sx", "wrong-type", "twice", "unknown", "limit"],
)
def test_refusals_leave_the_layer_untouched(paddle_unet, inputs, call, error, message):
    base = forward(paddle_unet, inputs)
    with pytest.raises(error, match=message):
        call(paddle_unet)
    assert_untouched(paddle_unet, inputs, base)
