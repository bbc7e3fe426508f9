"""UNet architectures the benchmark builds from their configs, with random weights."""

# Stable Diffusion 1.5's UNet (diffusers' / ppdiffusers' UNet2DConditionModel arguments).
SD15 = dict(
    sample_size=64, in_channels=4, out_channels=4, layers_per_block=2,
    block_out_channels=(320, 640, 1280, 1280),
    down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
    cross_attention_dim=768, attention_head_dim=8, norm_num_groups=32,
)

# SD-shaped and small enough for tests of the command's plumbing.
TINY = dict(
    sample_size=16, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    cross_attention_dim=32, attention_head_dim=8, norm_num_groups=8,
)

CONFIGS = {"sd15": SD15, "tiny": TINY}
TEXT_TOKENS = 77
