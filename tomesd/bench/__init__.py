"""The benchmark behind `python -m tomesd bench`: here the command (cli.py, its options in arguments.py and
options.py, progress.py) and its runs beyond the loop bench (gpu_report.py, pipeline.py, comfyui.py,
context_parallel.py); kits/ how each framework builds and runs a model; measures/ what the loop bench measures
and how it is reported."""
