"""A stateless, counter-based generator for the random dst choice.

Each draw is a pure function of (seed, counter, position), evaluated with backend integer ops.
So it never touches a framework's global RNG, it is reproducible from an integer seed, and
torch and paddle produce the same values bit for bit: every intermediate stays below 2**62, so
int64 arithmetic is exact on both.
"""
from __future__ import annotations

from typing import Any

from .backend import Backend

_PRIME = 2_147_483_647  # 2**31 - 1
_ROUNDS = ((48_271, 12_345), (69_621, 67_891), (40_692, 24_680))
_MASK64 = (1 << 64) - 1


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def stream_key(seed: int, counter: int) -> int:
    """Mix a seed and a draw counter into one key in [0, 2**31 - 1)."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (counter & _MASK64)) % _PRIME


def randint(xp: Backend, like: Any, n: int, high: int, seed: int, counter: int) -> Any:
    """n integers in [0, high), int64, on the device of `like`."""
    x = (xp.arange(n, like) * 16_807 + stream_key(seed, counter)) % _PRIME
    for mul, add in _ROUNDS:
        x = (x * mul + add) % _PRIME
        x = xp.bitwise_xor(x, x // 65_536)
    return x % high
