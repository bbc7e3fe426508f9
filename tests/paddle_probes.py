"""A host-read spy for paddle (it has no dispatcher to count on): every Tensor method that reads a value on
the host records the read, and whether ToMe's own code (tomesd, tome_core) made it."""
import os
import sys

import paddle

import tome_core
import tomesd

_HOST_READS = ("numpy", "item", "tolist", "__array__", "__bool__", "__float__", "__int__", "__index__")
_OURS = tuple(os.path.dirname(m.__file__) + os.sep for m in (tomesd, tome_core))
_PADDLE = os.path.dirname(paddle.__file__) + os.sep


def count_host_reads(monkeypatch, fn):
    """Run fn with every host read of a paddle Tensor recorded: (all reads, reads from our code)."""
    reads, ours = [], []

    def spy(name, original):
        def method(self, *args, **kwargs):
            reads.append(name)
            # The read is whoever called it outside paddle itself: ours only if that frame is ToMe's (a
            # scheduler's own read inside a step the clock wraps is the scheduler's, not the clock's).
            frame = sys._getframe(1)
            while frame is not None and frame.f_code.co_filename.startswith(_PADDLE):
                frame = frame.f_back
            if frame is not None and frame.f_code.co_filename.startswith(_OURS):
                ours.append((name, frame.f_code.co_filename, frame.f_lineno))
            return original(self, *args, **kwargs)

        return method

    with monkeypatch.context() as m:
        for name in _HOST_READS:
            m.setattr(paddle.Tensor, name, spy(name, getattr(paddle.Tensor, name)))
        paddle.zeros([1]).item()
        assert reads == ["item"], reads  # the spies see reads
        reads.clear()
        fn()
    return reads, ours
