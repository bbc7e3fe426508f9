"""A progress bar on stderr: tqdm's where it is installed, else one that shows nothing."""
from __future__ import annotations

import sys


class _NoBar:
    """Stands in for tqdm's progress bar when tqdm is not installed."""

    def __enter__(self) -> "_NoBar":
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def update(self, n: int = 1) -> None:
        pass

    def set_description(self, text: str) -> None:
        pass


def progress_bar(total: int, desc: str) -> object:
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, desc=desc, unit="fwd", file=sys.stderr, disable=None)
