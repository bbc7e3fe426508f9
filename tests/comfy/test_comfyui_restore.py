"""The ToMe node's restore_tokens through ComfyUI's own sampler: the first step of each reuse_steps window runs
unmerged (ComfyUI's model calls count steps by their timestep), the others merge and restore; below two
reuse_steps the node refuses, naming the widget."""
import pytest

import comfy_host
import tomesd

comfy_host.import_comfy()

from tomesd.comfyui.nodes import ToMe  # noqa: E402


def tome(model, reuse_steps, restore):
    return ToMe().patch(model, 0.5, 0.0, 0.0, "auto", "", True, reuse_steps, 0.0, 1.0, "", False, restore)[0]


def test_a_sampler_run_restores_between_unmerged_steps():
    model = comfy_host.sd1_patcher()[0]
    reused = comfy_host.sample(tome(model, 3, False), steps=6)
    patched = tome(model, 3, True)
    with tomesd.observe(patched) as seen:
        restored = comfy_host.sample(patched, steps=6)
    merged = [bool(call.merged_blocks("attn")) for call in seen.calls]
    assert merged == [False, True, True] * 2  # guidance halves in one call per step
    assert (restored - reused).abs().max() > 1e-3


def test_restore_without_reuse_is_refused_naming_reuse_steps():
    with pytest.raises(ValueError, match="ToMe node: restore_tokens .* give reuse_steps=2 or more"):
        tome(comfy_host.sd1_patcher()[0], 1, True)


def test_the_merged_steps_add_the_residuals_their_window_kept(monkeypatch):
    """The node puts new hooks on the model at each of its calls: the residuals kept at a window's unmerged step are
    found again by the later calls' hooks, and every merged site of those steps adds one."""
    from tomesd.runtime import restore

    added = []
    add = restore.add

    def counting(hook, site, positions, output, where=None):
        out = add(hook, site, positions, output, where)
        added.append(out is not output)
        return out

    monkeypatch.setattr(restore, "add", counting)
    comfy_host.sample(tome(comfy_host.sd1_patcher()[0], 3, True), steps=6)
    assert added and all(added), added
