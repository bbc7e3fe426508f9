"""What each host adds around the runtime: which models of a user's object are denoisers and how they are patched
(targets.py: diffusers and ppdiffusers pipelines, bare models, the LDM code), pipelines that join reference tokens
after the target's (references.py), ppdiffusers' pipe.apply_tome() (ppdiffusers.py) and ComfyUI's model patcher
(comfyui_patcher.py; the node pack is tomesd/comfyui/)."""
