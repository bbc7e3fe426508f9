"""Patching real models: finding the denoisers in a pipeline, and the hooks that merge tokens."""
