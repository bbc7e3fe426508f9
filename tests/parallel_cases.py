"""The cases tests/torch/test_context_parallel.py runs on every rank of a spawned gloo world (tests/parallel.py).

Each case builds its models from one seed on every rank, runs the one-process references itself (unpatched,
and patched with bands=P, the band rule on one process), then the same model context-parallel over the world,
patched; it returns tensors (rank 0's are compared) and the tokens each rank's first attention took in.
"""
from __future__ import annotations

from typing import Any, Dict

import torch

import tiny_torch as T
import tomesd
from parallel import count_tokens

RATIO = 0.5


def _flux(seed: int = 0):
    from diffusers import FluxTransformer2DModel

    return T.randomize_(FluxTransformer2DModel(**dict(T.FLUX, num_attention_heads=4)), seed)  # heads split 4 ways


def _flux_inputs(t: float = 0.5) -> dict:
    return T.flux_inputs(batch=2, h=8, w=8, text=8, t=t)  # 64 image tokens in 8 rows, 8 text tokens


def _wan(seed: int = 0):
    return T.wan(seed, num_attention_heads=4)


def _wan_inputs(t: float = 500.0) -> dict:
    # 3 frames of 6 x 8 tokens: 144 tokens, so 2 bands meet inside frame 1, across a 2-row cell (row 3).
    return T.wan_inputs(batch=2, frames=3, h=12, w=16, t=t)


MODELS = {"flux": (_flux, _flux_inputs, lambda m: m.transformer_blocks[0].attn.to_q),
          "wan": (_wan, _wan_inputs, lambda m: m.blocks[0].attn1.to_q)}


def _config(attention: str, world: int, **extra):
    from diffusers import ContextParallelConfig

    degree = dict(ulysses_degree=world) if attention == "ulysses" else dict(ring_degree=world)
    return ContextParallelConfig(**degree, **extra)


def _call(model, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs, return_dict=False)[0]


def _bands_equal_world(family: str, attention: str, world: int, **patch) -> Dict[str, Any]:
    build, inputs, first_attention = MODELS[family]
    base = build()
    out = {"base": _call(base, inputs())}
    tomesd.apply_patch(base, ratio=RATIO, bands=world, **patch)
    out["bands"] = _call(base, inputs())
    tomesd.remove_patch(base)
    tomesd.apply_patch(base, ratio=RATIO, **patch)
    out["global"] = _call(base, inputs())

    model = build()
    model.enable_parallelism(config=_config(attention, world))
    tokens = count_tokens({"to_q": first_attention(model)})
    tomesd.apply_patch(model, ratio=RATIO, **patch)
    out["parallel"] = _call(model, inputs())
    out[f"tokens/{torch.distributed.get_rank()}"] = tokens()["to_q"]
    return out


def flux_ulysses(world: int) -> Dict[str, Any]:
    return _bands_equal_world("flux", "ulysses", world)


def flux_ring(world: int) -> Dict[str, Any]:
    return _bands_equal_world("flux", "ring", world)


def wan_ulysses(world: int) -> Dict[str, Any]:
    return _bands_equal_world("wan", "ulysses", world)


def wan_ring(world: int) -> Dict[str, Any]:
    return _bands_equal_world("wan", "ring", world)


# Proportional attention: each rank's merged keys carry their sizes through the exchange (the weights join the keys at
# diffusers' dispatch, before it); Flux's per-sample rotation at the dispatch runs first, on the same call.
def flux_ulysses_prop(world: int) -> Dict[str, Any]:
    return _bands_equal_world("flux", "ulysses", world, proportional_attention=True)


def flux_ring_prop(world: int) -> Dict[str, Any]:
    return _bands_equal_world("flux", "ring", world, proportional_attention=True)


def wan_ring_prop(world: int) -> Dict[str, Any]:
    return _bands_equal_world("wan", "ring", world, proportional_attention=True)


def wan_ulysses_prop_vs_plain(world: int) -> Dict[str, Any]:
    """The weights act under context parallelism: the same P-way run without them differs."""
    out = _bands_equal_world("wan", "ulysses", world, proportional_attention=True)
    plain = _bands_equal_world("wan", "ulysses", world)
    out["plain"] = plain["parallel"]
    return out


def flux_reuse_steps(world: int) -> Dict[str, Any]:
    """reuse_steps=2 on a bare model: calls at 3 timesteps, the second reusing the first's matching."""
    out: Dict[str, Any] = {}
    for name, parallel in (("bands", False), ("parallel", True)):
        model = _flux()
        if parallel:
            model.enable_parallelism(config=_config("ulysses", world))
        tomesd.apply_patch(model, ratio=RATIO, reuse_steps=2, **({} if parallel else {"bands": world}))
        inputs = _flux_inputs()  # one ids tensor for the run, as a pipeline passes it (Flux keys kept matchings by it)
        with tomesd.observe(model) as seen:
            out[name] = torch.stack([_call(model, dict(inputs, timestep=torch.full((2,), t))) for t in (0.9, 0.6, 0.3)])
        out[f"{name}/reused"] = sum(call.reused for call in seen.calls)
    return out


def flux_pipeline_clock(world: int) -> Dict[str, Any]:
    """A tiny FluxPipeline with reuse_steps=2: the pipeline's clock counts the steps under context parallelism."""
    out: Dict[str, Any] = {}
    for name, parallel in (("plain", False), ("bands", False), ("parallel", True)):  # plain: no patch
        pipe = T.flux_pipeline()
        pipe.transformer = _flux()
        if parallel:
            pipe.transformer.enable_parallelism(config=_config("ulysses", world))
        if name != "plain":
            tomesd.apply_patch(pipe, ratio=RATIO, reuse_steps=2, **({} if parallel else {"bands": world}))
        gen = torch.Generator().manual_seed(5)  # 8 text tokens: diffusers splits them between the ranks too
        out[name] = torch.from_numpy(pipe(
            prompt_embeds=torch.randn(1, 8, 32, generator=gen), pooled_prompt_embeds=torch.randn(1, 32, generator=gen),
            num_inference_steps=3, height=32, width=32, output_type="np", generator=torch.Generator().manual_seed(0),
        ).images)
    return out


def patch_before_parallelism(world: int) -> Dict[str, Any]:
    """apply_patch before enable_parallelism gives what it gives after."""
    out: Dict[str, Any] = {}
    for name, first in (("after", False), ("before", True)):
        model = _flux()
        if first:
            tomesd.apply_patch(model, ratio=RATIO)
        model.enable_parallelism(config=_config("ring", world))
        if not first:
            tomesd.apply_patch(model, ratio=RATIO)
        out[name] = _call(model, _flux_inputs())
    return out


def _refusal(model, inputs: dict) -> str:
    try:
        _call(model, inputs)
    except ValueError as exc:
        return str(exc)
    return "no refusal"


def refusals(world: int) -> Dict[str, Any]:
    """What the band rule cannot serve, refused at the first call, in the user's terms."""
    from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

    out: Dict[str, Any] = {}
    model = _flux()
    model.enable_parallelism(config=_config("ulysses", world, ulysses_anything=True))
    tomesd.apply_patch(model, ratio=RATIO)
    out["ulysses_anything"] = _refusal(model, _flux_inputs())
    model = _flux()
    model.enable_parallelism(config=_config("ulysses", world))
    tomesd.apply_patch(model, mode="downsample")
    out["downsample"] = _refusal(model, _flux_inputs())
    tomesd.remove_patch(model)
    tomesd.apply_patch(model, ratio=RATIO, bands=world + 1)
    out["bands"] = _refusal(model, _flux_inputs())
    # SD3 has no context-parallel plan in diffusers; one that splits its patch tokens is refused by ToMe.
    sd3 = T.transformer("sd3")
    plan = {"pos_embed": {0: ContextParallelInput(split_dim=1, expected_dims=3, split_output=True)},
            "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3)}
    sd3.enable_parallelism(config=_config("ulysses", world), cp_plan=plan)
    tomesd.apply_patch(sd3, ratio=RATIO)
    out["sd3"] = _refusal(sd3, T.transformer_inputs("sd3"))
    return out


def tensor_parallel(world: int) -> Dict[str, Any]:
    """diffusers' tensor parallelism on Flux: ToMe applied before or after enable_parallelism, against one process."""
    from diffusers import TensorParallelConfig

    out: Dict[str, Any] = {}
    model = _flux()
    out["base"] = _call(model, _flux_inputs())
    tomesd.apply_patch(model, ratio=RATIO)
    out["one"] = _call(model, _flux_inputs())
    for name, first in (("after", False), ("before", True)):
        model = _flux()
        if first:
            tomesd.apply_patch(model, ratio=RATIO)
        model.enable_parallelism(config=TensorParallelConfig(tp_degree=world))
        if not first:
            tomesd.apply_patch(model, ratio=RATIO)
        out[name] = _call(model, _flux_inputs())
    return out


def cache_dit_ulysses(world: int) -> Dict[str, Any]:
    """cache-dit's own context parallelism (its copy of diffusers' hooks, its own plans) on Flux, with no step
    cache: ToMe reads cache-dit's config from the model as it reads diffusers', and each rank merges its band."""
    import cache_dit
    from cache_dit import ParallelismConfig

    out: Dict[str, Any] = {}
    base = _flux()
    tomesd.apply_patch(base, ratio=RATIO, bands=world)
    out["bands"] = _call(base, _flux_inputs())
    model = _flux()
    cache_dit.enable_cache(model, parallelism_config=ParallelismConfig(ulysses_size=world))
    tomesd.apply_patch(model, ratio=RATIO)
    tokens = count_tokens({"to_q": model.transformer_blocks[0].attn.to_q})
    out["parallel"] = _call(model, _flux_inputs())
    out[f"tokens/{torch.distributed.get_rank()}"] = tokens()["to_q"]
    return out


def para_attention(world: int) -> Dict[str, Any]:
    """ParaAttention (para-attn) splits Flux's sequence inside a forward it swaps in, keeping its mesh to itself:
    ToMe cannot tell which band a process holds, and refuses at the block that reveals the split."""
    from para_attn.context_parallel import init_context_parallel_mesh
    from para_attn.context_parallel.diffusers_adapters.flux import parallelize_transformer

    model = _flux()
    parallelize_transformer(model, mesh=init_context_parallel_mesh("cpu"))
    out: Dict[str, Any] = {}
    try:  # para-attn 0.3.38 itself fails on diffusers 0.42's attention call (it passes enable_gqa)
        _call(model, _flux_inputs())
        out["unpatched"] = "ran"
    except TypeError as exc:
        out["unpatched"] = str(exc)
    tomesd.apply_patch(model, ratio=RATIO)
    out["refusal"] = _refusal(model, _flux_inputs())
    return out
