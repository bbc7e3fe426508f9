import pytest


@pytest.fixture
def no_added_host_reads():
    """`check(run)`: runs `run()` (whose model was just patched) and asserts it read on the host as many tensor
    values as `run()` did before the test patched anything (the host's own reads: a scheduler's, a pipeline's).
    The baseline is given with `check.baseline(run)` before patching. Counted by the dispatcher
    (aten._local_scalar_dense), so a read anywhere in the run is caught, not only the backend's."""
    from probes import count_host_reads

    state = {}

    def baseline(run):
        out, state["reads"] = count_host_reads(run)
        return out

    def check(run):
        out, reads = count_host_reads(run)
        assert reads == state["reads"], f"the patch added {reads - state['reads']} host reads of tensor values"
        return out

    check.baseline = baseline
    return check
