"""Node of the radix prefix tree and the small key helpers the tree walk uses."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable

import torch

__all__ = ["RadixNode", "child_key", "common_prefix_len"]


@dataclass(slots=True, eq=False)
class RadixNode:
    """One edge of the radix tree: ``key`` tokens whose KV lives at ``value`` slots.

    Opaque to callers (they get nodes from ``match_prefix`` and pass them to ``lock``). Invariants
    kept by ``RadixCache``: ``len(key) == len(value)`` is a positive multiple of the page size, the
    slots cover whole pages, ``value`` is a tensor the tree owns (never a view of caller memory),
    ``lock_ref`` counts live locks on this node or below, ``parent is None`` once evicted.
    """

    key: tuple[int, ...]
    value: torch.Tensor
    parent: RadixNode | None
    serial: int
    children: dict[Hashable, RadixNode] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0

    def __repr__(self) -> str:  # the default would print the whole subtree through children
        return f"RadixNode(serial={self.serial}, tokens={len(self.key)}, lock_ref={self.lock_ref})"


def child_key(key: tuple[int, ...], pos: int, page_size: int) -> Hashable:
    """Dict key of the child edge starting at ``key[pos]``: the first token, or the first page."""
    return key[pos] if page_size == 1 else key[pos : pos + page_size]


def common_prefix_len(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """Length of the longest common prefix of ``a`` and ``b``.

    Bisects with slice comparisons (done in C), so the cost is O(len) C work plus O(log len)
    Python steps instead of one Python step per token.
    """
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo
