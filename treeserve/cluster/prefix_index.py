"""An approximate per-replica prefix tree over token ids, for routing (no Ray, no engine).

The router cannot see the replicas' radix trees, so it keeps its own guess of what each one
caches: every prompt it routed, cut into blocks of ``block_tokens`` token ids, each block keyed by
a hash chained over all blocks before it (a path in a prefix tree, one dict lookup per block). A
replica's entries are kept in LRU order up to ``capacity_tokens`` (its KV pool), ancestors always
at least as recent as their descendants, so eviction drops leaves first, as the radix tree does.

It is approximate by design: the partial last block is ignored, a replica's own evictions and
restarts are not seen (a restarted replica has a new id and starts empty), and a hash collision
(64-bit) could claim a match that is not there. A wrong guess costs a recomputed prefix, never a
wrong answer: the replica's radix tree decides what is reused.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence

__all__ = ["PrefixIndex"]


class PrefixIndex:
    """Which replica most likely caches the longest prefix of a prompt.

    ``insert(ids, replica)`` records that ``replica`` was sent ``ids``; ``match(ids)`` returns, for
    every replica holding at least one block of it, the length in tokens (a multiple of
    ``block_tokens``) of the prefix it holds. ``match`` is read-only (LRU order unchanged).
    Invariant (``check_invariants``): every block of a replica is in its LRU and vice versa, and no
    replica holds more than ``capacity_tokens // block_tokens`` blocks.
    """

    def __init__(self, block_tokens: int = 16, capacity_tokens: int = 32768) -> None:
        if not isinstance(block_tokens, int) or block_tokens < 1:
            raise ValueError(f"block_tokens must be an int >= 1, got {block_tokens!r}")
        if not isinstance(capacity_tokens, int) or capacity_tokens < block_tokens:
            raise ValueError(f"capacity_tokens must be an int >= block_tokens ({block_tokens}), got {capacity_tokens!r}")
        self.block_tokens = block_tokens
        self.capacity_tokens = capacity_tokens
        self._holders: dict[int, set[Hashable]] = {}  # block key -> replicas holding it
        self._lru: dict[Hashable, OrderedDict[int, None]] = {}  # replica -> its block keys, oldest first

    def _keys(self, ids: Sequence[int]) -> list[int]:
        b = self.block_tokens
        keys, h = [], 0
        for start in range(0, len(ids) - b + 1, b):
            h = hash((h, tuple(ids[start : start + b])))
            keys.append(h)
        return keys

    @property
    def replicas(self) -> list[Hashable]:
        return list(self._lru)

    def cached_tokens(self, replica: Hashable) -> int:
        """Tokens this index believes ``replica`` caches (0 for an unknown replica)."""
        lru = self._lru.get(replica)
        return len(lru) * self.block_tokens if lru else 0

    def match(self, ids: Sequence[int]) -> dict[Hashable, int]:
        """Replica -> tokens of the longest prefix of ``ids`` it holds (replicas holding none omitted)."""
        out: dict[Hashable, int] = {}
        alive: set[Hashable] | None = None
        for depth, key in enumerate(self._keys(ids), 1):
            holders = self._holders.get(key, set())
            alive = set(holders) if alive is None else alive & holders
            if not alive:
                break
            for r in alive:
                out[r] = depth * self.block_tokens
        return out

    def insert(self, ids: Sequence[int], replica: Hashable) -> None:
        """Record ``ids`` as cached by ``replica``; evict its least recently used blocks past capacity."""
        lru = self._lru.setdefault(replica, OrderedDict())
        for key in reversed(self._keys(ids)):  # the root last: ancestors are the most recent
            self._holders.setdefault(key, set()).add(replica)
            lru[key] = None
            lru.move_to_end(key)
        limit = self.capacity_tokens // self.block_tokens
        while len(lru) > limit:
            key, _ = lru.popitem(last=False)
            self._drop(key, replica)

    def remove_replica(self, replica: Hashable) -> None:
        """Forget ``replica`` (gone or restarted with an empty cache); unknown replicas are ignored."""
        for key in self._lru.pop(replica, OrderedDict()):
            self._drop(key, replica)

    def retain(self, replicas: Iterable[Hashable]) -> None:
        """Forget every replica not in ``replicas``."""
        keep = set(replicas)
        for r in [r for r in self._lru if r not in keep]:
            self.remove_replica(r)

    def _drop(self, key: int, replica: Hashable) -> None:
        holders = self._holders[key]
        holders.discard(replica)
        if not holders:
            del self._holders[key]

    def check_invariants(self) -> None:
        limit = self.capacity_tokens // self.block_tokens
        seen: dict[int, set[Hashable]] = {}
        for r, lru in self._lru.items():
            if len(lru) > limit:
                raise AssertionError(f"replica {r!r} holds {len(lru)} blocks, more than its {limit}")
            for key in lru:
                seen.setdefault(key, set()).add(r)
        if seen != self._holders:
            raise AssertionError("block holders disagree with the replicas' LRU lists")
