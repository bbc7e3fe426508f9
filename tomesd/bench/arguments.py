"""The bench command's options (add_arguments), and what each accepts: an architecture's name, a resolution."""
from __future__ import annotations

import argparse

from .kits import caches
from .kits.configs import ARCHS

ARCH_NAMES = {"sd1": "sd15", "sdxl": "sdxl", "sd3": "sd3", "pixart": "pixart", "flux": "flux", "flux2": "flux2",
              "flux2-klein": "flux2-klein", "qwen-image": "qwen-image", "z-image": "z-image",
              "animatediff": "animatediff", "svd": "svd", "wan": "wan", "hunyuanvideo-1.5": "hunyuanvideo-1.5"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", choices=["torch", "paddle"], default="torch")
    parser.add_argument("--host", choices=["diffusers", "comfyui"], default="diffusers",
                        help="comfyui: time ComfyUI's own models (--arch sd1, sdxl or flux): unpatched, ComfyUI's "
                             "TomePatchModel and this project's nodes")
    parser.add_argument("--comfyui", metavar="PATH", default=None,
                        help="with --host comfyui: a ComfyUI folder (default: $COMFYUI_PATH, else `make envs`'s copy)")
    parser.add_argument("--arch", choices=sorted(ARCH_NAMES), default=None,
                        help="architecture at real width, random weights: sd1 (SD1.5 UNet, the default), sdxl "
                             "(SDXL UNet), sd3 (SD3-medium transformer), pixart (PixArt-alpha 1024), flux "
                             "(Flux.1-dev), animatediff (SD1.5 UNet with AnimateDiff's motion adapter, video), svd "
                             "(Stable Video Diffusion img2vid-xt UNet), wan (Wan 2.1 T2V 1.3B transformer, video), "
                             "z-image (Z-Image Turbo), hunyuanvideo-1.5 (HunyuanVideo 1.5 480p T2V, video); flux2, "
                             "flux2-klein, qwen-image; same as --config of that name (sd1: sd15)")
    parser.add_argument("--frames", type=int, default=None,
                        help="video architectures: frames per clip (default: AnimateDiff 16, SVD 14, Wan 17, i.e. 5 "
                             "latent frames; HunyuanVideo 1.5 5, i.e. 2 latent frames)")
    parser.add_argument("--depth", type=int, default=None,
                        help="transformers: build only this many blocks (default: all; SD3-medium 24, PixArt 28, "
                             "Flux 19 double-stream, with twice as many single-stream)")
    parser.add_argument("--config", choices=sorted(ARCHS), default="sd15",
                        help="architecture built with random weights (default: SD1.5's UNet; tiny ones for checks)")
    parser.add_argument("--res", type=resolution, default=(512, 512),
                        help="image side in pixels (latent = res/8), or HEIGHTxWIDTH (480x832); default 512")
    parser.add_argument("--batch", type=int, default=2, help="UNet batch (2 = one image with classifier-free guidance)")
    parser.add_argument("--ratios", default="0.25,0.5,0.75", help="comma-separated ToMe ratios")
    parser.add_argument("--modes", default=None,
                        help="comma-separated: merge (ToMe, one row per ratio), merge-mlp (ToMe with merge_mlp=True, "
                             "one row per ratio), merge-prop (ToMe with proportional_attention=True, one row per ratio), "
                             "merge-restore (that and restore_tokens, per ratio and --reuse-steps K > 1), downsample "
                             "(ToDo, one row), downsample-restore (ToDo with restore_tokens, per --reuse-steps K > 1); "
                             "default merge,downsample")
    parser.add_argument("--reuse-steps", default="1", metavar="K[,K...]",
                        help="merge rows per ratio, one per K: matching reused for K denoising steps (use with --steps)")
    parser.add_argument("--downsample-factor", type=int, default=2, help="per side, with --modes downsample")
    parser.add_argument("--downsample-method", choices=["nearest", "avg"], default="nearest")
    parser.add_argument("--max-downsample", type=int, default=None,
                        help="as in apply_patch; default: the finest level with attention")
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None,
                        help="default float32 (with --predict: the GPU's, see there)")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda / gpu")
    parser.add_argument("--repeats", type=int, default=3, help="timed forwards per configuration (median)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed forwards per configuration first")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compare", action="store_true",
                        help="also run the reference (tomesd 0.1.3 on torch, ppdiffusers' built-in on paddle)")
    parser.add_argument("--json", metavar="PATH", help="write machine-readable results")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG of speed-up and memory saved vs ratio")
    parser.add_argument("--no-memory", action="store_true", help="skip the CPU peak-memory probes (one process each)")
    parser.add_argument("--flops-only", action="store_true",
                        help="count each configuration's FLOPs on the meta device and stop (no timing; seconds at any "
                             "size; torch)")
    parser.add_argument("--predict", metavar="GPU", default=None,
                        help="predict each configuration's device time on a GPU (h100, h200) with the device-time "
                             "model, from a forward traced on the meta device, and stop (no timing, no weights; "
                             "torch). --dtype defaults to the GPU's: float16 for the UNets, SD3 and PixArt, bfloat16 "
                             "for the other transformers")
    parser.add_argument("--model", metavar="PATH",
                        help="a local diffusers/ppdiffusers pipeline folder: generate under every setting (the same "
                             "--modes, --ratios, --reuse-steps, --downsample-* options) and report time per image and "
                             "closeness to the unpatched images")
    parser.add_argument("--prompt", default=None, help="with --model: one prompt (instead of the built-in three)")
    parser.add_argument("--prompts", metavar="FILE", default=None,
                        help="with --model: one prompt per line (default: three built-in prompts)")
    parser.add_argument("--seeds", type=int, default=2, help="with --model: seeds per prompt (default 2)")
    parser.add_argument("--closeness-plot", metavar="PATH", default="bench-out/closeness.png",
                        help="with --model: PSNR against speed-up, one point per setting")
    parser.add_argument("--steps", type=int, default=None,
                        help="time a loop of N UNet calls over distinct timesteps per configuration (default 1); "
                             "with --model: denoising steps (default 20)")
    parser.add_argument("--grid", metavar="PATH", default="bench-out/grid.png", help="image grid written with --model")
    parser.add_argument("--cache", metavar="NAME[,NAME...]", default=None,
                        help=f"with --steps: also run diffusers' step caches ({', '.join(caches.CACHES)}: First "
                             "Block Cache, TaylorSeer, FasterCache, Pyramid Attention Broadcast, MagCache), each "
                             "alone and under each ToMe setting, side by side (torch); fbc:T and magcache:T set "
                             "the skip threshold T (defaults 0.05 and 0.06)")
    parser.add_argument("--context-parallel", type=int, metavar="N", default=None,
                        help="--arch flux or wan: run it context-parallel on N local processes (diffusers' "
                             "enable_parallelism; gloo on CPU, NCCL on CUDA, one GPU a process), the baseline beside "
                             "ToMe at each ratio: time, tokens into attention per rank, what collectives move")
    parser.add_argument("--cp-attention", choices=["ulysses", "ring"], default="ulysses",
                        help="with --context-parallel: Ulysses (all-to-all) or ring attention")
    parser.add_argument("--compile", action="store_true",
                        help="torch only: time a torch.compile'd UNet per configuration (first call reported apart)")
    parser.add_argument("--preset", choices=["gpu"], default=None,
                        help="gpu: the GPU report, a fixed list of runs (SD1.5, SDXL, SD3, Flux, Wan; eager, "
                             "compiled, with step caches) on one CUDA GPU within --budget seconds, written as JSON "
                             "and one markdown table under --out (gpu_report.py)")
    parser.add_argument("--preset-config", choices=["full", "tiny"], default="full",
                        help="with --preset: full (the real architectures, on --device cuda) or tiny (the tiny "
                             "configurations on CPU: a check of the plumbing, not a measurement)")
    parser.add_argument("--out", metavar="DIR", default=None, help="with --preset: where the runs' JSON and the "
                                                                    "report go (default bench-out/gpu-report)")
    parser.add_argument("--only", metavar="SLUG[,SLUG...]", default=None,
                        help="with --preset: run only these runs (their JSON names without the number, e.g. "
                             "sd1-5-1024-compiled): a rerun of what failed")
    parser.add_argument("--budget", type=float, default=None, metavar="S",
                        help="with --preset: wall-clock seconds; runs that would start later are listed as not run "
                             "(default 540)")
    parser.add_argument("--compile-backend", metavar="NAME", default=None,
                        help="torch.compile backend with --compile (default: inductor; aot_eager, eager for checks)")
    parser.add_argument("--profile", action="store_true",
                        help="torch, eager: also profile one forward of the baseline, each ToMe ratio and the "
                             "reference (torch.profiler): the ops that cost most, device time on a GPU")
    parser.add_argument("--attention-backend", metavar="NAME", default=None,
                        help="torch: time every configuration under this kernel of diffusers' attention dispatcher "
                             "(native, _native_cudnn, flex, flash, sage, xformers, ...; diffusers' attention_backend), "
                             "for the models whose processors dispatch (Flux, Wan, ...); with --host comfyui: "
                             "ComfyUI's attention function of that name (pytorch, sage, flash, xformers, sub_quad, "
                             "split)")
    parser.add_argument("--compile-regional", action="store_true",
                        help="with --compile: compile each repeated block on its own, as diffusers recommends "
                             "(model.compile_repeated_blocks(fullgraph=True)), not the whole model")
    parser.add_argument("--compile-mode", choices=["default", "reduce-overhead", "max-autotune-no-cudagraphs"],
                        default=None, help="inductor's mode with --compile: reduce-overhead replays each "
                                           "configuration as CUDA graphs (CUDA only)")


def resolution(text: str) -> "tuple[int, int]":
    """--res: a side (512), or height x width (480x832)."""
    parts = text.lower().split("x")
    try:
        sides = [int(part) for part in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a side in pixels (512) or HEIGHTxWIDTH (480x832)") from None
    if len(sides) not in (1, 2):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a side in pixels (512) or HEIGHTxWIDTH (480x832)")
    return (sides[0], sides[-1])
