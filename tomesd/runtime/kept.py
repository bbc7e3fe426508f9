"""What a patch keeps across eager calls per input size and device, for at most `limit` recent ones.

A server runs one patch for weeks over every size its users ask for. Index constants (tome_core's memo: partition
and matching tables, coordinate cells, the random draw's counters) and each block's plan depend on the size alone, so
they are kept between calls, but per size: the least recently used size's are dropped once more than `limit` sizes
have been seen, and rebuilt (the same values) when it comes back.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Dict, Hashable


class SizeKept:
    """One size's constants: `memo` (tome_core's index constants, CallState.memo) and `plans` (the matcher's plans)."""

    __slots__ = ("memo", "plans")

    def __init__(self) -> None:
        self.memo: Dict[Any, Any] = {}
        self.plans: Dict[Any, Any] = {}


class KeptBySize:
    """SizeKept per size and device, the `limit` most recently used ones."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._sizes: "OrderedDict[Hashable, SizeKept]" = OrderedDict()
        self._lock = threading.Lock()

    def of(self, key: Hashable) -> SizeKept:
        """The constants of the size `key` (its latent's shape and device), made empty at its first call."""
        with self._lock:  # calls from several threads at once
            sizes = self._sizes
            kept = sizes.get(key)
            if kept is None:
                kept = sizes[key] = SizeKept()
                if len(sizes) > self.limit:
                    sizes.popitem(last=False)
            else:
                sizes.move_to_end(key)
            return kept

    def __getstate__(self) -> dict:
        return {"limit": self.limit}  # a copy keeps no constants (they are rebuilt) and has a lock of its own

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["limit"])

    def __len__(self) -> int:
        return len(self._sizes)

    def clear(self) -> None:
        self._sizes.clear()
