"""A denoiser whose blocks ToMe knows but whose class is in no family of tomesd/families/ (Wan VACE, Wan-Animate,
Latte, aMUSEd before they get entries) is refused at its first call naming its own class and the family
table, not with a UNet's "needs a latent [B, C, H, W]" alone."""
import pytest
import torch

import tomesd


class LatteLike(torch.nn.Module):
    """Tokens in, tokens out, through diffusers' BasicTransformerBlock: a transformer ToMe has no entry for."""

    def __init__(self):
        super().__init__()
        from diffusers.models.attention import BasicTransformerBlock

        self.transformer_blocks = torch.nn.ModuleList([BasicTransformerBlock(32, 2, 16, cross_attention_dim=16)])

    def forward(self, hidden_states, timestep=None, encoder_hidden_states=None):
        for block in self.transformer_blocks:
            hidden_states = block(hidden_states, encoder_hidden_states=encoder_hidden_states)
        return hidden_states


def test_an_unknown_root_names_itself_and_the_family_table():
    model = LatteLike().eval()
    tomesd.apply_patch(model, ratio=0.5)
    try:
        with pytest.raises(ValueError, match=r"ToMe does not know LatteLike: .*tomesd/families/.*got \[2, 64, 32\]"):
            model(torch.randn(2, 64, 32), encoder_hidden_states=torch.randn(2, 3, 16))
    finally:
        tomesd.remove_patch(model)
    assert model(torch.randn(2, 64, 32), encoder_hidden_states=torch.randn(2, 3, 16)).shape == (2, 64, 32)


class FluxLike(torch.nn.Module):
    """Flux's double-stream block under a root class ToMe has no entry for (a 4-D latent in, as ComfyUI's
    Flux-derived roots take): read as a UNet, its tokens would merge by the UNet's level rule."""

    def __init__(self):
        super().__init__()
        from diffusers.models.transformers.transformer_flux import FluxTransformerBlock

        self.transformer_blocks = torch.nn.ModuleList([FluxTransformerBlock(32, 2, 16)])

    def forward(self, sample, timestep=None, encoder_hidden_states=None):
        return sample


def test_an_unknown_root_with_a_transformer_familys_blocks_is_refused_at_apply_time():
    model = FluxLike().eval()
    with pytest.raises(ValueError, match=r"ToMe does not know FluxLike: its blocks \(FluxTransformerBlock\).*tomesd/families/"):
        tomesd.apply_patch(model, ratio=0.5)
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())  # nothing was changed
