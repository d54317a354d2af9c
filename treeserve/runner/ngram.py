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


# An edit's kinds (``NgramDrafter`` with ``edits``), in order of preference between alignments that
# hold as many tokens.
_INSERTED, _REPLACED, _DROPPED = 0, 1, 2


def _edit_pairs(L: int, q: int, kind: int, count: int) -> list[tuple[int, int]]:
    """The first ``count`` (tail index, offset from the continuation start) pairs an alignment
    with one edit of ``kind`` at ``q`` tokens from the end compares, from the end back
    (:meth:`NgramDrafter._edit_starts`)."""
    pairs = [(L - 1 - i, -1 - i) for i in range(min(q - 1, count))]
    skip_tail, skip_src = {_INSERTED: (1, 0), _REPLACED: (1, 1), _DROPPED: (0, 1)}[kind]
    for i in range(count - len(pairs)):
        pairs.append((L - q - skip_tail - i, -q - skip_src - i))
    return pairs


def _edits(min_n: int) -> list[tuple[int, int]]:
    """The (q, kind) edits tried: up to ``min_n`` tokens from the end; a dropped token needs a
    token after it."""
    return [(q, k) for q in range(1, min_n + 1) for k in (_INSERTED, _REPLACED, _DROPPED) if k != _DROPPED or q > 1]


class NgramDrafter:
    """Prompt lookup: find earlier occurrences of the last ``n`` tokens (``max_n`` down to
    ``min_n``) in the request's own prompt and output, and propose what followed them.

    ``width == 1`` proposes a chain (the continuation of the most recent match); ``width > 1``
    merges the continuations of up to ``width`` most recent distinct matches, each cut to
    ``max_tokens // matches`` tokens, into a tree (shared prefixes become one path, divergences
    siblings), at most ``max_tokens`` nodes in all.

    ``edits`` (default on): where no n-gram of ``min_n`` tokens or more matches, the tail is
    aligned with an earlier occurrence up to one edit: a token the output inserted, replaced or
    dropped (a rewrite that adds a comma, or changes one word, of the text it copies), at most
    ``min_n`` tokens from the end (an edit further back leaves an exact n-gram after it). The
    alignment needs ``max(2, min_n)`` matching tokens, at least one of them before the edit;
    alignments rank by matching tokens (counted up to ``max_n``), then kind (inserted, replaced,
    dropped), then recency (:meth:`_edit_starts`). Plain prompt lookup after a rewrite's edit
    finds nothing until ``min_n`` tokens past it, or a wrong occurrence of a common n-gram.
    """

    stateless = True  # may draft past uncommitted (jump-forward) tokens: see fill_drafts

    def __init__(self, max_n: int = 4, min_n: int = 2, width: int = 1, edits: bool = True) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n} max_n={max_n}")
        if width < 1:
            raise ValueError(f"width must be >= 1, got {width}")
        if not isinstance(edits, bool):
            raise TypeError(f"edits must be a bool, got {edits!r}")
        self.max_n, self.min_n, self.width, self.edits = max_n, min_n, width, edits

    def release(self, key: int) -> None:
        """Stateless: nothing to free."""

    def propose_batch(self, requests: Sequence[DraftRequest]) -> list[DraftTree | None]:
        """One :meth:`propose` per request."""
        return [self.propose(r.key, r.tokens, r.max_tokens) for r in requests]

    def propose(self, key: int, tokens: Sequence[int], max_tokens: int) -> DraftTree | None:
        """At most ``max_tokens`` nodes continuing ``tokens`` (None: no n-gram matched, nor, with
        ``edits``, a one-edit alignment)."""
        if max_tokens <= 0 or len(tokens) < self.min_n + 1:
            return None
        arr = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.max_n, len(arr) - 1), self.min_n - 1, -1):
            starts = self._match_starts(arr, n)
            if starts.size:
                return self._draft(arr, starts + n, max_tokens)
        if self.edits:
            starts = self._edit_starts(arr)
            if starts.size:
                return self._draft(arr, starts, max_tokens)
        return None

    def _draft(self, arr: np.ndarray, starts: np.ndarray, max_tokens: int) -> DraftTree:
        """The tree of the continuations at ``starts`` (best first, each ``< len(arr)``: none is
        empty, so the best is always kept)."""
        conts = self._continuations(arr, starts, max_tokens)
        depth = max(1, max_tokens // len(conts))  # split the budget between branches
        return self._merge([c[:depth] for c in conts], max_tokens)

    @staticmethod
    def _match_starts(arr: np.ndarray, n: int) -> np.ndarray:
        """Start indices ``i < len - n`` with ``arr[i:i+n] == arr[-n:]``, most recent first."""
        tail = arr[-n:]
        cand = np.flatnonzero(arr[: len(arr) - n] == tail[0])
        for j in range(1, n):
            cand = cand[arr[cand + j] == tail[j]]
        return cand[::-1]

    def _edit_starts(self, arr: np.ndarray) -> np.ndarray:
        """Continuation starts ``e <= len - 2``, best first, where the tail aligns with the tokens
        before ``e`` up to one edit ``q <= min_n`` tokens from the end (``L = len(arr)``; the last
        ``q - 1`` tokens match ``arr[e - q + 1 : e]``, then going back):

        - inserted: ``arr[L - q]`` has no counterpart; ``arr[L - q - 1 - i] == arr[e - q - i]``;
        - replaced: ``arr[L - q]`` stands for ``arr[e - q]``; ``arr[L - q - 1 - i] == arr[e - q - 1 - i]``;
        - dropped (``q >= 2``): ``arr[e - q]`` has no counterpart; ``arr[L - q - i] == arr[e - q - 1 - i]``.

        Each alignment holds its consecutive matching pairs from the end, ``max(2, min_n)`` at least
        (so at least one before the edit; none where ``max_n`` is 1), counted up to ``max_n``."""
        L, need = len(arr), max(2, self.min_n)
        equal: dict[int, np.ndarray] = {}  # tail index -> arr == arr[index]
        found: list[tuple[np.ndarray, np.ndarray, int]] = []  # (starts, matching tokens, kind)
        for q, kind in _edits(self.min_n):
            pairs = [p for p in _edit_pairs(L, q, kind, self.max_n) if p[0] >= 0]
            if len(pairs) < need:
                continue
            lo, hi = max(0, -min(o for _, o in pairs[:need])), L - 2
            if hi < lo:
                continue
            mask = None
            for t, o in pairs[:need]:
                if t not in equal:
                    equal[t] = arr == arr[t]
                part = equal[t][lo + o : hi + 1 + o]
                mask = part if mask is None else mask & part
            starts = np.flatnonzero(mask) + lo
            if not starts.size:
                continue
            held = np.full(starts.size, need, dtype=np.int64)
            alive = np.ones(starts.size, dtype=bool)
            for t, o in pairs[need:]:
                at = starts + o
                alive &= at >= 0
                alive[alive] = arr[at[alive]] == arr[t]
                held += alive
            found.append((starts, held, kind))
        if not found:
            return np.zeros(0, dtype=np.int64)
        if len(found) == 1 and found[0][0].size == 1:
            return found[0][0]
        starts = np.concatenate([f[0] for f in found])
        held = np.concatenate([f[1] for f in found])
        kinds = np.concatenate([np.full(f[0].size, f[2]) for f in found])
        ranked = starts[np.lexsort((-starts, kinds, -held))]  # most tokens held, then kind, then most recent
        first = np.unique(ranked, return_index=True)[1]  # each start at its best rank
        return ranked[np.sort(first)]

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
