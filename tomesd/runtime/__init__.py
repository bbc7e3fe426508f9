"""The runtime that patches a denoiser in place, reversibly, by hooks on its sub-layers, from its family's entries
(tomesd/families/): the patch's lifecycle (tome_patch.py), where hooks go (install.py), the hooks themselves
(sites.py, span_sites.py, downsample_sites.py, key_masks.py, key_weights.py, unmerge_at.py), each block's matching in
a call (matcher.py, over calls.py's per-call state), reuse across steps (reuse.py, clock.py, restore.py), refusals
(guards.py) and inspection (observe.py). The hot path, what runs per block per step, is sites.py, span_sites.py,
downsample_sites.py and matcher.py."""
