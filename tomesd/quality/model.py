"""The yardstick's models: class-conditional denoisers shaped like the models people run, and the classifier
whose features score their samples. All are small enough to train on a laptop CPU and ship in the repo.

- `sd1`: a UNet with SD's transformer blocks (epsilon prediction, DDIM), top attention grid 32x32;
- `sdxl`: a UNet with SDXL's structure (no attention at the top level, transformers of 2 blocks at the middle one
  and of 4 at the coarse one and in the mid block, as SDXL's 2 and 10), so most blocks sit at the coarse level;
- `sd3`: an SD3 transformer (joint attention over image tokens and the label's text tokens, pooled label
  vector, rectified flow sampled with Euler steps as SD3 is), patch size 1, so its grid is 32x32 too;
- `video`: AnimateDiff's `UNetMotionModel`, the `sd1` UNet with a motion adapter (temporal attention over
  the frames at every level), fine-tuned from the `sd1` weights on digits sliding across the canvas over
  8 frames, as AnimateDiff trains a motion adapter on an image model. Its spatial blocks see one frame;
- `wan`: Wan's `WanTransformer3DModel` on the same clips, rectified flow as Wan trains: every frame's 2x2
  patches in one sequence (8 x 16 x 16 = 2048 tokens), so ToMe merges on a space-time grid and `st=2` lets a
  token merge into a neighbouring frame's."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

_WEIGHTS_DIR = os.path.join(os.path.dirname(__file__), "weights")
WEIGHTS = os.path.join(_WEIGHTS_DIR, "yardstick.safetensors")


@dataclass(frozen=True)
class Arch:
    """What differs between the yardstick models, as data (the code paths read these fields)."""
    weights: str           # the shipped file
    prefix: str            # the denoiser's key prefix in that file
    objective: str         # "epsilon" (DDPM training, DDIM sampling) or "flow" (rectified flow, Euler sampling)
    host: str              # the denoiser's class name (which step caches it takes)
    frames: Optional[int]  # None: images [N, 1, 32, 32]; else videos [N, 1, frames, 32, 32]
    steps: int             # default training steps, batch and learning rate (python -m tomesd.quality.train)
    batch: int
    lr: float = 1e-3
    init_from: Optional[str] = None  # the arch whose shipped weights training starts from (None: from scratch)


FRAMES = 8  # the video yardstick's clip length
ARCH_SPECS: Dict[str, Arch] = {
    "sd1": Arch(WEIGHTS, "unet.", "epsilon", "UNet2DConditionModel", None, 1000, 64),
    "sdxl": Arch(os.path.join(_WEIGHTS_DIR, "yardstick-sdxl.safetensors"), "unet.", "epsilon", "UNet2DConditionModel",
                 None, 1200, 32),
    "sd3": Arch(os.path.join(_WEIGHTS_DIR, "yardstick-sd3.safetensors"), "transformer.", "flow",
                "SD3Transformer2DModel", None, 1500, 32),
    "video": Arch(os.path.join(_WEIGHTS_DIR, "yardstick-video.safetensors"), "unet.", "epsilon", "UNetMotionModel",
                  FRAMES, 700, 8, lr=5e-4, init_from="sd1"),
    "wan": Arch(os.path.join(_WEIGHTS_DIR, "yardstick-wan.safetensors"), "transformer.", "flow",
                "WanTransformer3DModel", FRAMES, 2000, 8),
}
ARCHS = tuple(ARCH_SPECS)
WEIGHTS_BY_ARCH = {name: spec.weights for name, spec in ARCH_SPECS.items()}
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


# SDXL's layout, narrowed: its levels 128², 64², 32² at 1024² are 32², 16², 8² here. Like SDXL: no attention at
# the top level, layers_per_block 2, linear projections, 2 transformer blocks at the middle level; 4 at the
# coarse level and in the mid block stand for SDXL's 10, so that 24 of the 34 blocks are coarse (SDXL: 60 of 70).
# SDXL's pooled-text and size conditioning ("text_time") is left out: the label's tokens condition by
# cross-attention, as on `sd1`. About 1.2 s per training step of 32 on the project's 2-core CPU.
SDXL_CONFIG: Dict = dict(
    sample_size=IMAGE,
    in_channels=1,
    out_channels=1,
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    block_out_channels=(16, 48, 64),
    layers_per_block=2,
    transformer_layers_per_block=(1, 2, 4),
    cross_attention_dim=CONTEXT_DIM,
    attention_head_dim=(1, 1, 2),
    use_linear_projection=True,
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


# AnimateDiff's layout on the `sd1` UNet: one temporal transformer after each spatial layer and in the mid
# block, one head, positions for the clip's frames (diffusers initialises them at random; training starts
# there, from the trained image UNet's spatial weights).
MOTION_CONFIG: Dict = dict(block_out_channels=UNET_CONFIG["block_out_channels"], motion_layers_per_block=1,
                           motion_num_attention_heads=1, motion_norm_num_groups=8, motion_max_seq_length=FRAMES)


# Wan's layout at the SD3 yardstick's width: one head of 48 (Wan's rotary splits it 16 / 16 / 16 over frames,
# rows and columns), four blocks, the label's tokens as the text.
WAN_CONFIG: Dict = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=1,
    attention_head_dim=48,
    in_channels=1,
    out_channels=1,
    text_dim=CONTEXT_DIM,
    freq_dim=64,
    ffn_dim=192,
    num_layers=4,
    rope_max_seq_len=64,
)


def spec(arch: str) -> Arch:
    if arch not in ARCH_SPECS:
        raise ValueError(f"arch must be one of {', '.join(ARCHS)}, got {arch!r}")
    return ARCH_SPECS[arch]


def build(arch: str = "sd1") -> Tuple["object", "object", "object"]:
    """(denoiser, label_embedding, classifier), randomly initialised (`load` fills in the shipped weights)."""
    import torch

    spec(arch)
    nn = torch.nn
    if arch == "sd1":
        from diffusers import UNet2DConditionModel

        denoiser = UNet2DConditionModel(**UNET_CONFIG)
    elif arch == "sdxl":
        from diffusers import UNet2DConditionModel

        denoiser = UNet2DConditionModel(**SDXL_CONFIG)
    elif arch == "video":
        from diffusers import MotionAdapter, UNet2DConditionModel, UNetMotionModel

        denoiser = UNetMotionModel.from_unet2d(UNet2DConditionModel(**UNET_CONFIG), MotionAdapter(**MOTION_CONFIG))
    elif arch == "wan":
        from diffusers import WanTransformer3DModel

        denoiser = WanTransformer3DModel(**WAN_CONFIG)
    else:
        from diffusers import SD3Transformer2DModel

        denoiser = SD3Transformer2DModel(**SD3_CONFIG)
    labels = nn.Embedding(NUM_CLASSES + 1, CONTEXT_TOKENS * CONTEXT_DIM)
    classifier = Classifier()
    return denoiser, labels, classifier


def predict(arch: str, denoiser, x, t, context):
    """The denoiser's output for images (videos) `x` at timestep `t` (a scalar tensor or one per sample) under
    the label tokens `context`: epsilon for `sd1`, `sdxl` and `video`, the flow velocity for `sd3` and `wan`. SD3's
    pooled text vector is the mean of the label's tokens; the motion UNet takes the label once per frame, as
    AnimateDiff's pipeline repeats the prompt; Wan takes it once per clip."""
    if arch in ("sd1", "sdxl"):
        return denoiser(x, t, context).sample
    if arch == "video":
        return denoiser(x, t, context.repeat_interleave(x.shape[2], dim=0)).sample
    t = t.expand(x.shape[0]) if t.dim() == 0 else t
    if arch == "wan":
        return denoiser(hidden_states=x, timestep=t, encoder_hidden_states=context).sample
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


def state_dicts(unet, labels, classifier, arch: str = "sd1") -> Dict[str, "object"]:
    out = {}
    for prefix, module in ((spec(arch).prefix, unet), ("labels.", labels), ("classifier.", classifier)):
        out.update({prefix + k: v.detach().contiguous() for k, v in module.state_dict().items()})
    return out


def load(path: Optional[str] = None, arch: str = "sd1"):
    """The shipped, trained models for `arch`, in eval mode."""
    from safetensors.torch import load_file

    spec(arch)
    path = path or WEIGHTS_BY_ARCH[arch]
    if not os.path.exists(path):
        flag = "" if arch == "sd1" else f" --arch {arch}"
        raise FileNotFoundError(
            f"yardstick weights not found at {path}; reproduce them with `python -m tomesd.quality.train{flag}`")
    tensors = load_file(path)
    unet, labels, classifier = build(arch)
    for prefix, module in ((spec(arch).prefix, unet), ("labels.", labels), ("classifier.", classifier)):
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


def moving_digits(x, y, count: int, generator, frames: int = FRAMES, size: int = 24, max_speed: int = 1):
    """`count` clips of digits sliding across a blank 32x32 canvas: [count, 1, frames, 32, 32] in [-1, 1] and
    their labels. Each clip takes a digit from `x` [N, 1, 32, 32] (labels `y`), shrinks it to `size` pixels,
    and moves it in a straight line from a random start at a random whole-pixel speed (up to `max_speed`
    per frame along each axis), bouncing off the edges: motion the model has to keep consistent."""
    import torch

    idx = torch.randint(0, len(x), (count,), generator=generator)
    small = torch.nn.functional.interpolate(x[idx], size=(size, size), mode="bilinear", align_corners=False)
    room = IMAGE - size
    start = torch.randint(0, room + 1, (count, 2), generator=generator)
    speed = torch.randint(-max_speed, max_speed + 1, (count, 2), generator=generator)
    clips = torch.full((count, 1, frames, IMAGE, IMAGE), -1.0)
    for f in range(frames):
        pos = (start + f * speed) % (2 * room)
        pos = torch.where(pos > room, 2 * room - pos, pos)  # bounce
        for i in range(count):
            r, c = int(pos[i, 0]), int(pos[i, 1])
            clips[i, 0, f, r:r + size, c:c + size] = small[i, 0]
    return clips, y[idx]
