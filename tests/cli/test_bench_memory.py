"""The bench's CPU peak-memory probes: a process per configuration, forked from one server that imported the
framework once; a probe that fails is reported with the configuration it was measuring."""
import pytest

from tomesd.bench.measures.memory import measure_cpu_memory
from tomesd.bench.measures.runner import Row, Settings


def test_a_probe_that_fails_names_its_configuration_and_the_cause():
    settings = Settings(config="no-such-config", res=64, ratios=(0.5,), repeats=1, warmup=0)
    with pytest.raises(RuntimeError, match=r"(?s)memory probe failed for tome 0\.5:.*no-such-config"):
        measure_cpu_memory(settings, [Row("tome", 0.5)])
