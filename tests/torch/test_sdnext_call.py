"""Hosts that call tomesd take this package as tomesd. SD.Next applies token merging with one call on whatever
diffusers pipeline is loaded, its ratio slider going up to 1.0; tomesd 0.1.3 read `.unet` only, so SD.Next logs
"not supported" on every DiT pipeline. The same call merges here on SD3, Flux, Wan and PixArt pipelines, and
remove_patch gives each its exact images back."""
import importlib.metadata

import numpy as np
import pytest
import torch

import tiny_torch as T
import tomesd
import tomesd.patch


def sdnext_call(pipe, ratio):
    """SD.Next's call, argument for argument (modules/sd_models.py: apply_token_merging)."""
    tomesd.apply_patch(pipe, ratio=ratio, use_rand=False, merge_attn=True, merge_crossattn=False, merge_mlp=False)


PIPELINES = {
    "sd3": (lambda tmp: T.sd3_pipeline(tmp), T.run_sd3_pipeline, "transformer"),
    "flux": (lambda tmp: T.flux_pipeline(), T.run_flux_pipeline, "transformer"),
    "wan": (lambda tmp: T.wan_pipeline(), T.run_wan_pipeline, "transformer"),
    "pixart": (lambda tmp: T.pixart_pipeline(), T.run_pixart_pipeline, "transformer"),
}


@pytest.mark.parametrize("ratio", [0.5, 1.0])
@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_sdnexts_call_merges_on_transformer_pipelines(name, ratio, tmp_path):
    build, run, denoiser = PIPELINES[name]
    pipe = build(tmp_path)
    torch.manual_seed(0)
    base = run(pipe)
    sdnext_call(pipe, ratio)
    try:
        with tomesd.observe(getattr(pipe, denoiser)) as seen:
            torch.manual_seed(0)
            merged = run(pipe)
    finally:
        tomesd.remove_patch(pipe)
    assert seen.calls and all(call.merged_blocks("attn") for call in seen.calls)
    assert np.abs(np.asarray(merged) - np.asarray(base)).max() > 1e-4
    torch.manual_seed(0)
    assert (np.asarray(run(pipe)) == np.asarray(base)).all()


def test_the_package_installs_as_the_distribution_tomesd_with_its_patch_module():
    """SD.Next's installer reinstalls PyPI's tomesd unless a distribution of that name is installed."""
    assert importlib.metadata.version("tomesd") == "0.2.0"
    assert tomesd.patch.apply_patch is tomesd.apply_patch and tomesd.patch.remove_patch is tomesd.remove_patch
