"""Drafts from a smaller model: the one drafter that runs a model, so it lives with the runner.

It implements the scheduler's :class:`~treeserve.scheduler.Drafter` protocol; its forwards use
the runner's step-input builder.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from treeserve.kvcache import KVPool, ReqToTokenTable
from treeserve.runner.inputs import build_step_inputs
from treeserve.scheduler import DraftTree

__all__ = ["DraftModelDrafter"]


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
        self.table.write(st.row, st.capacity, self.kv.allocator.alloc(need))
        st.capacity = length
        return True

    @torch.inference_mode()
    def _forward(self, row: int, start: int, ids: list[int]) -> torch.Tensor:
        """Logits after ``ids`` placed at positions ``start..``, their KV written at the row's slots."""
        step = build_step_inputs(self.table.table, [row], [start], [len(ids)], ids, 1, [1])
        logits = self.model(step.input_ids, step.positions, self.kv, step.out_slots, step.meta, step.logits_indices)
        return logits[0]


@dataclass(slots=True)
class _DraftState:
    """Per-request drafter state: table row, committed tokens with KV, slots allocated."""

    row: int
    computed: int = 0
    capacity: int = 0
