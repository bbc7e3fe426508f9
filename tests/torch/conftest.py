import pytest


@pytest.fixture
def no_host_reads(monkeypatch):
    """Any host read of a tensor value through the torch backend fails the test."""
    from tomesd.backends.torch import TorchBackend

    def refuse(self, x):
        raise AssertionError("a tensor value was read on the host")

    monkeypatch.setattr(TorchBackend, "host_float", refuse)
