"""Tests load the references the way the benchmark does."""
from tomesd.bench.kits.references import load_tomesd_ref  # noqa: F401
