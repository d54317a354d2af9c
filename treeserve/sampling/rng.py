"""Counter-based random numbers keyed by (request seed, absolute position, purpose, index).

No generator state: a uniform is a pure function of its key, computed with a splitmix64-style
integer hash on int64 tensors (wrapping multiplication, logical shifts emulated with masks).
A seeded request therefore draws the same numbers whatever else is in the batch, after
preemption and under CUDA-graph replay (keys are tensors).
"""

from __future__ import annotations

import enum

import torch


class Purpose(enum.IntEnum):
    """Independent random streams; the value is part of the hash key."""

    SAMPLE = 1  # the token drawn by ``sample`` (and verify's bonus/residual token)
    ACCEPT = 2  # verify's accept/reject coin for one draft node
    DRAFT = 3  # a drafter's sampled draft token (sibling index as the index)


def _signed(x: int) -> int:
    """The int64 with the same low 64 bits as ``x``."""
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN = 0x9E3779B97F4A7C15
_M1 = _signed(0xBF58476D1CE4E5B9)
_M2 = _signed(0x94D049BB133111EB)
_SALT = tuple(_signed(i * _GOLDEN) for i in (1, 2))


def _lsr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    z = (z ^ _lsr(z, 30)) * _M1
    z = (z ^ _lsr(z, 27)) * _M2
    return z ^ _lsr(z, 31)


def hash_key(seed: torch.Tensor, position: torch.Tensor, purpose: int, index: torch.Tensor | int = 0) -> torch.Tensor:
    """64-bit hash (as int64) of the key; arguments broadcast together."""
    h = _mix(seed.to(torch.int64) + _SALT[0])
    h = _mix(h ^ (position.to(torch.int64) + _SALT[1]))
    idx = index.to(torch.int64) if isinstance(index, torch.Tensor) else index
    return _mix(h ^ (idx + _signed((int(purpose) << 40) + 3 * _GOLDEN)))


def uniform(seed: torch.Tensor, position: torch.Tensor, purpose: int, index: torch.Tensor | int = 0) -> torch.Tensor:
    """Float64 uniforms in [0, 1) (53 random bits) for the broadcast key; exact multiples of 2**-53."""
    bits = _lsr(hash_key(seed, position, purpose, index), 11)
    return bits.to(torch.float64) * (2.0**-53)
