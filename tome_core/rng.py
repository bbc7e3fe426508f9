"""A stateless, counter-based generator for the random dst choice.

Every draw is a pure function of (seed, timestep, block, position), evaluated with integer ops on
the tensor's own device. So it never touches a framework's global RNG, never reads a tensor's
value on the host (no sync, nothing a graph compiler must break on), and torch and paddle produce
the same values bit for bit: every intermediate stays below 2**62, so int64 arithmetic is exact
on both.
"""
from __future__ import annotations

import math
import struct
from typing import Any, Sequence, Union

from .backend import Backend

DEFAULT_SEED = 0
_PRIME = 2_147_483_647  # 2**31 - 1
_MULTIPLIERS = (16_807, 48_271, 69_621)  # Lehmer multipliers modulo _PRIME
_MASK64 = (1 << 64) - 1
# Timesteps are keyed at 1/1024 resolution: exact for float32 values below 2**13.
_TIMESTEP_SCALE = 1024

Key = Union[int, Any]  # a Python int, or an int64 tensor that broadcasts against [n]


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def stream_key(seed: int, counter: int) -> int:
    """Mix a seed and a counter into one key in [0, 2**31 - 1)."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (counter & _MASK64)) % _PRIME


def _xor_shift(xp: Backend, x: Key) -> Key:
    return x ^ (x // 65_536) if isinstance(x, int) else xp.bitwise_xor(x, x // 65_536)


def timestep_key(xp: Backend, timestep: Any) -> Key:
    """An integer key from a timestep: a number, or a tensor whose first element is used.

    Computed on the timestep's device (a tensor stays a tensor): floor(t * 1024 + 0.5) in float32,
    the same integer on torch, on paddle and from a Python number.
    """
    if timestep is None:
        return 0
    if isinstance(timestep, (int, float)):
        t32 = struct.unpack("<f", struct.pack("<f", float(timestep)))[0]
        return int((t32 * _TIMESTEP_SCALE + 0.5) // 1) % _PRIME
    return _timestep_count(xp, timestep) % _PRIME


def _timestep_count(xp: Backend, timestep: Any) -> Any:
    """floor(t * 1024 + 0.5) of a timestep tensor's first element, in float32, as an int64 [1], not yet reduced."""
    shape = xp.shape(timestep)
    first = xp.reshape(timestep, [1]) if len(shape) == 0 else xp.reshape(timestep, [-1])[:1]
    return xp.to_int64(xp.floor(xp.to_float32(first) * _TIMESTEP_SCALE + 0.5))


def call_key(xp: Backend, seed: int, timestep: Any) -> Key:
    """The key of one call's draws: a Python int, or a [1] int64 tensor on the timestep's device."""
    if timestep is None or isinstance(timestep, (int, float)):
        return (timestep_key(xp, timestep) * _MULTIPLIERS[2] + stream_key(seed, 0)) % _PRIME
    # timestep_key's reduction left to this one (a launch fewer at every call): the same residue while the product
    # stays below 2**63, |t| < 1.2e11 (timesteps and sigmas are below 1e4; past that the key differs from the
    # Python number's, and stays a deterministic function of t)
    return (_timestep_count(xp, timestep) * _MULTIPLIERS[2] + stream_key(seed, 0)) % _PRIME


def counters(xp: Backend, like: Any, n: int) -> Any:
    """randint's first step for draws of n integers: i * the first multiplier, for each i < n. It depends on n alone,
    so a caller may keep it across calls and hand it to randint."""
    return xp.arange(n, like) * _MULTIPLIERS[0]


def row_counters(xp: Backend, like: Any, n: int, row: Any) -> Any:
    """counters' row `row` of a [rows, n] draw: (row * n + j) times the first multiplier for each j < n, so that a
    draw of one row equals that row of the whole table. `row`: an int, or an int64 tensor (a block's index kept on
    the device, which a graph compiler takes as an input: one graph for every row)."""
    return (xp.arange(n, like) + row * n) * _MULTIPLIERS[0]


def randint(xp: Backend, like: Any, shape: Sequence[int], high: int, key: Key, steps: Any = None) -> Any:
    """Integers in [0, high) of `shape`, int64, on the device of `like`.

    Element i (row-major) is a hash of (key, i): a patch draws one [blocks, cells] table per
    call and level, and block b takes row b, so each block's pattern is a function of
    (seed, timestep, block) at the cost of one draw per call. `steps`: counters(xp, like, prod(shape)), kept
    by the caller (None: made here).
    """
    if steps is None:
        steps = counters(xp, like, math.prod(shape))
    x = (steps + key) % _PRIME
    x = _xor_shift(xp, (x * _MULTIPLIERS[1]) % _PRIME)
    return xp.reshape(x % high, list(shape))
