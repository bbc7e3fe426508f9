"""How the benchmark builds and runs a model on each framework: the architectures it builds from their configs
with random weights (configs.py), the kit each framework supplies on a shared base (kit_base.py, torch_kit.py,
paddle_kit.py; pick.py's make_kit picks one by name), the reference implementations the torch kit loads so they
never shadow this project's `tomesd` (references.py), and diffusers' step caches a kit runs beside ToMe
(caches.py). Nothing here imports the rest of the benchmark."""
