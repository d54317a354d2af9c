"""Prompt-lookup (n-gram) drafting: no model, just the request's own tokens.

Implements :class:`~treeserve.runner.drafting.Drafter`; the engine runs it through
:func:`~treeserve.runner.drafting.fill_drafts` like the draft model, so the scheduler never
calls a drafter.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from treeserve.runner.drafting import DraftRequest
from treeserve.scheduler import DraftTree

__all__ = ["NgramDrafter"]


class NgramDrafter:
    """Prompt lookup: find earlier occurrences of the last ``n`` tokens (``max_n`` down to
    ``min_n``) in the request's own prompt and output, and propose what followed them.

    ``width == 1`` proposes a chain (the continuation of the most recent match); ``width > 1``
    merges the continuations of up to ``width`` most recent distinct matches, each cut to
    ``max_tokens // matches`` tokens, into a tree (shared prefixes become one path, divergences
    siblings), at most ``max_tokens`` nodes in all.
    """

    stateless = True  # may draft past uncommitted (jump-forward) tokens: see fill_drafts

    def __init__(self, max_n: int = 4, min_n: int = 2, width: int = 1) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n} max_n={max_n}")
        if width < 1:
            raise ValueError(f"width must be >= 1, got {width}")
        self.max_n, self.min_n, self.width = max_n, min_n, width

    def release(self, key: int) -> None:
        """Stateless: nothing to free."""

    def propose_batch(self, requests: Sequence[DraftRequest]) -> list[DraftTree | None]:
        """One :meth:`propose` per request."""
        return [self.propose(r.key, r.tokens, r.max_tokens) for r in requests]

    def propose(self, key: int, tokens: Sequence[int], max_tokens: int) -> DraftTree | None:
        """At most ``max_tokens`` nodes continuing ``tokens`` (None: no n-gram matched)."""
        if max_tokens <= 0 or len(tokens) < self.min_n + 1:
            return None
        arr = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.max_n, len(arr) - 1), self.min_n - 1, -1):
            starts = self._match_starts(arr, n)
            if starts.size:
                conts = self._continuations(arr, starts + n, max_tokens)
                if conts:
                    depth = max(1, max_tokens // len(conts))  # split the budget between branches
                    return self._merge([c[:depth] for c in conts], max_tokens)
        return None

    @staticmethod
    def _match_starts(arr: np.ndarray, n: int) -> np.ndarray:
        """Start indices ``i < len - n`` with ``arr[i:i+n] == arr[-n:]``, most recent first."""
        tail = arr[-n:]
        cand = np.flatnonzero(arr[: len(arr) - n] == tail[0])
        for j in range(1, n):
            cand = cand[arr[cand + j] == tail[j]]
        return cand[::-1]

    def _continuations(self, arr: np.ndarray, ends: np.ndarray, max_tokens: int) -> list[list[int]]:
        conts: list[list[int]] = []
        seen: set[tuple[int, ...]] = set()
        for e in ends:
            cont = arr[e : e + max_tokens].tolist()
            key = tuple(cont)
            if cont and key not in seen:
                seen.add(key)
                conts.append(cont)
                if len(conts) == self.width:
                    break
        return conts

    @staticmethod
    def _merge(conts: list[list[int]], max_tokens: int) -> DraftTree:
        tokens: list[int] = []
        parents: list[int] = []
        children: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
        for cont in conts:
            parent = -1
            for t in cont:
                node = children.get((parent, t))
                if node is None:
                    if len(tokens) == max_tokens:
                        break
                    node = len(tokens)
                    tokens.append(t)
                    parents.append(parent)
                    children[(parent, t)] = node
                parent = node
        return DraftTree(tokens, parents)
