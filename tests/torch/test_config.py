"""tomesd.ToMeConfig / ToDoConfig: apply_patch(model, config=...) is apply_patch(model, **settings), bit for bit;
configs validate on construction with ToMeArgs' own errors; a config and settings together are refused."""
import ast
import dataclasses
import pathlib

import pytest
import torch

import tiny_torch as T
import tomesd
from tome_core import ToMeArgs
from tomesd import ToDoConfig, ToMeConfig

TOL = 1e-4


def forward(model, inputs):
    x, t, c = inputs
    with torch.no_grad():
        return model(x, t, c).sample


def patched(model, inputs, **kwargs):
    tomesd.apply_patch(model, **kwargs)
    try:
        return forward(model, inputs)
    finally:
        tomesd.remove_patch(model)


def hooks(model):
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


@pytest.fixture(scope="module")
def unet():
    return T.unet()


@pytest.mark.parametrize(
    "settings",
    [dict(ratio=0.5), dict(), dict(ratio=0.6, max_downsample=2, sx=2, sy=1, seed=3, merge_mlp=True),
     dict(ratio={"attn": 0.5, "mlp": 0.3}, use_rand=False), dict(ratio=0.5, reuse_steps=2, share_across_blocks=True)],
    ids=["ratio", "defaults", "many", "per-site", "reuse"],
)
def test_tome_config_equals_settings_bit_for_bit(unet, settings):
    inputs = T.unet_inputs()
    base = forward(unet, inputs)
    ours = patched(unet, inputs, **settings)
    effect = (ours - base).abs().max().item()
    assert effect > 1000 * TOL, f"ToMe changed the output by only {effect}: the check would be vacuous"
    assert torch.equal(patched(unet, inputs, config=ToMeConfig(**settings)), ours)


@pytest.mark.parametrize(
    "settings", [dict(), dict(downsample_factor=3, downsample_method="avg", max_downsample=2)], ids=["defaults", "avg3"]
)
def test_todo_config_equals_downsample_mode_bit_for_bit(unet, settings):
    inputs = T.unet_inputs()
    base = forward(unet, inputs)
    ours = patched(unet, inputs, mode="downsample", **settings)
    effect = (ours - base).abs().max().item()
    assert effect > 1000 * TOL, f"ToDo changed the output by only {effect}: the check would be vacuous"
    assert torch.equal(patched(unet, inputs, config=ToDoConfig(**settings)), ours)
    # Not merge mode by mistake: ToMe's default differs from ToDo's.
    assert not torch.equal(patched(unet, inputs), ours)


def test_a_config_holds_the_settings_apply_patch_builds_with_the_defaults_visible():
    assert ToMeConfig().args == ToMeArgs(mode="merge")
    assert ToMeConfig(ratio=0.3, seed=2).args == ToMeArgs(ratio=0.3, seed=2)
    assert ToDoConfig(downsample_method="avg").args == ToMeArgs(mode="downsample", downsample_method="avg")
    merge, todo = ToMeConfig().args, ToDoConfig().args
    assert (merge.mode, merge.ratio, merge.sx, merge.sy, merge.use_rand, merge.merge_attn, merge.merge_crossattn,
            merge.merge_mlp, merge.reuse_steps, merge.share_across_blocks, merge.st) == (
        "merge", 0.5, 2, 2, True, True, False, False, 1, False, 1)
    assert (todo.mode, todo.downsample_factor, todo.downsample_method) == ("downsample", 2, "nearest")
    assert dict(ToMeConfig.DEFAULTS) == {name: getattr(merge, name) for name in ToMeConfig.DEFAULTS}
    assert dict(ToDoConfig.DEFAULTS) == {"downsample_factor": 2, "downsample_method": "nearest",
                                        "proportional_attention": False, "reuse_steps": 1, "restore_tokens": False,
                                        "kept_sizes": 16}
    # Fields None mean the default, as apply_patch's arguments do.
    assert all(getattr(ToMeConfig(), f.name) is None for f in dataclasses.fields(ToMeConfig))
    # Sequences kept as ToMeArgs normalises them; equal settings, equal configs.
    config = ToMeConfig(blocks=[3, 1, 3], ratio_schedule=[(0, 0.2), (0.5, 0.4)])
    assert config.blocks == (1, 3) and config.ratio_schedule == ((0.0, 0.2), (0.5, 0.4))
    assert config == ToMeConfig(blocks=(1, 3), ratio_schedule=((0.0, 0.2), (0.5, 0.4)))


def test_configs_are_frozen_and_keyword_only():
    config = ToMeConfig(ratio=0.5)
    with pytest.raises(dataclasses.FrozenInstanceError, match="cannot assign to field 'ratio'"):
        config.ratio = 0.3
    with pytest.raises(TypeError, match=r"ToMeConfig.__init__\(\) takes 1 positional argument but 2 were given"):
        ToMeConfig(0.5)
    with pytest.raises(TypeError, match=r"ToDoConfig.__init__\(\) takes 1 positional argument but 2 were given"):
        ToDoConfig(2)
    assert dataclasses.replace(config, sx=4).args.sx == 4 and config.args.sx == 2
    with pytest.raises(ValueError, match="sx must be a positive int"):
        dataclasses.replace(config, sx=0)  # a changed config is validated anew


BAD = [
    (ToMeConfig, dict(ratio=1.5), "ratio must be a number in"),
    (ToMeConfig, dict(ratio="0.5"), "ratio must be a number in"),
    (ToMeConfig, dict(ratio={"foo": 0.5}), "ratio as a mapping names sites"),
    (ToMeConfig, dict(ratio={"attn": 0.5}, merge_mlp=True), "merge_mlp=True contradicts ratio"),
    (ToMeConfig, dict(sx=0), "sx must be a positive int"),
    (ToMeConfig, dict(sy=2.5), "sy must be a positive int"),
    (ToMeConfig, dict(st=0), "st must be a positive int"),
    (ToMeConfig, dict(max_downsample=0), "max_downsample must be a positive int"),
    (ToMeConfig, dict(use_rand="no"), "use_rand must be True or False"),
    (ToMeConfig, dict(merge_attn=1), "merge_attn must be True or False"),
    (ToMeConfig, dict(share_across_blocks=1), "share_across_blocks must be True or False"),
    (ToMeConfig, dict(seed=1.5), "seed must be an int or None"),
    (ToMeConfig, dict(reuse_steps=0), "reuse_steps must be a positive int"),
    (ToMeConfig, dict(blocks=[]), "blocks must be a non-empty list"),
    (ToMeConfig, dict(ratio_schedule=[(0.1, 0.5)]), "ratio_schedule's progress points must start at 0.0"),
    (ToMeConfig, dict(ratio=0.5, ratio_schedule=[(0.0, 0.5)]), "give ratio or ratio_schedule, not both"),
    (ToDoConfig, dict(downsample_factor=0), "downsample_factor must be a positive int"),
    (ToDoConfig, dict(downsample_method="bicubic"), "downsample_method must be one of"),
    (ToDoConfig, dict(max_downsample=0), "max_downsample must be a positive int"),
    (ToDoConfig, dict(blocks=[-1]), "blocks must be a non-empty list"),
]


@pytest.mark.parametrize("cls,settings,message", BAD, ids=[f"{c.__name__}-{next(iter(s))}-{i}" for i, (c, s, _) in
                                                            enumerate(BAD)])
def test_bad_values_raise_at_construction_as_tome_args_does(cls, settings, message):
    with pytest.raises(ValueError, match=message) as raised:
        cls(**settings)
    with pytest.raises(ValueError) as theirs:
        ToMeArgs(mode=cls.mode, **settings)
    assert str(raised.value) == str(theirs.value)  # one validation, ToMeArgs'


MERGE_ONLY = ["ratio", "sx", "sy", "use_rand", "merge_attn", "merge_crossattn", "merge_mlp", "seed",
              "share_across_blocks", "st", "ratio_schedule"]


@pytest.mark.parametrize("name", MERGE_ONLY)
def test_todo_config_has_no_merge_only_field(name):
    with pytest.raises(TypeError, match=rf"ToDoConfig.__init__\(\) got an unexpected keyword argument '{name}'"):
        ToDoConfig(**{name: 1})


@pytest.mark.parametrize("name", ["downsample_factor", "downsample_method", "mode"])
def test_tome_config_has_no_downsample_field(name):
    with pytest.raises(TypeError, match=rf"ToMeConfig.__init__\(\) got an unexpected keyword argument '{name}'"):
        ToMeConfig(**{name: 2})


@pytest.mark.parametrize(
    "config,settings",
    [(ToMeConfig(ratio=0.5), dict(ratio=0.5)), (ToMeConfig(), dict(seed=0)), (ToMeConfig(), dict(mode="merge")),
     (ToDoConfig(), dict(mode="downsample")), (ToDoConfig(), dict(max_downsample=1, downsample_factor=2))],
    ids=["ratio", "seed", "mode-merge", "mode-downsample", "two"],
)
def test_config_with_settings_is_refused_before_anything_changes(unet, config, settings):
    inputs = T.unet_inputs()
    base = forward(unet, inputs)
    names = ", ".join(settings)
    with pytest.raises(ValueError, match=rf"apply_patch\(\) got config and {names}: give the settings either as "
                                         r"config or as arguments, not both"):
        tomesd.apply_patch(unet, config=config, **settings)
    assert hooks(unet) == 0
    assert torch.equal(forward(unet, inputs), base)  # not patched


@pytest.mark.parametrize("config", [dict(ratio=0.5), ToMeArgs(ratio=0.5), 0.5], ids=["dict", "ToMeArgs", "float"])
def test_config_of_the_wrong_type_is_refused(unet, config):
    with pytest.raises(TypeError, match=rf"config must be a tomesd.ToMeConfig or tomesd.ToDoConfig, got "
                                        rf"{type(config).__name__}"):
        tomesd.apply_patch(unet, config=config)
    assert hooks(unet) == 0


def test_keywords_keep_tomesd_order_and_bad_settings_keep_their_errors(unet):
    import inspect

    params = list(inspect.signature(tomesd.apply_patch).parameters.values())
    positional = [p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert positional == ["model", "ratio", "max_downsample", "sx", "sy", "use_rand", "merge_attn",
                          "merge_crossattn", "merge_mlp"]  # tomesd 0.1.3's
    assert all(p.kind is p.KEYWORD_ONLY for p in params[len(positional):])
    assert params[-1].name == "config"
    with pytest.raises(ValueError, match="downsample_factor has no meaning with mode='merge'"):
        tomesd.apply_patch(unet, downsample_factor=2)
    with pytest.raises(ValueError, match=r"mode must be one of \('merge', 'downsample'\), got 'fast'"):
        tomesd.apply_patch(unet, mode="fast")
    assert hooks(unet) == 0


def test_tomesd_never_builds_tome_args_by_position():
    root = pathlib.Path(tomesd.__file__).parent
    calls = [
        node for path in sorted(root.rglob("*.py")) for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "ToMeArgs"
    ]
    assert len(calls) >= 2  # apply_patch's settings and the configs'
    assert [ast.unparse(call) for call in calls if call.args] == []  # by keyword (or a mapping of names) only
