"""The benchmark behind `python -m tomesd bench`."""
