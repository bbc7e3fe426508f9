"""ComfyUI's model families beyond test_comfyui.py's contract: Qwen-Image (a table entry: its root and block kind)
in a sampler run, with its rotary rows following the merged tokens and its refusals; and the families that do not
fit ToMe's tables (Cosmos 1), each refused before a wrong output, with what the runtime would need to merge it.
(Lumina 2 / Z-Image, LTX-Video and Cosmos Predict2 merge: test_comfyui_nextdit_ltx.py; HiDream:
test_comfyui_image_first.py.)"""
from __future__ import annotations

import pytest
import torch

import comfy_host
import tomesd

comfy_host.import_comfy()

from test_comfyui import _inputs, _model, tome, todo  # noqa: E402

SIGMA = torch.full((2,), 0.8)


# ---- Qwen-Image ----

def test_qwen_image_rotary_rows_follow_each_samples_merged_tokens(monkeypatch):
    """The joint attention gets its text rows as they were and, per sample, each merged image token's
    representative's row: the rows [B, 1, text + image, ...] of the block follow the matching."""
    import comfy.ldm.qwen_image.model as qwen

    model = _model("qwen")
    args, conds = _inputs("qwen")
    rows = []
    rope = qwen.apply_rope1
    monkeypatch.setattr(qwen, "apply_rope1", lambda x, freqs: rows.append(freqs) or rope(x, freqs))
    comfy_host.run(model, *args, **conds)
    plain = rows[0]  # block 0's query rows, unpatched
    rows.clear()
    patched = tome(model)
    with tomesd.observe(patched) as seen:
        comfy_host.run(patched, *args, **conds)
    merge = seen.calls[0].blocks[0].merge
    reps = merge.representatives  # [B, M]: one matching per sample (the rows carry a batch axis)
    assert reps.shape == (2, 32)
    text = args[2].shape[1]
    assert rows[0].shape[2] == text + 32
    assert torch.equal(rows[0][:, :, :text], plain[:, :, :text])  # the text's rows untouched
    for b in range(2):
        assert torch.equal(rows[0][b, :, text:], plain[b, :, text + reps[b]])


def test_qwen_image_runs_in_a_sampler_and_leaves_its_input_model_alone():
    model = _model("qwen")
    latent = {"samples": torch.randn(1, 16, 1, 16, 16, generator=torch.Generator().manual_seed(3))}
    plain = comfy_host.sample(model, cfg=1.0, latent=latent)
    patched = tome(model, mlp=0.5)
    with tomesd.observe(patched) as seen:
        out = comfy_host.sample(patched, cfg=1.0, latent=latent)
    assert torch.isfinite(out).all() and (out - plain).abs().max() > 1e-3
    assert len(seen.calls) == 4 and all(call.merged_blocks("mlp") == [0, 1] for call in seen.calls)
    assert torch.equal(comfy_host.sample(model, cfg=1.0, latent=latent), plain)  # bit for bit after


def test_qwen_image_refusals():
    """Reference latents (Qwen-Image-Edit) join the image's tokens in every block: refused at the call. ToDo has
    no seam (keys rotated inside the attention module, attention a plain function); there is no
    cross-attention for crossattn_ratio."""
    model = _model("qwen")
    args, conds = _inputs("qwen")
    reference = [torch.randn(2, 16, 1, 16, 16)]
    with pytest.raises(ValueError, match="reference latents .* Bypass the ToMe node"):
        comfy_host.run(tome(model), *args, ref_latents=reference, **conds)
    with pytest.raises(ValueError, match=r"ToDo node: .*Qwen-Image.*Use the ToMe node on this model \(Qwen-Image\)"):
        todo(model)
    with pytest.raises(ValueError, match="ToMe node: crossattn_ratio 0.5 would change nothing"):
        tome(model, crossattn=0.5)


def test_diffusers_class_of_the_same_name_keeps_its_own_root_and_block_entries():
    """diffusers' QwenImageTransformer2DModel shares its name with ComfyUI's class (and its block's) but takes a packed
    latent [B, N, C] sized by `img_shapes` and rotary rows (image, text): the ComfyUI entries are kept to ComfyUI's
    module, and diffusers' class is read by its own ("packed" layout, rows item 0 following the merged tokens)."""
    from diffusers import QwenImageTransformer2DModel

    from tomesd.families import block_kind
    from tomesd.families import root_kind

    net = QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=1, attention_head_dim=16,
                                      num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6)).eval()
    assert (root_kind(net).family, root_kind(net).layout) == ("Qwen-Image", "packed")
    kind = block_kind(net.transformer_blocks[0])
    assert (kind.module, kind.sublayers[0].rotary_item, kind.sublayers[0].rotary_axis) == ("diffusers.", 0, 0)
    tomesd.apply_patch(net, ratio=0.5)
    assert type(net._tome_patch.layout).__name__ == "Packed"
    tomesd.remove_patch(net)
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in net.modules())


# ---- families that do not fit ToMe's tables: refused, never a wrong output ----

def _text(gen, n=6):
    return torch.randn(2, n, 32, generator=gen)


# family -> (ComfyUI supported-model class, tiny unet config, inputs, why it does not fit).
UNFIT = {
    # Cosmos 1 (GeneralDIT) runs its blocks on tokens before the batch ([T, H, W, B, D], block_x_format "THWBD"),
    # which no layout reads (Cosmos Predict2, whose blocks take [B, T, H, W, D], merges).
    "cosmos1": ("CosmosT2V", dict(
        image_model="cosmos", max_img_h=32, max_img_w=32, max_frames=8, in_channels=16, out_channels=16,
        patch_spatial=2, patch_temporal=1, model_channels=32, num_blocks=1, num_heads=2, crossattn_emb_channels=32,
        pos_emb_cls="rope3d", concat_padding_mask=False, block_x_format="THWBD", extra_per_block_abs_pos_emb=True,
        extra_per_block_abs_pos_emb_type="learnable"),
        lambda g: ((torch.randn(2, 16, 3, 8, 8, generator=g), SIGMA, _text(g)), {})),
}


@pytest.mark.parametrize("name", sorted(UNFIT))
def test_a_family_outside_the_tables_is_refused_before_any_wrong_output(name):
    config_class, config, inputs = UNFIT[name]
    model = comfy_host.model_patcher(config_class, config)
    args, conds = inputs(torch.Generator().manual_seed(1))
    base = comfy_host.run(model, *args, **conds)
    with pytest.raises(ValueError, match="does not know|found no transformer block ToMe knows"):
        comfy_host.run(tome(model), *args, **conds)  # at the node
    # The ToDo node likewise: never sent to the ToMe node as if the model were a UNet ToMe could merge
    with pytest.raises(ValueError, match="does not know|found no transformer block ToMe knows"):
        comfy_host.run(todo(model), *args, **conds)
    assert torch.equal(comfy_host.run(model, *args, **conds), base)
