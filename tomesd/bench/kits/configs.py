"""UNet architectures the benchmark builds from their configs, with random weights."""

# Stable Diffusion 1.5's UNet (diffusers' / ppdiffusers' UNet2DConditionModel arguments).
SD15 = dict(
    sample_size=64, in_channels=4, out_channels=4, layers_per_block=2,
    block_out_channels=(320, 640, 1280, 1280),
    down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
    cross_attention_dim=768, attention_head_dim=8, norm_num_groups=32,
)

# SDXL's UNet (base 1.0): no attention at full resolution, 2 and 10 transformer blocks per attention
# at levels 2 and 4, text-and-time added conditions.
SDXL = dict(
    sample_size=128, in_channels=4, out_channels=4, layers_per_block=2, block_out_channels=(320, 640, 1280),
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    transformer_layers_per_block=(1, 2, 10), attention_head_dim=(5, 10, 20), cross_attention_dim=2048,
    use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=256,
    projection_class_embeddings_input_dim=2816, norm_num_groups=32,
)

# SD-shaped and small enough for tests of the command's plumbing.
TINY = dict(
    sample_size=16, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    cross_attention_dim=32, attention_head_dim=8, norm_num_groups=8,
)

CONFIGS = {"sd15": SD15, "tiny": TINY}
TEXT_TOKENS = 77


# Diffusion transformers at their real widths (diffusers class, config, latent channels, text width,
# pooled width), built with random weights. `depth_key` names the config entry that --depth cuts.
SD3_MEDIUM = dict(
    sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64, num_attention_heads=24,
    joint_attention_dim=4096, caption_projection_dim=1536, pooled_projection_dim=2048, out_channels=16,
    pos_embed_max_size=192,
)
PIXART_ALPHA = dict(  # PixArt-alpha 1024 (its resolution / aspect-ratio conditions included)
    num_attention_heads=16, attention_head_dim=72, in_channels=4, out_channels=8, num_layers=28,
    cross_attention_dim=1152, sample_size=128, patch_size=2, caption_channels=4096, use_additional_conditions=True,
)
TINY_SD3 = dict(
    sample_size=16, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=2,
    joint_attention_dim=16, caption_projection_dim=16, pooled_projection_dim=8, out_channels=4, pos_embed_max_size=32,
)


FLUX_DEV = dict(  # Flux.1-dev (schnell: no guidance embedding)
    patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128, num_attention_heads=24,
    joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56),
)
TINY_FLUX = dict(patch_size=1, in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=16,
                 num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=True,
                 axes_dims_rope=(4, 6, 6))


# Flux.2-dev (diffusers' Flux2Transformer2DModel defaults): 8 double-stream and 48 single-stream blocks of 48
# heads x 128; a packed latent of 4 x 32 channels; Mistral 3's hidden states (3 layers of 5120) as the text.
FLUX2_DEV = dict(patch_size=1, in_channels=128, num_layers=8, num_single_layers=48, attention_head_dim=128,
                 num_attention_heads=48, joint_attention_dim=15360, mlp_ratio=3.0, axes_dims_rope=(32, 32, 32, 32),
                 guidance_embeds=True)
# Flux.2 [klein] 4B (distilled: no guidance input): 5 double-stream and 20 single-stream blocks of 24 heads x 128,
# Qwen3-4B's hidden states (3 layers of 2560) as the text. Read from its published description (no hub here).
FLUX2_KLEIN_4B = dict(FLUX2_DEV, num_layers=5, num_single_layers=20, num_attention_heads=24, joint_attention_dim=7680,
                      guidance_embeds=False)
TINY_FLUX2 = dict(patch_size=1, in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=16,
                  num_attention_heads=2, joint_attention_dim=32, timestep_guidance_channels=16,
                  axes_dims_rope=(4, 4, 4, 4))
# Qwen-Image (diffusers' QwenImageTransformer2DModel defaults, the 20B model): 60 dual-stream blocks of 24 heads x
# 128; a packed latent of 4 x 16 channels; Qwen2.5-VL's hidden states (3584) as the text, unpadded (the pipeline
# drops its template's tokens and passes no mask when no prompt is padded).
QWEN_IMAGE = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
                  num_attention_heads=24, joint_attention_dim=3584, axes_dims_rope=(16, 56, 56))
TINY_QWEN_IMAGE = dict(patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
                       num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6))
QWEN_TEXT_TOKENS = 128  # a prompt of some 100 words after the template: Qwen-Image's text is not padded to a length
# Z-Image Turbo (diffusers' ZImageTransformer2DModel defaults, the 6B model): 30 main layers of 30 heads x 128
# (dim 3840) over one unified sequence [image, caption], after 2 noise-refiner layers on the image alone and 2
# context-refiner layers on the caption alone (--depth D: D main layers, at most D refiner layers a side); Qwen3-4B's hidden states (2560)
# as the caption, each prompt's valid tokens only (ZImagePipeline drops the padding); Flux's VAE (16 channels, 8x).
Z_IMAGE_TURBO = dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=3840, n_layers=30,
                     n_refiner_layers=2, n_heads=30, n_kv_heads=30, cap_feat_dim=2560)
TINY_Z_IMAGE = dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=32, n_layers=2, n_refiner_layers=1,
                    n_heads=2, n_kv_heads=2, cap_feat_dim=16, axes_dims=[8, 4, 4], axes_lens=[256, 32, 32])
Z_IMAGE_TEXT_TOKENS = 128  # a prompt after Qwen3's chat template, unpadded (the pipeline keeps its valid tokens)
# HunyuanVideo 1.5 480p text-to-video (diffusers' scripts/convert_hunyuan_video1_5_to_diffusers.py "480p_t2v": the
# class's defaults, target_size 640): 54 dual-stream blocks of 16 heads x 128 on a [B, 65, F, H, W] latent (32 noise
# channels, 32 of the condition's latent and a mask, both zero for text-to-video) patchified 1x1x1; its VAE packs
# 16x16 pixels and 4 frames (after the first) into a latent cell. The text as HunyuanVideo15Pipeline passes it:
# Qwen2.5-VL's 3584-wide states padded to 1000 tokens, ByT5's 1472-wide padded to 256, SigLIP's 729 image tokens
# (zero for text-to-video), with masks; the model joins them valid-first, and every block attends over all 1985.
HUNYUAN_VIDEO15_480P = dict(in_channels=65, out_channels=32, num_attention_heads=16, attention_head_dim=128,
                            num_layers=54, num_refiner_layers=2, mlp_ratio=4.0, patch_size=1, patch_size_t=1,
                            text_embed_dim=3584, text_embed_2_dim=1472, image_embed_dim=1152, target_size=640,
                            task_type="i2v")
TINY_HUNYUAN_VIDEO15 = dict(in_channels=9, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=2,
                            num_refiner_layers=1, mlp_ratio=2.0, patch_size=1, patch_size_t=1, text_embed_dim=16,
                            text_embed_2_dim=8, image_embed_dim=12, rope_axes_dim=(2, 2, 4), target_size=16,
                            task_type="t2v")
# (tokens, valid tokens) per text stream as the 480p pipeline pads them: Qwen2.5-VL's prompt, ByT5's glyph text
# (none: all padding), SigLIP's image tokens (text-to-video: masked out); the tiny arch's are small.
HUNYUAN_VIDEO15_TEXT = {"hunyuanvideo-1.5": ((1000, 128), (256, 0), (729, 0)),
                        "tiny-hunyuanvideo-1.5": ((12, 6), (4, 0), (3, 0))}
# AnimateDiff's SD1.5 motion adapter (v1.5-2): two motion modules per block and a motion mid block.
SD15_MOTION_ADAPTER = dict(
    block_out_channels=(320, 640, 1280, 1280), motion_layers_per_block=2, motion_num_attention_heads=8,
    motion_norm_num_groups=32, motion_max_seq_length=32, use_motion_mid_block=True,
)
TINY_MOTION_ADAPTER = dict(block_out_channels=(32, 64), motion_layers_per_block=1, motion_num_attention_heads=2,
                           motion_norm_num_groups=8, motion_max_seq_length=32)


# Stable Video Diffusion img2vid-xt's UNet: spatial blocks per frame (frames ride in the batch), each followed
# by a temporal block over frames; the latent is [B, F, C, H, W], 4 noise channels + 4 of the image's.
SVD_XT = dict(
    sample_size=96, in_channels=8, out_channels=4, block_out_channels=(320, 640, 1280, 1280),
    down_block_types=("CrossAttnDownBlockSpatioTemporal",) * 3 + ("DownBlockSpatioTemporal",),
    up_block_types=("UpBlockSpatioTemporal",) + ("CrossAttnUpBlockSpatioTemporal",) * 3,
    addition_time_embed_dim=256, projection_class_embeddings_input_dim=768, layers_per_block=2,
    cross_attention_dim=1024, transformer_layers_per_block=1, num_attention_heads=(5, 10, 20, 20), num_frames=25,
)
TINY_SVD = dict(sample_size=16, in_channels=8, out_channels=4, block_out_channels=(32, 64),
                down_block_types=("CrossAttnDownBlockSpatioTemporal", "DownBlockSpatioTemporal"),
                up_block_types=("UpBlockSpatioTemporal", "CrossAttnUpBlockSpatioTemporal"), cross_attention_dim=32,
                num_attention_heads=(2, 4), layers_per_block=1, addition_time_embed_dim=8,
                projection_class_embeddings_input_dim=24)

# Wan 2.1 text-to-video 1.3B (480p): every frame's 2x2 patches in one sequence; its VAE packs 4 frames
# (after the first) into one latent frame, so 17 frames are 5 latent frames.
WAN_13B = dict(
    patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
    text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
    qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024,
)
TINY_WAN = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
                text_dim=32, freq_dim=16, ffn_dim=64, num_layers=2, rope_max_seq_len=64)
WAN_TEXT_TOKENS = 512  # umT5's padded sequence, as Wan's pipeline passes it


class Arch:
    """One benchmarked architecture: how to build it and call it."""

    def __init__(self, name: str, cls: str, config: dict, latent_channels: int, text_dim: int,
                 pooled_dim: int = 0, depth_key: str = "", extra: str = "", motion: "dict | None" = None,
                 frames: int = 0, singles_per_double: int = 0, no_downsample: str = "", host_reads: str = "",
                 vae_factor: int = 8, refiners_key: str = ""):
        self.name, self.cls, self.config = name, cls, config
        self.latent_channels, self.text_dim, self.pooled_dim = latent_channels, text_dim, pooled_dim
        self.depth_key, self.extra = depth_key, extra
        self.motion = motion  # video: the motion adapter added to the image UNet (AnimateDiff)
        self.frames = frames or (16 if motion is not None else 0)  # video: the default frames per clip
        # Flux-style: --depth D keeps D double-stream blocks and this many single-stream blocks per double one
        self.singles_per_double = singles_per_double
        # Why the family refuses mode="downsample" ("": it runs): the bench leaves its row out by default and
        # refuses --modes downsample with this reason.
        self.no_downsample = no_downsample
        # Why the host's forward cannot run on the meta device ("": it can): its FLOPs are then counted on the
        # bench's device, one real forward per counted row (flops.py).
        self.host_reads = host_reads
        self.vae_factor = vae_factor  # pixels per latent cell along a side
        # Z-Image: --depth D also keeps at most D of the refiner layers on each side (config entry `refiners_key`),
        # so a cut model weighs its refiners nearer their share of the full one (2 of 32 image blocks)
        self.refiners_key = refiners_key

    @property
    def video(self) -> bool:
        return self.frames > 0

    @property
    def transformer(self) -> bool:
        return bool(self.depth_key)

    @property
    def full_depth(self) -> int:
        return self.config[self.depth_key] if self.depth_key else 0

    def build_config(self, depth: "int | None") -> dict:
        config = dict(self.config)
        if depth is not None:
            config[self.depth_key] = depth
            if self.singles_per_double:  # single-stream blocks cut alike
                config["num_single_layers"] = self.singles_per_double * depth
            if self.refiners_key:
                config[self.refiners_key] = min(depth, config[self.refiners_key])
        return config


# Why these families refuse mode="downsample" (docs/limits.md): no seam hands their attention the image's keys alone.
_UNIFIED_DOWNSAMPLE = ("Z-Image attends over one unified sequence under a key-padding mask over every token: "
                       "tomesd refuses mode='downsample' there")
_HV15_DOWNSAMPLE = ("HunyuanVideo 1.5's processor pads its text mask to the joined [image, text] length itself, so "
                    "its keys cannot be fewer than its queries: tomesd refuses mode='downsample' there")
_HV15_HOST_READS = "its forward branches on torch.all(image_embeds == 0) and reorders the text by boolean masks"


ARCHS = {
    "sd15": Arch("SD1.5 UNet", "UNet2DConditionModel", SD15, 4, 768),
    "sdxl": Arch("SDXL UNet", "UNet2DConditionModel", SDXL, 4, 2048, 1280, extra="sdxl"),
    "tiny": Arch("tiny UNet", "UNet2DConditionModel", TINY, 4, 32),
    "animatediff": Arch("AnimateDiff (SD1.5 UNet, motion adapter v1.5-2)", "UNetMotionModel", SD15, 4, 768,
                        motion=SD15_MOTION_ADAPTER),
    "tiny-animatediff": Arch("tiny AnimateDiff UNet", "UNetMotionModel", TINY, 4, 32, motion=TINY_MOTION_ADAPTER),
    "sd3": Arch("SD3-medium transformer", "SD3Transformer2DModel", SD3_MEDIUM, 16, 4096, 2048, "num_layers"),
    "pixart": Arch("PixArt-alpha transformer", "PixArtTransformer2DModel", PIXART_ALPHA, 4, 4096, 0, "num_layers",
                   extra="pixart"),
    "tiny-sd3": Arch("tiny SD3 transformer", "SD3Transformer2DModel", TINY_SD3, 4, 16, 8, "num_layers"),
    # --depth D: D double-stream and 2D single-stream blocks (full: 19 and 38)
    "flux": Arch("Flux.1-dev transformer", "FluxTransformer2DModel", FLUX_DEV, 16, 4096, 768, "num_layers", extra="flux",
                 singles_per_double=2),
    "tiny-flux": Arch("tiny Flux transformer", "FluxTransformer2DModel", TINY_FLUX, 4, 32, 32, "num_layers",
                      extra="flux", singles_per_double=2),
    # --depth D: D double-stream and 6D single-stream blocks (full: 8 and 48)
    "flux2": Arch("Flux.2-dev transformer", "Flux2Transformer2DModel", FLUX2_DEV, 32, 15360, 0, "num_layers",
                  extra="flux2", singles_per_double=6),
    "flux2-klein": Arch("Flux.2 [klein] 4B transformer", "Flux2Transformer2DModel", FLUX2_KLEIN_4B, 32, 7680, 0,
                        "num_layers", extra="flux2", singles_per_double=4),
    "tiny-flux2": Arch("tiny Flux.2 transformer", "Flux2Transformer2DModel", TINY_FLUX2, 4, 32, 0, "num_layers",
                       extra="flux2", singles_per_double=2),
    "qwen-image": Arch("Qwen-Image transformer", "QwenImageTransformer2DModel", QWEN_IMAGE, 16, 3584, 0, "num_layers",
                       extra="qwen-image"),
    "tiny-qwen-image": Arch("tiny Qwen-Image transformer", "QwenImageTransformer2DModel", TINY_QWEN_IMAGE, 4, 32, 0,
                            "num_layers", extra="qwen-image"),
    # --depth D: D of the 30 main layers and min(D, 2) of the noise- and of the context-refiner layers
    "z-image": Arch("Z-Image Turbo transformer", "ZImageTransformer2DModel", Z_IMAGE_TURBO, 16, 2560, 0, "n_layers",
                    extra="z-image", no_downsample=_UNIFIED_DOWNSAMPLE, refiners_key="n_refiner_layers"),
    "tiny-z-image": Arch("tiny Z-Image transformer", "ZImageTransformer2DModel", TINY_Z_IMAGE, 4, 16, 0, "n_layers",
                         extra="z-image", no_downsample=_UNIFIED_DOWNSAMPLE, refiners_key="n_refiner_layers"),
    "svd": Arch("SVD img2vid-xt UNet", "UNetSpatioTemporalConditionModel", SVD_XT, 4, 1024, extra="svd", frames=14),
    "tiny-svd": Arch("tiny SVD UNet", "UNetSpatioTemporalConditionModel", TINY_SVD, 4, 32, extra="svd", frames=3),
    "wan": Arch("Wan 2.1 T2V 1.3B transformer", "WanTransformer3DModel", WAN_13B, 16, 4096, 0, "num_layers",
                extra="wan", frames=17),
    "tiny-wan": Arch("tiny Wan transformer", "WanTransformer3DModel", TINY_WAN, 4, 32, 0, "num_layers", extra="wan",
                     frames=5),
    # --depth D: D of the 54 dual-stream blocks; the text refiner's 2 stay. Frames: 5 = 2 latent frames by default
    "hunyuanvideo-1.5": Arch("HunyuanVideo 1.5 480p T2V transformer", "HunyuanVideo15Transformer3DModel",
                            HUNYUAN_VIDEO15_480P, 32, 3584, 0, "num_layers", extra="hunyuanvideo-1.5", frames=5,
                            no_downsample=_HV15_DOWNSAMPLE, host_reads=_HV15_HOST_READS, vae_factor=16),
    "tiny-hunyuanvideo-1.5": Arch("tiny HunyuanVideo 1.5 transformer", "HunyuanVideo15Transformer3DModel",
                                 TINY_HUNYUAN_VIDEO15, 4, 16, 0, "num_layers", extra="hunyuanvideo-1.5", frames=5,
                                 no_downsample=_HV15_DOWNSAMPLE, host_reads=_HV15_HOST_READS, vae_factor=16),
}
FLUX_TEXT_TOKENS = 512  # Flux-dev's T5 sequence
