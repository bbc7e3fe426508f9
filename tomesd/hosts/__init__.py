"""What each host adds around the runtime: which models of a user's object are denoisers and how they are patched
(targets.py: diffusers and ppdiffusers pipelines, bare models, the LDM code's .model.diffusion_model), pipelines that
join reference tokens after the target's (references.py) and ComfyUI's model patcher (comfyui_patcher.py). The
front-ends over the public API sit above it: ppdiffusers' pipe.apply_tome() (tomesd/apply_tome.py) and ComfyUI's node
pack (tomesd/comfyui/)."""
