"""diffusers 0.42's later families beyond the contract (tests/families.py holds JoyImage Edit, Krea 2, Flux.3,
NucleusMoE-Image, Helios and AnyFlow to it): reference and history tokens pass whole, text masks and the modes that
cannot run are refused by name, and the families ToMe does not merge yet are refused at apply time by name."""
import pytest
import torch

import tomesd
import tiny_diffusers_0_42_families as D


def _needs(name):
    import diffusers

    if not hasattr(diffusers, name):
        pytest.skip(f"diffusers {diffusers.__version__} has no {name}")


def _attention_inputs(model, inputs):
    """What block 0's attention projects as its image stream (its q/k/v projection's input, inside ToMe's merge)."""
    seen = []
    handle = model.double_blocks[0].attn.img_attn_qkv.register_forward_pre_hook(
        lambda module, args: seen.append(args[0].clone()))
    try:
        D.run(model, inputs)
    finally:
        handle.remove()
    return seen[0]


def test_joyimage_edit_merges_the_target_and_passes_the_reference_image_whole():
    """JoyImageEditPipeline puts the reference image first and the target last; the model moves the target's tokens
    first: they merge, and the reference's (after them) reach the attention as they are, bit for bit."""
    _needs("JoyImageEditTransformer3DModel")
    model = D.joyimage()
    inputs = D.joyimage_inputs(model, items=2, h=8, w=8)  # 16 tokens per image
    plain = _attention_inputs(model, inputs)
    tomesd.apply_patch(model, ratio=0.5)
    try:
        merged = _attention_inputs(model, inputs)
        out = D.run(model, inputs)
    finally:
        tomesd.remove_patch(model)
    assert plain.shape[1] == 32 and merged.shape[1] == 8 + 16
    assert torch.equal(merged[:, -16:], plain[:, -16:])  # the reference image, whole
    assert (out - D.run(model, inputs)).abs().max() > 1e-2


def test_joyimage_text_to_image_latent_merges():
    _needs("JoyImageEditTransformer3DModel")
    model = D.joyimage()
    inputs = D.joyimage_inputs(model, items=0, h=8, w=8)
    tomesd.apply_patch(model, ratio=0.5)
    try:
        with tomesd.observe(model) as seen:
            D.run(model, inputs)
    finally:
        tomesd.remove_patch(model)
    assert seen.calls[0].blocks[0].tokens("attn") == [(16, 8)]


def test_krea2_text_mask_is_sliced_to_the_merged_keys():
    """Krea2Pipeline passes a text padding mask, joined by the root over [text, image] with the image's all True:
    sliced to the merged image's keys (the first text + M entries), a prompt of 3 tokens padded with 3 masked ones
    gives, merged, what the 3 tokens alone give (their position ids: the text's all at the origin)."""
    _needs("Krea2Transformer2DModel")
    model = D.krea2().eval()
    padded = D.krea2_inputs(model, mask=True, text=6, valid=3)
    short = _padded_and_short(padded, 3, "encoder_attention_mask")
    short["position_ids"] = padded["position_ids"][3:]
    _padded_equals_unpadded_under_tome(model, padded, short, [0])


@pytest.mark.parametrize("option, cause", [(dict(mode="downsample", downsample_factor=2),
                                            "attention_mask.*mode='merge'"),
                                           (dict(ratio=0.5, proportional_attention=True),
                                            "attention mask.*proportional_attention=False")])
def test_what_krea2s_text_mask_rules_out_is_refused_by_name_at_the_masked_call(option, cause):
    """mode='downsample' shrinks image keys at the dispatch, where the mask over every key would no longer fit; the
    key weights of proportional attention cannot join a mask. Both run on unmasked calls (the family contract)."""
    _needs("Krea2Transformer2DModel")
    model = D.krea2()
    tomesd.apply_patch(model, **option)
    try:
        with pytest.raises(ValueError, match=cause):
            D.run(model, D.krea2_inputs(model, mask=True))
    finally:
        tomesd.remove_patch(model)


def _padded_and_short(inputs, valid, mask):
    """The inputs as given (prompts padded after `valid` tokens, masked by `mask`) and the same prompts unpadded."""
    return dict(inputs, encoder_hidden_states=inputs["encoder_hidden_states"][:, :valid],
                **{mask: inputs[mask][:, :valid]})


def _padded_equals_unpadded_under_tome(model, padded, short, blocks):
    """Under ToMe, a prompt padded with masked tokens gives what the prompt alone gives, and ToMe changes that output
    by far more than the tolerance."""
    base = D.run(model, short)
    torch.testing.assert_close(D.run(model, padded), base, atol=1e-5, rtol=1e-5)  # the host's own masking
    tomesd.apply_patch(model, ratio=0.5)
    try:
        with tomesd.observe(model) as seen:
            merged_short = D.run(model, short)
        merged_padded = D.run(model, padded)
    finally:
        tomesd.remove_patch(model)
    assert seen.calls[0].merged_blocks("attn") == blocks
    assert (merged_short - base).abs().max().item() > 1e-2
    torch.testing.assert_close(merged_padded, merged_short, atol=1e-5, rtol=1e-5)


def test_nucleusmoe_image_text_mask_is_sliced_to_the_merged_keys():
    """NucleusMoEImagePipeline always passes a text mask, joined by the root as [image (all True), text] over the
    attention's keys: sliced to the merged image's keys, a prompt of 3 tokens padded with 3 masked ones gives, merged,
    what the 3 tokens alone give (a dense and a mixture-of-experts block)."""
    _needs("NucleusMoEImageTransformer2DModel")
    model = D.nucleus().eval()
    padded = D.nucleus_inputs(model, mask=True, text=6, valid=3)
    _padded_equals_unpadded_under_tome(model, padded, _padded_and_short(padded, 3, "encoder_hidden_states_mask"),
                                       [0, 1])


def test_nucleusmoe_image_downsample_and_masked_proportional_attention_are_refused_by_name():
    """mode='downsample' is refused at apply time; proportional attention, whose key weights cannot join the text
    mask, at the first masked call."""
    _needs("NucleusMoEImageTransformer2DModel")
    model = D.nucleus()
    with pytest.raises(ValueError, match="mode='downsample' cannot run on NucleusMoEImageTransformerBlock"):
        tomesd.apply_patch(model, mode="downsample", downsample_factor=2)
    assert not model._forward_pre_hooks
    tomesd.apply_patch(model, ratio=0.5, proportional_attention=True)
    try:
        with pytest.raises(ValueError, match="attention mask.*proportional_attention=False"):
            D.run(model, D.nucleus_inputs(model, mask=True))
    finally:
        tomesd.remove_patch(model)


def test_krea2_downsample_shrinks_the_image_keys_only():
    _needs("Krea2Transformer2DModel")
    model = D.krea2()
    inputs = D.krea2_inputs(model)
    base = D.run(model, inputs)
    tomesd.apply_patch(model, mode="downsample", downsample_factor=2)
    try:
        with tomesd.observe(model) as seen:
            out = D.run(model, inputs)
    finally:
        tomesd.remove_patch(model)
    assert seen.calls[0].blocks[0].sites["downsample"] == [(64, 16)]
    assert (out - base).abs().max() > 1e-2


def test_flux3_merges_the_image_blocks_and_leaves_its_text_and_reference_mode_blocks_alone():
    """Flux.3's text and reference image run through blocks of its image's class (txt_mode_blocks,
    mode_blocks["image_cond"]): they hold no image token and ToMe leaves them alone; the text reaches the single
    block's attention whole."""
    _needs("Flux3Transformer2DModel")
    model = D.flux3()
    inputs = D.flux3_inputs(model)
    tomesd.apply_patch(model, ratio=0.5)
    try:
        with tomesd.observe(model) as seen:
            D.run(model, inputs)
    finally:
        tomesd.remove_patch(model)
    blocks = seen.calls[0].blocks
    assert [blocks[i].kind for i in sorted(blocks)] == ["Flux3ModeTransformerBlock", "Flux3SingleTransformerBlock"]
    assert blocks[0].tokens("attn") == [(64, 32)] and blocks[1].tokens("attn") == [(D.TEXT + 64, D.TEXT + 32)]


def test_flux3_reference_image_passes_whole_and_downsample_refuses_it_by_name():
    """An image-to-image call's reference tokens follow the target's in the single blocks only: there they reach the
    attention as they are, bit for bit, while the target's merge (the per-mode block takes the image alone)."""
    _needs("Flux3Transformer2DModel")
    model = D.flux3()
    inputs = D.flux3_inputs(model, reference=True)
    seen = []
    handle = model.single_transformer_blocks[0].attn.to_q.register_forward_pre_hook(
        lambda module, args: seen.append(args[0].clone()))
    try:
        D.run(model, inputs)
        tomesd.apply_patch(model, ratio=0.5)
        try:
            with tomesd.observe(model) as observed:
                D.run(model, inputs)
        finally:
            tomesd.remove_patch(model)
    finally:
        handle.remove()
    plain, merged = seen
    blocks = observed.calls[0].blocks
    assert blocks[0].tokens("attn") == [(64, 32)] and blocks[1].tokens("attn") == [(D.TEXT + 128, D.TEXT + 96)]
    assert torch.equal(merged[:, -64:], plain[:, -64:]) and torch.equal(merged[:, :D.TEXT], plain[:, :D.TEXT])
    tomesd.apply_patch(model, mode="downsample", downsample_factor=2)
    try:
        with pytest.raises(ValueError, match="cannot leave a reference image's 64 tokens out.*mode='merge'"):
            D.run(model, inputs)
    finally:
        tomesd.remove_patch(model)


def test_helios_history_tokens_pass_whole_and_amplified_history_is_refused_by_name():
    """Helios joins its history latents' tokens before the target's: the target's merge, the history's reach the
    self-attention as they are, bit for bit. A model built with is_amplify_history=True finds the history's keys by
    the target's unmerged length: refused at apply time."""
    _needs("HeliosTransformer3DModel")
    model = D.helios()
    inputs = D.helios_inputs(model, frames=2, h=8, w=8)  # 16 target tokens a frame; 1 + 1 + 4 history frames, some
    seen = []                                            # patchified coarser
    handle = model.blocks[0].attn1.to_q.register_forward_pre_hook(lambda module, args: seen.append(args[0].clone()))
    try:
        D.run(model, inputs)
        tomesd.apply_patch(model, ratio=0.5)
        try:
            D.run(model, inputs)
        finally:
            tomesd.remove_patch(model)
    finally:
        handle.remove()
    plain, merged = seen
    history = plain.shape[1] - 32
    assert history > 0 and merged.shape[1] == history + 16
    assert torch.equal(merged[:, :history], plain[:, :history])
    amplified = D.helios(is_amplify_history=True)
    with pytest.raises(ValueError, match="is_amplify_history=True.*original_context_length"):
        tomesd.apply_patch(amplified, ratio=0.5)
    assert not amplified._forward_pre_hooks


REFUSED = ["JoyImageEditPlusTransformer3DModel", "BriaFibo2Transformer2DModel", "WanAnimate2Transformer3DModel",
           "Ideogram4Transformer2DModel",
           "DreamLiteTransformer2DModel", "DreamLiteUNetModel", "Kandinsky5Transformer3DModel",
           "Kandinsky6Transformer3DModel", "Kandinsky6SRTransformer3DModel",
           "AnyFlowFARTransformer3DModel", "ErnieImageTransformer2DModel",
           "AllegroTransformer3DModel", "MiniMaxH3Transformer3DModel", "SanaWMTransformer3DModel",
           "SanaWMLTX2RefinerTransformer3DModel"]


@pytest.mark.parametrize("name", REFUSED)
def test_layouts_not_merged_yet_are_refused_by_name_at_apply_time(name):
    """Each is refused before anything changes, naming its class, the cause and what to do (roots_diffusers_0_42.py); without
    its entry, apply_patch said only that it found no transformer block ToMe knows."""
    import diffusers

    cls = getattr(diffusers, name, None)
    if cls is None:
        pytest.skip(f"diffusers {diffusers.__version__} has no {name}")
    model = type("Unbuilt", (cls,), {"__init__": lambda self: torch.nn.Module.__init__(self)})()
    with pytest.raises(TypeError, match=f"cannot patch {name}: .*not merge yet.*without ToMe"):
        tomesd.apply_patch(model, ratio=0.5)
    assert not model._forward_pre_hooks
