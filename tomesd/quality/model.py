"""The yardstick's models: class-conditional denoisers shaped like the models people run, and the classifier
whose features score their samples. All are small enough to train on a laptop CPU and ship in the repo.

- `sd1`: a UNet with SD's transformer blocks (epsilon prediction, DDIM), top attention grid 32x32;
- `sd3`: an SD3 transformer (joint attention over image tokens and the label's text tokens, pooled label
  vector, rectified flow sampled with Euler steps as SD3 is), patch size 1, so its grid is 32x32 too."""
from __future__ import annotations

import os
from typing import Dict, Optional, Tuple

_WEIGHTS_DIR = os.path.join(os.path.dirname(__file__), "weights")
WEIGHTS = os.path.join(_WEIGHTS_DIR, "yardstick.safetensors")
ARCHS = ("sd1", "sd3")
WEIGHTS_BY_ARCH = {"sd1": WEIGHTS, "sd3": os.path.join(_WEIGHTS_DIR, "yardstick-sd3.safetensors")}
IMAGE = 32          # pixels per side; the UNet works in pixel space, so its top attention grid is 32x32
NUM_CLASSES = 10
NULL_CLASS = NUM_CLASSES  # the unconditional "label" for classifier-free guidance
CONTEXT_TOKENS = 4
CONTEXT_DIM = 64

UNET_CONFIG: Dict = dict(
    sample_size=IMAGE,
    in_channels=1,
    out_channels=1,
    down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
    # Narrow at the top, one head: self-attention over 1024 tokens dominates training time on a CPU.
    block_out_channels=(16, 64, 64),
    layers_per_block=1,
    cross_attention_dim=CONTEXT_DIM,
    attention_head_dim=1,
    norm_num_groups=8,
)


# One head of 48 over 1024 image tokens and 4 text tokens, four joint blocks (the last `context_pre_only`, as
# in SD3): about 1 s per training step of 32 on the project's 2-core CPU.
SD3_CONFIG: Dict = dict(
    sample_size=IMAGE,
    patch_size=1,
    in_channels=1,
    out_channels=1,
    num_layers=4,
    attention_head_dim=48,
    num_attention_heads=1,
    joint_attention_dim=CONTEXT_DIM,
    caption_projection_dim=48,
    pooled_projection_dim=CONTEXT_DIM,
    pos_embed_max_size=IMAGE,
)


def _check_arch(arch: str) -> None:
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {', '.join(ARCHS)}, got {arch!r}")


def build(arch: str = "sd1") -> Tuple["object", "object", "object"]:
    """(denoiser, label_embedding, classifier), randomly initialised (`load` fills in the shipped weights)."""
    import torch

    _check_arch(arch)
    nn = torch.nn
    if arch == "sd1":
        from diffusers import UNet2DConditionModel

        denoiser = UNet2DConditionModel(**UNET_CONFIG)
    else:
        from diffusers import SD3Transformer2DModel

        denoiser = SD3Transformer2DModel(**SD3_CONFIG)
    labels = nn.Embedding(NUM_CLASSES + 1, CONTEXT_TOKENS * CONTEXT_DIM)
    classifier = Classifier()
    return denoiser, labels, classifier


def predict(arch: str, denoiser, x, t, context):
    """The denoiser's output for images `x` at timestep `t` (a scalar tensor or one per sample) under the
    label tokens `context`: epsilon for `sd1`, the flow velocity for `sd3`. SD3's pooled text vector is the
    mean of the label's tokens."""
    if arch == "sd1":
        return denoiser(x, t, context).sample
    t = t.expand(x.shape[0]) if t.dim() == 0 else t
    return denoiser(hidden_states=x, encoder_hidden_states=context, pooled_projections=context.mean(1),
                    timestep=t).sample


def Classifier():
    """A small CNN on 32x32 digits; its 64-d penultimate layer is the yardstick's feature space."""
    import torch

    nn = torch.nn

    class _Classifier(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.features = nn.Sequential(
                nn.Conv2d(1, 16, 3, padding=1), nn.SiLU(), nn.AvgPool2d(2),
                nn.Conv2d(16, 32, 3, padding=1), nn.SiLU(), nn.AvgPool2d(2),
                nn.Conv2d(32, 32, 3, padding=1), nn.SiLU(), nn.AvgPool2d(2),
                nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.SiLU(),
            )
            self.head = nn.Linear(64, NUM_CLASSES)

        def forward(self, x):
            return self.head(self.features(x))

    return _Classifier()


def context(labels_embedding, labels) -> "object":
    """encoder_hidden_states for a batch of labels: [B, CONTEXT_TOKENS, CONTEXT_DIM]."""
    return labels_embedding(labels).reshape(labels.shape[0], CONTEXT_TOKENS, CONTEXT_DIM)


_PREFIX = {"sd1": "unet.", "sd3": "transformer."}


def state_dicts(unet, labels, classifier, arch: str = "sd1") -> Dict[str, "object"]:
    out = {}
    for prefix, module in ((_PREFIX[arch], unet), ("labels.", labels), ("classifier.", classifier)):
        out.update({prefix + k: v.detach().contiguous() for k, v in module.state_dict().items()})
    return out


def load(path: Optional[str] = None, arch: str = "sd1"):
    """The shipped, trained models for `arch`, in eval mode."""
    from safetensors.torch import load_file

    _check_arch(arch)
    path = path or WEIGHTS_BY_ARCH[arch]
    if not os.path.exists(path):
        flag = "" if arch == "sd1" else f" --arch {arch}"
        raise FileNotFoundError(
            f"yardstick weights not found at {path}; reproduce them with `python -m tomesd.quality.train{flag}`")
    tensors = load_file(path)
    unet, labels, classifier = build(arch)
    for prefix, module in ((_PREFIX[arch], unet), ("labels.", labels), ("classifier.", classifier)):
        part = {k[len(prefix):]: v.float() for k, v in tensors.items() if k.startswith(prefix)}
        module.load_state_dict(part)
        module.eval()
        for p in module.parameters():
            p.requires_grad_(False)
    return unet, labels, classifier


def digits():
    """scikit-learn's 1797 handwritten digits (8x8, shipped inside the package), upscaled bilinearly to
    32x32 in [-1, 1]: (images [N, 1, 32, 32], labels [N])."""
    import torch
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32)[:, None] / 16.0
    x = torch.nn.functional.interpolate(x, size=(IMAGE, IMAGE), mode="bilinear", align_corners=False)
    return x * 2 - 1, torch.tensor(data.target, dtype=torch.long)
