"""Drafters for speculative decoding: propose a token tree after a request's last token.

A draft is a :class:`DraftTree`: node ``k`` holds ``tokens[k]`` and its parent ``parents[k]``
(``-1`` = the request's last token, ``parents[k] < k``); a chain has ``parents == [-1, 0, 1, ...]``.
Drafters are deterministic (point-mass drafts) unless they return ``probs``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from treeserve.kvcache import AttentionMetadata, KVPool, ReqToTokenTable


@dataclass(slots=True)
class DraftTree:
    """Draft nodes in topological order; ``probs [n, V]`` the laws they were drawn from, or None."""

    tokens: list[int]
    parents: list[int]
    probs: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise ValueError(f"tokens ({len(self.tokens)}) and parents ({len(self.parents)}) differ in length")
        for k, p in enumerate(self.parents):
            if not -1 <= p < k:
                raise ValueError(f"parents[{k}] = {p} must lie in [-1, {k - 1}]")

    def __len__(self) -> int:
        return len(self.tokens)

    def depths(self) -> list[int]:
        """Depth of each node (children of the root have depth 1)."""
        d: list[int] = []
        for p in self.parents:
            d.append(1 if p < 0 else d[p] + 1)
        return d


class Drafter(Protocol):
    """Proposes at most ``max_tokens`` draft nodes continuing ``tokens`` (None or empty: no draft).

    ``key`` identifies the request across steps (drafters with per-request state key it on
    this); ``release(key)`` is called when the request stops running (finished or paused).
    """

    def propose(self, key: int, tokens: Sequence[int], max_tokens: int) -> DraftTree | None: ...

    def release(self, key: int) -> None: ...


class NgramDrafter:
    """Prompt lookup: find earlier occurrences of the last ``n`` tokens (``max_n`` down to
    ``min_n``) in the request's own prompt and output, and propose what followed them.

    ``width == 1`` proposes a chain (the continuation of the most recent match); ``width > 1``
    merges the continuations of up to ``width`` most recent distinct matches, each cut to
    ``max_tokens // matches`` tokens, into a tree (shared prefixes become one path, divergences
    siblings), at most ``max_tokens`` nodes in all.
    """

    def __init__(self, max_n: int = 4, min_n: int = 2, width: int = 1) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n} max_n={max_n}")
        if width < 1:
            raise ValueError(f"width must be >= 1, got {width}")
        self.max_n, self.min_n, self.width = max_n, min_n, width

    def release(self, key: int) -> None:
        """Stateless: nothing to free."""

    def propose(self, key: int, tokens: Sequence[int], max_tokens: int) -> DraftTree | None:
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


class DraftModelDrafter:
    """Greedy drafts from a smaller model that shares the tokenizer, over its own paged KV.

    ``model`` follows the runner's model contract (``treeserve.models.LlamaForCausalLM``, e.g. a
    layer-truncated copy of the target for self-speculation); ``kv`` is its pool (page size 1).
    Chain (``width == 1``): the draft model's argmax continuation. Tree: the root's top-``width``
    tokens as siblings, the most likely one extended greedily. Deterministic, so verification
    uses the point-mass form.

    KV: each request gets a row of the drafter's own table. Only committed tokens count as
    computed: KV written for draft tokens is rolled back by simply being recomputed (overwritten)
    at the next call, which also gives a fully accepted chain its extra decode step. When the
    drafter's pool is full it proposes nothing (the request decodes plainly).
    """

    def __init__(self, model: Any, kv: KVPool, max_requests: int, max_len: int, width: int = 1) -> None:
        if kv.page_size != 1:
            raise ValueError(f"the draft KV pool must have page_size 1, got {kv.page_size}")
        if width < 1:
            raise ValueError(f"width must be >= 1, got {width}")
        self.model, self.kv, self.width = model, kv, width
        self.table = ReqToTokenTable(max_requests, max_len, device=kv.device)
        self._state: dict[int, _DraftState] = {}

    def release(self, key: int) -> None:
        st = self._state.pop(key, None)
        if st is None:
            return
        if st.capacity:
            self.kv.allocator.free(self.table.table[st.row, : st.capacity].clone())
        self.table.free(st.row)

    def propose(self, key: int, tokens: Sequence[int], max_tokens: int) -> DraftTree | None:
        n = len(tokens)
        if max_tokens <= 0 or n + max_tokens > self.table.max_context_len:
            return None
        st = self._state.get(key)
        if st is None:
            if self.table.num_free == 0:
                return None
            st = self._state[key] = _DraftState(self.table.alloc())
        if not self._reserve(st, n + max_tokens):
            return None
        logits = self._forward(st.row, st.computed, list(tokens[st.computed :]))
        st.computed = n  # draft tokens' KV beyond this is overwritten by the next catch-up
        top = torch.topk(logits, min(self.width, max_tokens)).indices.tolist()
        chain = top[:1]
        for _ in range(max_tokens - len(top)):
            chain.append(int(self._forward(st.row, n + len(chain) - 1, chain[-1:]).argmax()))
        ext = chain[1:]
        parents = [-1] * len(top) + [0 if i == 0 else len(top) + i - 1 for i in range(len(ext))]
        return DraftTree(top + ext, parents)

    def _reserve(self, st: _DraftState, length: int) -> bool:
        need = length - st.capacity
        if need <= 0:
            return True
        if self.kv.allocator.num_free < need:
            return False
        self.table.table[st.row, st.capacity : length] = self.kv.allocator.alloc(need)
        st.capacity = length
        return True

    @torch.inference_mode()
    def _forward(self, row: int, start: int, ids: list[int]) -> torch.Tensor:
        """Logits after ``ids`` placed at positions ``start..``, their KV written at the row's slots."""
        q = len(ids)
        dev = self.kv.device
        table = self.table.table
        meta = AttentionMetadata.build([q], [start + q], table[row : row + 1, : start + q], 1, device=dev)
        logits = self.model(
            torch.tensor(ids, dtype=torch.long, device=dev),
            torch.arange(start, start + q, device=dev),
            self.kv,
            table[row, start : start + q],
            meta,
            torch.tensor([q - 1], device=dev),
        )
        return logits[0]


@dataclass(slots=True)
class _DraftState:
    """Per-request drafter state: table row, committed tokens with KV, slots allocated."""

    row: int
    computed: int = 0
    capacity: int = 0
