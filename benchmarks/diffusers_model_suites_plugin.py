"""pytest plugin: run diffusers' own model test suites with tomesd applied to every built model.

When the environment variable TOME=1 is set, the __init__ of SD3Transformer2DModel,
FluxTransformer2DModel, WanTransformer3DModel and PixArtTransformer2DModel is wrapped so that every
instance (built directly, via from_config, or via from_pretrained) gets `tomesd.apply_patch(model)`
with default arguments right after construction. Without TOME=1 the plugin does nothing but report.

Used as: tests/ taken from huggingface/diffusers main @ 58eb52c0803ea9af3abec60841c2a093bdf1f951
(no v0.42.1 tag in the mirror; installed diffusers is 0.42.1) and run against the installed
diffusers 0.42.1 (CPU, torch 2.13). Copy this file to a directory on PYTHONPATH as tome_plugin.py.
HF_HUB_OFFLINE=1 avoids a ~25 s network timeout in the one Hub-dependent CPU test.

Run from a checkout of diffusers' tests/ directory (matching the installed diffusers), e.g.:

    cd diffusers_src   # contains tests/ from `git archive <commit> tests`
    PYTHONPATH=/dir/with/this/plugin:/dir/with/tomesd \
      python -m pytest -p tome_plugin -p no:cacheprovider -q -rf \
      tests/models/transformers/test_models_transformer_sd3.py            # unpatched
    TOME=1 PYTHONPATH=... python -m pytest -p tome_plugin ... (same)    # patched

The number of apply_patch calls (and failures of apply_patch itself) is printed in the terminal
summary and written to $TOME_COUNT_FILE (default ./tome_patch_count.txt) at session end.
"""
import functools
import os

_ENABLED = os.environ.get("TOME") == "1"
_TARGETS = (
    "SD3Transformer2DModel",
    "FluxTransformer2DModel",
    "WanTransformer3DModel",
    "PixArtTransformer2DModel",
)
_COUNTS = {}
_ERRORS = {}


def _install():
    import diffusers
    import tomesd

    for name in _TARGETS:
        cls = getattr(diffusers, name)
        orig_init = cls.__init__
        if getattr(orig_init, "_tome_wrapped", False):
            continue

        def make(orig_init, name):
            @functools.wraps(orig_init)
            def __init__(self, *args, **kwargs):
                orig_init(self, *args, **kwargs)
                # only the exact class (subclasses' own __init__ would patch before they finish)
                if type(self).__name__ == name:
                    try:
                        tomesd.apply_patch(self)
                    except Exception as e:  # record, then re-raise so the test shows it
                        _ERRORS[name] = _ERRORS.get(name, 0) + 1
                        raise
                    _COUNTS[name] = _COUNTS.get(name, 0) + 1

            __init__._tome_wrapped = True
            return __init__

        cls.__init__ = make(orig_init, name)


def pytest_configure(config):
    if _ENABLED:
        _install()


def pytest_terminal_summary(terminalreporter):
    line = f"TOME={'1' if _ENABLED else 'unset'} apply_patch counts: {_COUNTS} errors: {_ERRORS}"
    terminalreporter.write_line(line)
    with open(os.environ.get("TOME_COUNT_FILE", "tome_patch_count.txt"), "w") as f:
        f.write(line + "\n")
