"""The model families the torch tests hold to one contract: how to build each tiny model, its inputs and
its forward, which inputs carry the batch, and whether one matching serves the whole batch. A family
added to the runtime's tables is added here with one entry, and the contract test covers it."""
from dataclasses import dataclass
from typing import Callable, Tuple

import torch

import tiny_diffusers_0_42_families as D
import tiny_hunyuan_families as H
import tiny_image_first_families as F
import tiny_image_families as I
import tiny_ltx2_family as L2
import tiny_packed_families as P
import tiny_torch as T
import tiny_transformers as X
import tiny_unified_families as U
import tiny_video_families as V


@dataclass(frozen=True)
class Family:
    name: str
    build: Callable[[], torch.nn.Module]
    inputs: Callable[..., dict]  # keyword inputs of one forward: inputs(model, batch=2, seed=1, **grid)
    run: Callable[[torch.nn.Module, dict], torch.Tensor]
    batched: Tuple[str, ...]  # the inputs whose first axis is the batch
    one_matching: bool  # one matching serves the batch (the token grid is shared: Flux ids, space-time grids)
    grids: Tuple[dict, dict]  # two token grids of different sizes (for concurrent calls at two resolutions)
    patch: dict = None  # apply_patch arguments under which the family merges (default ratio=0.5)
    root: str = ""  # the runtime's root kind (tomesd/families/) this family stands for
    host_class: str = ""  # the diffusers class it needs, where older diffusers (env b's 0.32) lacks it
    merged_blocks: Tuple[int, ...] = ()  # the blocks whose self-attention merges under `patch`, on the first grid
    host_reads: str = ""  # why the host's own forward cannot run on the meta device ("": it can)
    # A timestep per frame (AnyFlow's pipeline passes one): reuse_steps on the bare model is refused by name, and
    # the pipeline's clock (the option the refusal names) reuses.
    timestep_per_frame: bool = False


def _unet_inputs(model, batch=2, seed=1, h=16, w=16):
    sample, timestep, text = T.unet_inputs(batch=batch, h=h, w=w, seed=seed)
    return dict(sample=sample, timestep=timestep, encoder_hidden_states=text)


def _run_unet(model, inputs):
    with torch.no_grad():
        return model(**inputs).sample


def _chronoedit():
    """ChronoEdit: Wan's blocks and latent layout under another root class (diffusers)."""
    from diffusers import ChronoEditTransformer3DModel

    return T.randomize_(ChronoEditTransformer3DModel(**T.WAN), 0)


def _skyreels_v2():
    """SkyReels-V2: Wan's blocks and latent layout (diffusers), Wan's tiny config."""
    from diffusers import SkyReelsV2Transformer3DModel

    return T.randomize_(SkyReelsV2Transformer3DModel(**T.WAN), 0)


def _wan_vace():
    """Wan VACE: Wan's blocks, and VACE blocks over the control video's tokens (another sequence, never merged)."""
    from diffusers import WanVACETransformer3DModel

    return T.randomize_(WanVACETransformer3DModel(**T.WAN, vace_layers=[0, 1], vace_in_channels=8), 0)


def _wan_vace_inputs(model, batch=2, seed=1, **grid):
    inputs = T.wan_inputs(batch=batch, seed=seed, **grid)
    shape = list(inputs["hidden_states"].shape)
    shape[1] = 8
    inputs["control_hidden_states"] = torch.randn(shape, generator=torch.Generator().manual_seed(seed + 50))
    return inputs


def _video_unet_inputs(model, batch=2, seed=1, **grid):
    return T.video_inputs("unet3d", batch=batch, seed=seed, **grid)


# ControlNet-XS (UNetControlNetXSModel: a UNet and its control branch in one model), diffusers' test config.
CONTROLNET_XS = dict(sample_size=16, down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                     up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), block_out_channels=(4, 8), cross_attention_dim=8,
                     transformer_layers_per_block=1, num_attention_heads=2, norm_num_groups=4, upcast_attention=False,
                     ctrl_block_out_channels=[2, 4], ctrl_num_attention_heads=4, ctrl_max_norm_num_groups=2,
                     ctrl_conditioning_embedding_out_channels=(2, 2))


def _controlnet_xs():
    from diffusers import UNetControlNetXSModel

    torch.manual_seed(0)
    return UNetControlNetXSModel(**CONTROLNET_XS).eval()


def _controlnet_xs_inputs(model, batch=2, seed=1, h=16, w=16):
    g = torch.Generator().manual_seed(seed)
    return dict(sample=torch.randn(batch, 4, h, w, generator=g), timestep=torch.tensor([10]),
                encoder_hidden_states=torch.randn(batch, 4, 8, generator=g),
                controlnet_cond=torch.randn(batch, 3, 2 * h, 2 * w, generator=g))


def _transformer(kind):
    return dict(build=lambda: T.transformer(kind),
                inputs=lambda model, batch=2, seed=1, **grid: T.transformer_inputs(kind, batch=batch, seed=seed, **grid),
                run=T.run_transformer, grids=(dict(h=16, w=16), dict(h=12, w=20)))


FAMILIES = {
    "sd1-unet": Family("sd1-unet", T.unet, _unet_inputs, _run_unet, ("sample", "encoder_hidden_states"), False,
                       (dict(h=16, w=16), dict(h=12, w=20)), merged_blocks=(0, 4, 5), root="UNet"),
    "sd3": Family("sd3", **_transformer("sd3"), batched=("hidden_states", "timestep", "encoder_hidden_states",
                                                         "pooled_projections"), one_matching=False,
                  merged_blocks=(0, 1, 2), root="diffusion transformer"),
    "pixart": Family("pixart", **_transformer("pixart"), batched=("hidden_states", "timestep", "encoder_hidden_states"),
                     one_matching=False, merged_blocks=(0, 1, 2), root="diffusion transformer"),
    "flux": Family("flux", T.flux, lambda model, batch=2, seed=1, **grid: T.flux_inputs(batch=batch, seed=seed, **grid),
                   lambda model, inputs: T.run_transformer(model, inputs),
                   ("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep"), True,
                   (dict(h=8, w=8), dict(h=6, w=10)), merged_blocks=(0, 1, 2, 3), root="Flux"),
    "wan": Family("wan", T.wan, lambda model, batch=2, seed=1, **grid: T.wan_inputs(batch=batch, seed=seed, **grid),
                  T.run_wan, ("hidden_states", "timestep", "encoder_hidden_states"), True,
                  (dict(frames=3, h=8, w=8), dict(frames=2, h=6, w=10)), dict(ratio=0.5, st=2), merged_blocks=(0, 1),
                  root="Wan",
                  host_class="WanTransformer3DModel"),
    "chronoedit": Family("chronoedit", _chronoedit,
                         lambda model, batch=2, seed=1, **grid: T.wan_inputs(batch=batch, seed=seed, **grid),
                         T.run_wan, ("hidden_states", "timestep", "encoder_hidden_states"), True,
                         (dict(frames=3, h=8, w=8), dict(frames=2, h=6, w=10)), merged_blocks=(0, 1), root="ChronoEdit",
                         host_class="ChronoEditTransformer3DModel"),
    "skyreels-v2": Family("skyreels-v2", _skyreels_v2,
                          lambda model, batch=2, seed=1, **grid: T.wan_inputs(batch=batch, seed=seed, **grid),
                          T.run_wan, ("hidden_states", "timestep", "encoder_hidden_states"), True,
                          (dict(frames=3, h=8, w=8), dict(frames=2, h=6, w=10)), merged_blocks=(0, 1), root="SkyReels-V2",
                          host_class="SkyReelsV2Transformer3DModel"),
    "wan-vace": Family("wan-vace", _wan_vace, _wan_vace_inputs, T.run_wan,
                       ("hidden_states", "timestep", "encoder_hidden_states", "control_hidden_states"), True,
                       (dict(frames=3, h=8, w=8), dict(frames=2, h=6, w=10)), merged_blocks=(0, 1), root="Wan VACE",
                       host_class="WanVACETransformer3DModel"),
    "wan-animate": Family("wan-animate", V.wan_animate, V.wan_animate_inputs, V.run,
                          ("hidden_states", "timestep", "encoder_hidden_states", "encoder_hidden_states_image",
                           "pose_hidden_states", "face_pixel_values"), True,
                          (dict(frames=3, h=8, w=8), dict(frames=2, h=6, w=10)), merged_blocks=(0, 1),
                          root="Wan Animate", host_class="WanAnimateTransformer3DModel"),
    "cosmos": Family("cosmos", V.cosmos, V.cosmos_inputs, V.run,
                     ("hidden_states", "timestep", "encoder_hidden_states"), True,
                     (dict(frames=3, h=8, w=8), dict(frames=2, h=6, w=10)), merged_blocks=(0, 1), root="Cosmos",
                     host_class="CosmosTransformer3DModel"),
    "hunyuan_video15": Family("hunyuan_video15", H.hunyuan_video15, H.hunyuan_video15_inputs, V.run,
                              ("hidden_states", "timestep", "encoder_hidden_states", "encoder_hidden_states_2",
                               "encoder_attention_mask", "encoder_attention_mask_2", "image_embeds"), True,
                              (dict(frames=2, h=8, w=8), dict(frames=1, h=6, w=10)), merged_blocks=(0, 1),
                              root="HunyuanVideo 1.5", host_class="HunyuanVideo15Transformer3DModel",
                              host_reads="its forward branches on torch.all(image_embeds == 0) and reorders the "
                                         "text by boolean masks"),
    # [image, text] joined with the image first under the root's mask over both (kinds_image_first.py).
    "hunyuan-video": Family("hunyuan-video", F.hunyuan_video, F.hunyuan_video_inputs, V.run,
                            ("hidden_states", "timestep", "encoder_hidden_states", "pooled_projections",
                             "encoder_attention_mask", "guidance"), True,
                            (dict(frames=2, h=8, w=8), dict(frames=1, h=6, w=10)), merged_blocks=(0, 1),
                            root="HunyuanVideo", host_class="HunyuanVideoTransformer3DModel",
                            host_reads=F.hunyuan_video_host_reads()),
    # Motif-Video: HunyuanVideo's blocks under its own names, with its text mask (its pipelines always pass one).
    "motif-video": Family("motif-video", F.motif_video, F.motif_video_inputs, V.run,
                          ("hidden_states", "timestep", "encoder_hidden_states", "encoder_attention_mask"), True,
                          (dict(frames=2, h=8, w=8), dict(frames=1, h=6, w=10)), merged_blocks=(0, 1),
                          root="Motif-Video", host_class="MotifVideoTransformer3DModel"),
    "framepack": Family("framepack", F.framepack, F.framepack_inputs, V.run,
                        ("hidden_states", "timestep", "encoder_hidden_states", "encoder_attention_mask",
                         "pooled_projections", "image_embeds", "guidance", "latents_clean", "latents_history_2x",
                         "latents_history_4x"), True, (dict(frames=2, h=8, w=8), dict(frames=1, h=8, w=12)),
                        merged_blocks=(0, 1), root="HunyuanVideo Framepack",
                        host_class="HunyuanVideoFramepackTransformer3DModel",
                        host_reads="its forward fills the mask sample by sample, up to each prompt's length"),
    "hidream": Family("hidream", F.hidream, F.hidream_inputs, V.run,
                      ("hidden_states", "timesteps", "encoder_hidden_states_t5", "pooled_embeds"), True,
                      (dict(h=16, w=16), dict(h=16, w=12)), merged_blocks=(0, 1), root="HiDream-I1",
                      host_class="HiDreamImageTransformer2DModel",
                      host_reads="its mixture of experts counts each expert's tokens on the host (bincount().cpu())"),
    "hunyuan-image": Family("hunyuan-image", F.hunyuan_image, F.hunyuan_image_inputs, V.run,
                            ("hidden_states", "timestep", "encoder_hidden_states", "encoder_attention_mask"), True,
                            (dict(h=8, w=8), dict(h=6, w=10)), merged_blocks=(0, 1), root="HunyuanImage 2.1",
                            host_class="HunyuanImageTransformer2DModel"),
    "mochi": Family("mochi", H.mochi, H.mochi_inputs, V.run,
                    ("hidden_states", "encoder_hidden_states", "timestep", "encoder_attention_mask"), True,
                    (dict(frames=2, h=16, w=16), dict(frames=1, h=12, w=20)), merged_blocks=(0, 1), root="Mochi",
                    host_class="MochiTransformer3DModel",
                    host_reads="its processor keeps each sample's valid text by torch.nonzero of the mask"),
    "consisid": Family("consisid", V.consisid, V.consisid_inputs, V.run,
                       ("hidden_states", "encoder_hidden_states", "timestep"), True,
                       (dict(frames=3, h=8, w=8), dict(frames=2, h=6, w=10)), merged_blocks=(0, 1), root="ConsisID",
                       host_class="ConsisIDTransformer3DModel"),
    "easyanimate": Family("easyanimate", V.easyanimate, V.easyanimate_inputs, V.run,
                          ("hidden_states", "timestep", "encoder_hidden_states"), True,
                          (dict(frames=3, h=8, w=8), dict(frames=2, h=6, w=10)), merged_blocks=(0, 1),
                          root="EasyAnimate", host_class="EasyAnimateTransformer3DModel"),
    "sana-video": Family("sana-video", V.sana_video, V.sana_video_inputs, V.run,
                         ("hidden_states", "encoder_hidden_states", "timestep", "encoder_attention_mask"), True,
                         (dict(frames=3, h=8, w=8), dict(frames=2, h=6, w=10)), merged_blocks=(0, 1),
                         root="Sana-Video", host_class="SanaVideoTransformer3DModel"),
    # Latte's spatial blocks merge within each frame (its frames ride in their batch), so each frame is matched
    # on its own; every grid has the model's video_length frames.
    "latte": Family("latte", V.latte, V.latte_inputs, V.run, ("hidden_states", "encoder_hidden_states", "timestep"),
                    False, (dict(frames=2, h=8, w=8), dict(frames=2, h=6, w=10)), merged_blocks=(0, 1), root="Latte",
                    host_class="LatteTransformer3DModel"),
    # A packed latent [B, N, C] whose grid is in the forward's arguments (layouts_packed.py): LTX-Video's num_frames,
    # height and width; Qwen-Image's img_shapes (its rows, complex and with no batch axis, serve one matching).
    "ltx-video": Family("ltx-video", P.ltx, P.ltx_inputs, P.run,
                        ("hidden_states", "encoder_hidden_states", "timestep", "encoder_attention_mask"), True,
                        (dict(frames=3, h=8, w=8), dict(frames=2, h=6, w=10)), merged_blocks=(0, 1), root="LTX-Video",
                        host_class="LTXVideoTransformer3DModel"),
    # LTX-2: LTX-Video's packed grid beside an audio stream that never merges (tests/torch/test_ltx2.py); the
    # contract holds its video output, the audio's inputs batched with it.
    "ltx2": Family("ltx2", L2.ltx2, L2.ltx2_inputs, L2.run,
                   ("hidden_states", "audio_hidden_states", "encoder_hidden_states", "audio_encoder_hidden_states",
                    "timestep", "encoder_attention_mask", "audio_encoder_attention_mask"), True,
                   (dict(frames=2, h=8, w=8), dict(frames=3, h=6, w=10)), merged_blocks=(0,), root="LTX-2",
                   host_class="LTX2VideoTransformer3DModel"),
    "qwen-image": Family("qwen-image", P.qwen, P.qwen_inputs, P.run,
                         ("hidden_states", "encoder_hidden_states", "timestep"), True,
                         (dict(h=8, w=8), dict(h=6, w=10)), merged_blocks=(0, 1), root="Qwen-Image",
                         host_class="QwenImageTransformer2DModel"),
    # A unified sequence of image and text tokens with padding (layouts_unified.py): Z-Image's image first, Lumina 2's
    # after each sample's text; prompts of different lengths per sample, so the joint layers get a padding mask.
    "z-image": Family("z-image", U.z_image, U.z_image_inputs, U.z_image_run, ("x", "cap_feats", "t"), False,
                      (dict(h=16, w=16), dict(h=12, w=20)), merged_blocks=(0, 2), root="Z-Image",
                      host_class="ZImageTransformer2DModel"),
    "lumina2": Family("lumina2", U.lumina2, U.lumina2_inputs, U.run,
                      ("hidden_states", "encoder_hidden_states", "timestep", "encoder_attention_mask"), False,
                      (dict(h=16, w=16), dict(h=12, w=20)), merged_blocks=(0, 2, 3), root="Lumina 2",
                      host_class="Lumina2Transformer2DModel",
                      host_reads="its rotary embedder reads each prompt's length by .tolist() of the mask's sum"),
    # OmniGen: [conditions, time token, image] under a mask per (query, key) pair; prompts left-padded by length.
    "omnigen": Family("omnigen", U.omnigen, U.omnigen_inputs, U.run,
                      ("hidden_states", "timestep", "input_ids", "attention_mask", "position_ids"), True,
                      (dict(h=16, w=16), dict(h=12, w=20)), merged_blocks=(0, 1), root="OmniGen",
                      host_class="OmniGenTransformer2DModel",
                      host_reads="its rotary embedding compares torch.max(position_ids) with an int on the host"),
    "chroma": Family("chroma", X.chroma, X.chroma_inputs, X.run, ("hidden_states", "encoder_hidden_states", "timestep"),
                     True, (dict(h=8, w=8), dict(h=6, w=10)), merged_blocks=(0, 1, 2, 3), root="Chroma",
                     host_class="ChromaTransformer2DModel"),
    "flux2": Family("flux2", X.flux2, X.flux2_inputs, X.run,
                    ("hidden_states", "encoder_hidden_states", "timestep", "guidance", "img_ids", "txt_ids"), True,
                    (dict(h=8, w=8), dict(h=6, w=10)), merged_blocks=(0, 1, 2, 3), root="Flux.2",
                    host_class="Flux2Transformer2DModel"),
    "cogview4": Family("cogview4", X.cogview4, X.cogview4_inputs, X.run,
                       ("hidden_states", "encoder_hidden_states", "timestep", "original_size", "target_size",
                        "crop_coords"), True, (dict(h=16, w=16), dict(h=12, w=20)), merged_blocks=(0, 1),
                       root="CogView4", host_class="CogView4Transformer2DModel"),
    "sana": Family("sana", X.sana, X.sana_inputs, X.run,
                   ("hidden_states", "encoder_hidden_states", "timestep", "encoder_attention_mask"), False,
                   (dict(h=8, w=8), dict(h=6, w=10)), merged_blocks=(0, 1), root="diffusion transformer"),
    "hunyuan-dit": Family("hunyuan-dit", X.hunyuan_dit, X.hunyuan_dit_inputs, X.run,
                          ("hidden_states", "encoder_hidden_states", "text_embedding_mask", "encoder_hidden_states_t5",
                           "text_embedding_mask_t5", "timestep", "image_meta_size", "style"), True,
                          (dict(h=16, w=16), dict(h=12, w=20)), merged_blocks=(0, 1, 2, 3), root="HunyuanDiT"),
    "auraflow": Family("auraflow", X.auraflow, X.auraflow_inputs, X.run,
                       ("hidden_states", "encoder_hidden_states", "timestep"), False,
                       (dict(h=16, w=16), dict(h=12, w=20)), merged_blocks=(0, 1, 2, 3), root="AuraFlow"),
    "prx": Family("prx", I.prx, I.prx_inputs, I.run, ("hidden_states", "encoder_hidden_states", "timestep"), False,
                  (dict(h=16, w=16), dict(h=12, w=20)), merged_blocks=(0, 1), root="PRX",
                  host_class="PRXTransformer2DModel"),
    # Flux's layout under other classes (tests/tiny_image_families.py): one double and one single block each.
    "bria": Family("bria", I.bria, I.bria_inputs, I.run, ("hidden_states", "encoder_hidden_states", "timestep"), True,
                   (dict(h=8, w=8), dict(h=6, w=10)), merged_blocks=(0, 1), root="Bria",
                   host_class="BriaTransformer2DModel"),
    "bria-fibo": Family("bria-fibo", I.bria_fibo, I.bria_fibo_inputs, I.run,
                        ("hidden_states", "encoder_hidden_states", "timestep"), True,
                        (dict(h=8, w=8), dict(h=6, w=10)), merged_blocks=(0, 1), root="Bria FIBO",
                        host_class="BriaFiboTransformer2DModel"),
    "longcat-image": Family("longcat-image", I.longcat, I.longcat_inputs, I.run,
                            ("hidden_states", "encoder_hidden_states", "timestep"), True,
                            (dict(h=8, w=8), dict(h=6, w=10)), merged_blocks=(0, 1), root="LongCat-Image",
                            host_class="LongCatImageTransformer2DModel"),
    "ovis-image": Family("ovis-image", I.ovis, I.ovis_inputs, I.run,
                         ("hidden_states", "encoder_hidden_states", "timestep"), True,
                         (dict(h=8, w=8), dict(h=6, w=10)), merged_blocks=(0, 1), root="Ovis-Image",
                         host_class="OvisImageTransformer2DModel"),
    "cogview3-plus": Family("cogview3-plus", I.cogview3plus, I.cogview3plus_inputs, I.run,
                            ("hidden_states", "encoder_hidden_states", "timestep", "original_size", "target_size",
                             "crop_coords"), False, (dict(h=16, w=16), dict(h=12, w=20)), merged_blocks=(0, 1),
                            root="CogView3-Plus", host_class="CogView3PlusTransformer2DModel"),
    "glm-image": Family("glm-image", I.glm_image, I.glm_image_inputs, I.glm_image_run,
                        ("hidden_states", "encoder_hidden_states", "prior_token_id", "prior_token_drop", "timestep",
                         "target_size", "crop_coords"), True, (dict(h=16, w=16), dict(h=12, w=20)),
                        merged_blocks=(0, 1), root="GLM-Image", host_class="GlmImageTransformer2DModel"),
    "cogvideox-1.5": Family("cogvideox-1.5", lambda: T.cogvideox("1.5"),
                            lambda model, batch=2, seed=1, **grid: T.cogvideox_inputs(model, batch=batch, seed=seed,
                                                                                      **grid),
                            T.run_cogvideox, ("hidden_states", "timestep", "encoder_hidden_states"), True,
                            (dict(frames=4, h=8, w=8), dict(frames=2, h=6, w=10)), dict(ratio=0.5, merge_mlp=True),
                            merged_blocks=(0, 1), root="CogVideoX"),
    # diffusers 0.42's later families (tests/tiny_diffusers_0_42_families.py): JoyImage Edit called as its edit pipeline calls it
    # (a reference image's tokens after the target's, passing whole), Krea 2 without a text mask (its masked calls,
    # under which proportional attention is refused: test_diffusers_0_42_families.py).
    "joyimage-edit": Family("joyimage-edit", D.joyimage, D.joyimage_inputs, D.run,
                            ("hidden_states", "timestep", "encoder_hidden_states"), True,
                            (dict(frames=1, h=8, w=8), dict(frames=1, h=6, w=10)), merged_blocks=(0,),
                            root="JoyImage Edit", host_class="JoyImageEditTransformer3DModel"),
    "krea2": Family("krea2", D.krea2, D.krea2_inputs, D.run, ("hidden_states", "encoder_hidden_states", "timestep"),
                    True, (dict(h=8, w=8), dict(h=6, w=10)), merged_blocks=(0,), root="Krea 2",
                    host_class="Krea2Transformer2DModel"),
    # Flux.3 called with a reference image (image_cond_hidden_states), whose tokens pass whole: its image's per-mode
    # block and its single block merge.
    "flux3": Family("flux3", D.flux3,
                    lambda model, batch=2, seed=1, **grid: D.flux3_inputs(model, batch, seed=seed, reference=True, **grid),
                    D.run, ("hidden_states", "encoder_hidden_states", "timestep", "image_cond_hidden_states"), True, (dict(h=8, w=8), dict(h=6, w=10)), merged_blocks=(0, 1), root="Flux.3",
                    host_class="Flux3Transformer2DModel"),
    # NucleusMoE-Image without a text mask (so that proportional attention, refused under one, runs here too; the
    # masked call its pipeline makes: test_diffusers_0_42_families.py): a dense and a mixture-of-experts block.
    "nucleusmoe-image": Family("nucleusmoe-image", D.nucleus, D.nucleus_inputs, D.run,
                               ("hidden_states", "encoder_hidden_states", "timestep"), True,
                               (dict(h=8, w=8), dict(h=6, w=10)), merged_blocks=(0, 1), root="NucleusMoE-Image",
                               host_class="NucleusMoEImageTransformer2DModel",
                               host_reads="its experts split the routed tokens by counts read with .tolist()"),
    # Helios called with its three histories, whose tokens precede the target's and pass whole.
    "helios": Family("helios", D.helios, D.helios_inputs, D.run,
                     ("hidden_states", "timestep", "encoder_hidden_states", "indices_hidden_states",
                      "indices_latents_history_short", "indices_latents_history_mid", "indices_latents_history_long",
                      "latents_history_short", "latents_history_mid", "latents_history_long"), True,
                     (dict(frames=2, h=8, w=8), dict(frames=3, h=6, w=10)), merged_blocks=(0,), root="Helios",
                     host_class="HeliosTransformer3DModel",
                     host_reads="its rotary embedding enters torch.autocast on the meta device, which torch refuses"),
    "anyflow": Family("anyflow", D.anyflow, D.anyflow_inputs, D.run,
                      ("hidden_states", "timestep", "r_timestep", "encoder_hidden_states"), True,
                      (dict(frames=3, h=8, w=8), dict(frames=2, h=6, w=10)), dict(ratio=0.5, st=2), merged_blocks=(0,),
                      root="AnyFlow", host_class="AnyFlowTransformer3DModel", timestep_per_frame=True),
    "controlnet-xs": Family("controlnet-xs", _controlnet_xs, _controlnet_xs_inputs, _run_unet,
                            ("sample", "encoder_hidden_states", "controlnet_cond"), False,
                            (dict(h=16, w=16), dict(h=12, w=20)), merged_blocks=tuple(range(9)), root="UNet",
                            host_class="UNetControlNetXSModel"),
    "unet3d": Family("unet3d", lambda: T.video_unet("unet3d"), _video_unet_inputs, T.run_video,
                     ("sample", "encoder_hidden_states"), False, (dict(frames=4, h=16, w=16), dict(frames=2, h=12, w=20)),
                     merged_blocks=(0, 1, 2), root="video UNet"),
}


def missing_host(family: Family) -> str:
    """Why this environment cannot build the family ("" when it can)."""
    if not family.host_class:
        return ""
    import diffusers

    if hasattr(diffusers, family.host_class):
        return ""
    return f"diffusers {diffusers.__version__} has no {family.host_class} (env (a), current diffusers, runs it)"


def flipped(family: Family, inputs: dict) -> dict:
    """The same inputs with the batch in reverse order."""
    return {k: (v if k not in family.batched else v[::-1] if isinstance(v, (list, tuple)) else v.flip(0))
            for k, v in inputs.items()}  # per-sample lists (Z-Image's latents and captions) reversed
