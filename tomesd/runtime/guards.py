"""What cannot run correctly, refused in the user's terms: at apply time (`validate`, before anything is
changed) and at the first call that reveals it (a processor, cache or wrapper swapped in after the patch).
Every refusal names an option that works on that model."""
from __future__ import annotations

from typing import Any

from ..families import SUPPORTED, foreign_to_unets
from ..layouts.entries import sublayer
from ..layouts.signatures import CONTEXT, TIMESTEP, InputSpec

KV_PROJECTIONS = ("to_k", "to_v")

CHUNKED_FF = (
    "merge_mlp=True cannot be combined with chunked feed-forward (enable_forward_chunking): the "
    "feed-forward would merge each chunk on its own. Disable chunking or use merge_mlp=False."
)

FUSED_QKV = (
    "mode='downsample' cannot run on these fused QKV projections (fuse_qkv_projections): the fused self-attention "
    "computes keys and values from its queries' input, and its processor is none of diffusers' "
    "FusedAttnProcessor2_0 and FusedJointAttnProcessor2_0, whose one SDPA call ToMe shrinks the keys in. "
    "Call unfuse_qkv_projections() first."
)

# diffusers' fused processors whose self- or joint attention makes one call of torch's scaled_dot_product_attention,
# the image's keys first: downsampling shrinks the keys and values there (downsample_sites.FusedKeys)
FUSED_SDPA_PROCESSORS = ("FusedAttnProcessor2_0", "FusedJointAttnProcessor2_0")

MASKED_SELF_ATTENTION = (
    "ToMe cannot merge self-attention that is given an attention_mask (the mask addresses "
    "unmerged tokens); call apply_patch with merge_attn=False"
)

MASKED_DOWNSAMPLE = (
    "mode='downsample' cannot shrink self-attention's keys when it is given an attention_mask "
    "(the mask addresses every token)"
)


def keeps_outputs(module: Any) -> bool:
    """Whether a diffusers hook on `module` keeps its outputs across calls (a step cache: TaylorSeer,
    FasterCache, Pyramid Attention Broadcast)."""
    registry = getattr(module, "_diffusers_hook", None)
    return any(getattr(hook, "_is_stateful", False) for hook in (getattr(registry, "hooks", None) or {}).values())


def refuse_step_cache_inside(patch: Any, index: int, kind: Any) -> None:
    """A step cache stacks where ToMe's hooks sit in a block (they run inside the cache, so it keeps full
    tokens: install.around, seat_span_cache) and on whole blocks. On a module deeper inside a merged
    region it would keep merged tokens in one step's order and replay them into another's."""
    block = patch.blocks[index]
    seats = {id(block)}
    for path in [layer.name for layer in kind.sublayers] + [
            p for span in kind.spans for p in (span.start, span.attention, *span.ends)]:
        seats.add(id(sublayer(block, path)))
    # Without spans, merged tokens live only inside the sub-layers the kind lists (between each one's merge and
    # unmerge): the block's other modules see every token (LTX-2's audio stream, whose attentions PAB caches).
    regions = [("", block)] if kind.spans else [
        (layer.name + ".", sublayer(block, layer.name)) for layer in kind.sublayers
        if sublayer(block, layer.name) is not None]
    for prefix, name, module in [(p, n, m) for p, region in regions for n, m in patch.host.named_modules(region)]:
        if id(module) not in seats and keeps_outputs(module):
            hooks = ", ".join(module._diffusers_hook.hooks)
            raise ValueError(
                f"mode='merge' cannot run with diffusers' {hooks} hook on {type(block).__name__}.{prefix}{name}: that "
                f"module sees merged tokens, so the cache would keep them in one step's order and replay them "
                f"into another's. Cache the attention modules (diffusers' default identifiers) or whole blocks "
                f"(First Block Cache, MagCache), which stack with ToMe"
            )


def fused(attn: Any) -> bool:
    """diffusers' fused processors run self-attention through one to_qkv (there is no to_kv), so it
    cannot take other keys; unfusing swaps the processor back and keeps the fused weights around."""
    fused_processor = "Fused" in type(getattr(attn, "processor", None)).__name__
    return fused_processor and getattr(attn, "to_kv", None) is None


def check_fused(attn: Any, host: Any, method: str = "nearest") -> None:
    """A fused processor runs to_qkv where downsampling needs the keys' input alone: it shrinks the keys inside the
    processor's SDPA call instead, where the host has that seam and the processor is one of diffusers' known ones.
    Keys normalised after the projection (qk-norm) are not linear in the tokens: the mean of a cell's normalised
    keys is not the normalised key of its mean, so average pooling is refused there (taking every n-th is exact)."""
    if not fused(attn):
        return
    if getattr(host, "shrunk_keys", None) is None \
            or type(getattr(attn, "processor", None)).__name__ not in FUSED_SDPA_PROCESSORS:
        raise ValueError(FUSED_QKV)
    if method == "avg" and getattr(attn, "norm_k", None) is not None:
        raise ValueError(
            f"downsample_method='avg' cannot run on fused QKV projections of {type(attn).__name__}, which normalises "
            f"its keys after projecting them (the mean of normalised keys is not the normalised mean): use "
            f"downsample_method='nearest', or call unfuse_qkv_projections() first")


def check_projections(attn: Any, host: Any, method: str = "nearest") -> None:
    """Downsampling at to_k / to_v needs a processor that projects the image through them once per call (or a
    fused one check_fused accepts); a PAG processor splits the batch and runs a second attention whose mask
    addresses every token."""
    check_fused(attn, host, method)
    processor = type(getattr(attn, "processor", None)).__name__
    if "PAG" in processor:
        raise ValueError(
            f"mode='downsample' cannot run under {processor} (perturbed-attention guidance splits the batch and "
            f"masks every token); use mode='merge' or a plain processor"
        )


def check_dispatch(attn: Any, block_name: str, host: Any) -> None:
    """Downsampling at the attention dispatch needs a processor whose code calls diffusers'
    `dispatch_attention_fn` (diffusers' own Flux and Wan processors, diffusers >= 0.35)."""
    dispatches = getattr(host, "dispatches", None)
    processor = getattr(attn, "processor", None)
    if dispatches is None or not dispatches(processor):
        raise ValueError(
            f"mode='downsample' on {block_name} shrinks the rotated keys where its attention processor calls "
            f"diffusers' dispatch_attention_fn, and {type(processor).__name__} does not call it (diffusers older "
            f"than 0.35, or a custom processor); use mode='merge', or diffusers' own processor"
        )


def check_downsample_way(attn: Any, way: Any, block_name: str, host: Any, method: str = "nearest") -> None:
    """What a processor swapped in after apply_patch could break, checked at each call."""
    if way.via == "projections":
        check_projections(attn, host, method)
    elif way.via == "dispatch":
        check_dispatch(attn, block_name, host)


def check_blocks_compiled_alone(patch: Any) -> None:
    """Refuse what keeps matchings across blocks or steps through Python state, which blocks compiled on their own
    (diffusers' compile_repeated_blocks: ToMePatch.regional_call) cannot hand each other."""
    args = patch.args
    kept = [name for name, on in (("share_across_blocks=True", args.share_across_blocks),
                                  (f"reuse_steps={args.reuse_steps}", args.steps_reused > 1),
                                  ("restore_tokens=True", args.restore_tokens)) if on]
    if kept:
        raise ValueError(
            f"{' and '.join(kept)} keep matchings across blocks or steps, which the blocks of "
            f"{type(patch.root).__name__}, compiled each on its own (compile_repeated_blocks), cannot hand each other: "
            f"compile the whole model instead (torch.compile(model); reuse_steps then needs the pipeline patched), or "
            f"patch without {kept[0].split('=')[0]}")


def validate(patch: Any) -> None:
    """Raise, before anything is changed, for a block whose merge could not be computed right."""
    args, name = patch.args, type(patch.root).__name__
    layout = patch.layout
    compiled_blocks = getattr(patch.host, "compiled_blocks", None)
    if compiled_blocks is not None and compiled_blocks(patch.blocks):
        check_blocks_compiled_alone(patch)
    if args.mode == "downsample" and args.restore_tokens and not hasattr(patch.host, "add_inner_wrapper"):
        raise ValueError(
            f"restore_tokens with mode='downsample' reruns each downsampled attention inside its forward chain at a "
            f"window's first step, which ToMe does on PyTorch models only, and {name} is not one: use "
            f"mode='merge' with restore_tokens, or mode='downsample' without it")
    if args.steps_reused > 1 and patch.timestep_spec is None:
        raise ValueError(
            f"reuse_steps needs the timestep input to tell denoising steps apart, and "
            f"{name}.forward takes none of {TIMESTEP}"
        )
    if getattr(layout, "guessed", False):  # a root in no family of tomesd/families/, read as a UNet
        # A UNet's blocks are BasicTransformerBlocks; read as a UNet, blocks of a transformer family (Flux's, with
        # text before the image, or after it as HunyuanVideo's single blocks) would merge tokens by the wrong rule.
        foreign = foreign_to_unets(patch.blocks)
        if foreign:
            raise ValueError(
                f"ToMe does not know {name}: its blocks ({', '.join(foreign)}) are of kinds ToMe merges in other "
                f"families, but its own family is not among ToMe's (tomesd/families/), and read as a UNet "
                f"its tokens would merge by the wrong rule. Supported: {SUPPORTED}")
    layout.validate(patch)
    if layout.one_grid and args.max_downsample is not None:
        raise ValueError(
            f"max_downsample has no meaning on {name}: a diffusion transformer's blocks all see one "
            f"token grid. Choose blocks by index with blocks=[...] instead"
        )
    if args.mode == "merge" and args.st != 1 and not layout.frames_in_sequence:
        raise ValueError(
            f"st (the dst stride along time) has no meaning on {name}: its blocks see one frame's tokens. It is "
            f"for video transformers (Wan, CogVideoX), whose blocks see every frame in one sequence"
        )
    if not layout.one_grid and args.blocks is not None:
        raise ValueError(
            f"blocks chooses blocks of a diffusion transformer by index; {name} is a UNet, whose blocks "
            f"are chosen by max_downsample"
        )
    if args.proportional_attention:
        for block, kind in zip(patch.blocks, patch.kinds):
            if kind.no_weights:
                raise ValueError(f"proportional_attention cannot run on {type(block).__name__}: {kind.no_weights}")
    if args.mode == "downsample":
        _validate_downsample(patch)
        return
    if args.bands > 1 and not layout.bands:
        raise ValueError(
            f"bands has no meaning on {name}: the band rule splits one token grid, as context parallelism splits "
            f"a diffusion transformer's (SD3, PixArt, Flux, Wan); a UNet's blocks see several. Leave bands out"
        )
    for index, (block, kind) in enumerate(zip(patch.blocks, patch.kinds)):
        if args.merge_mlp and getattr(block, "_chunk_size", None) is not None:
            raise ValueError(CHUNKED_FF)
        refuse_step_cache_inside(patch, index, kind)


def _validate_downsample(patch: Any) -> None:
    for block, kind in zip(patch.blocks, patch.kinds):
        if kind.no_downsample:
            raise ValueError(f"mode='downsample' cannot run on {type(block).__name__}: {kind.no_downsample}")
        for way in kind.downsample:
            attn = getattr(block, way.attention, None)
            if attn is None:
                continue
            if way.via == "dispatch":  # fused or not, the processor rotates keys and dispatches them
                check_dispatch(attn, type(block).__name__, patch.host)
                continue
            if way.via == "projections":
                check_projections(attn, patch.host, patch.args.downsample_method)
            else:
                check_fused(attn, patch.host, patch.args.downsample_method)
            if way.via == "context" and InputSpec.find(attn, CONTEXT, first_positional=False) is None:
                raise ValueError(
                    f"mode='downsample' passes keys and values to self-attention through its context "
                    f"argument, and {type(attn).__name__}.forward takes none of {CONTEXT}"
                )
            if way.via == "projections" and not all(hasattr(attn, p) for p in KV_PROJECTIONS):
                raise ValueError(
                    f"mode='downsample' shrinks {type(block).__name__}.{way.attention}'s keys and values "
                    f"at its {' and '.join(KV_PROJECTIONS)} projections, and it has none"
                )


def check_context_split(patch: Any, split: Any) -> None:
    """At the first call of a root that runs context-parallel (diffusers' enable_parallelism): each rank
    merges within its own band (bands.py); refuse what that rule cannot serve, before any block runs."""
    name, args = type(patch.root).__name__, patch.args
    one_process = f"or run {name} on one process with ToMe (bands={split.count} gives what each rank's band would)"
    if args.mode == "downsample":
        raise ValueError(
            f"mode='downsample' does not run under context parallelism yet ({name} on {split.count} processes): "
            f"use mode='merge', which merges within each rank's band"
        )
    if patch.layout.bands != "tokens":
        raise ValueError(
            f"ToMe cannot merge on {name} under context parallelism: the band rule needs each token's grid "
            f"coordinates (Flux, Wan and the other transformers with per-token rotary positions), and diffusers "
            f"gives {name} no context-parallel plan its attention follows. Run it context-parallel without ToMe "
            f"(remove_patch), {one_process}"
        )
    if split.uneven:
        raise ValueError(
            f"ToMe cannot merge on {name} with ContextParallelConfig({split.uneven}=True): the ranks' bands may "
            f"differ in size, and every rank must merge as many tokens as the others. Leave {split.uneven} off "
            f"(the token count must then divide by {split.count}), {one_process}"
        )
    if args.bands not in (1, split.count):
        raise ValueError(
            f"bands={args.bands} contradicts the {split.count} processes {name} runs context-parallel on: each rank "
            f"merges within its own band. Leave bands out (or give bands={split.count})"
        )
