"""The yardstick's models: a class-conditional UNet with SD's transformer blocks, and the classifier
whose features score its samples. Both are small enough to train on a laptop CPU and ship in the repo."""
from __future__ import annotations

import os
from typing import Dict, Tuple

WEIGHTS = os.path.join(os.path.dirname(__file__), "weights", "yardstick.safetensors")
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


def build() -> Tuple["object", "object", "object"]:
    """(unet, label_embedding, classifier), randomly initialised (`load` fills in the shipped weights)."""
    import torch
    from diffusers import UNet2DConditionModel

    nn = torch.nn
    unet = UNet2DConditionModel(**UNET_CONFIG)
    labels = nn.Embedding(NUM_CLASSES + 1, CONTEXT_TOKENS * CONTEXT_DIM)
    classifier = Classifier()
    return unet, labels, classifier


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


def state_dicts(unet, labels, classifier) -> Dict[str, "object"]:
    out = {}
    for prefix, module in (("unet.", unet), ("labels.", labels), ("classifier.", classifier)):
        out.update({prefix + k: v.detach().contiguous() for k, v in module.state_dict().items()})
    return out


def load(path: str = WEIGHTS):
    """The shipped, trained models, in eval mode."""
    import torch
    from safetensors.torch import load_file

    if not os.path.exists(path):
        raise FileNotFoundError(
            f"yardstick weights not found at {path}; reproduce them with `python -m tomesd.quality.train`")
    tensors = load_file(path)
    unet, labels, classifier = build()
    for prefix, module in (("unet.", unet), ("labels.", labels), ("classifier.", classifier)):
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
