"""Tests load the references the way the benchmark does."""
from tomesd.bench.references import load_tomesd_ref  # noqa: F401
