"""Drafts from a smaller model: the drafter that runs a model, so it lives with the runner.

It implements :class:`~treeserve.runner.drafting.Drafter`; all requests of a step are drafted
together (one batched forward per draft depth) with the runner's step-input builder.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from treeserve.kvcache import KVPool, ReqToTokenTable
from treeserve.runner.drafting import DraftRequest
from treeserve.runner.inputs import build_step_inputs
from treeserve.scheduler import DraftTree

__all__ = ["DraftModelDrafter"]


class DraftModelDrafter:
    """Greedy drafts from a smaller model that shares the tokenizer, over its own paged KV.

    ``model`` follows the runner's model contract (``treeserve.models.LlamaForCausalLM``, e.g. a
    layer-truncated copy of the target for self-speculation); ``kv`` is its pool (page size 1;
    sized by :func:`~treeserve.runner.drafting.draft_pool_tokens`). Chain (``width == 1``): the
    draft model's argmax continuation. Tree: the root's top-``width`` tokens as siblings, the
    most likely one extended greedily. Deterministic, so verification uses the point-mass form.

    KV: each request gets a row of the drafter's own table. Only committed tokens count as
    computed: KV written for draft tokens is rolled back by simply being recomputed (overwritten)
    at the next call, which also gives a fully accepted chain its extra decode step. A request
    whose slots cannot be had (pool or table full) gets no draft (it decodes plainly).
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
        """The draft of one request (:meth:`propose_batch` of one)."""
        return self.propose_batch([DraftRequest(key, tokens, max_tokens)])[0]

    @torch.inference_mode()
    def propose_batch(self, requests: Sequence[DraftRequest]) -> list[DraftTree | None]:
        """Draft every request that gets slots: one forward catches each up on its committed
        tokens (logits of its last one), then one batched forward per further chain depth."""
        live = [(i, r, st) for i, r in enumerate(requests) if (st := self._slots(r)) is not None]
        drafts: list[DraftTree | None] = [None] * len(requests)
        if not live:
            return drafts
        # Catch up: a request's tokens after its computed ones (at least its last token again).
        starts = [min(st.computed, len(r.tokens) - 1) for _, r, st in live]
        ids = [t for (_, r, _), s in zip(live, starts) for t in r.tokens[s:]]
        logits = self._forward([st.row for *_, st in live], starts, [len(r.tokens) - s for (_, r, _), s in zip(live, starts)], ids)
        widths = [min(self.width, r.max_tokens) for _, r, _ in live]
        top = torch.topk(logits, max(widths)).indices.tolist()
        chains = [[row[0]] for row in top]
        for _, r, st in live:
            st.computed = len(r.tokens)  # draft tokens' KV beyond this is overwritten next time
        # Extend each chain greedily until it has max_tokens - width + 1 tokens.
        while True:
            going = [j for j, (_, r, _) in enumerate(live) if len(chains[j]) < r.max_tokens - widths[j] + 1]
            if not going:
                break
            rows = [live[j][2].row for j in going]
            pos = [len(live[j][1].tokens) + len(chains[j]) - 1 for j in going]
            nxt = self._forward(rows, pos, [1] * len(going), [chains[j][-1] for j in going]).argmax(-1).tolist()
            for j, t in zip(going, nxt):
                chains[j].append(t)
        for j, (i, _, _) in enumerate(live):
            w, ext = widths[j], chains[j][1:]
            parents = [-1] * w + [0 if e == 0 else w + e - 1 for e in range(len(ext))]
            drafts[i] = DraftTree(top[j][:w] + ext, parents)
        return drafts

    def _slots(self, r: DraftRequest) -> _DraftState | None:
        """The request's state with slots for ``tokens`` plus ``max_tokens`` drafts, or None."""
        length = len(r.tokens) + r.max_tokens
        if r.max_tokens <= 0 or length > self.table.max_context_len:
            return None
        st = self._state.get(r.key)
        if st is None:
            if self.table.num_free == 0:
                return None
            st = self._state[r.key] = _DraftState(self.table.alloc())
        need = length - st.capacity
        if need > 0:
            if self.kv.allocator.num_free < need:
                return None
            self.table.write(st.row, st.capacity, self.kv.allocator.alloc(need))
            st.capacity = length
        return st

    def _forward(self, rows: list[int], starts: list[int], lens: list[int], ids: list[int]) -> torch.Tensor:
        """Logits ``[B, V]`` after each request's ``ids`` placed at positions ``starts[b]..``,
        their KV written at the row's slots."""
        step = build_step_inputs(self.table.table, rows, starts, lens, ids, 1, [1] * len(rows))
        return self.model(step.input_ids, step.positions, self.kv, step.out_slots, step.meta, step.logits_indices)


@dataclass(slots=True)
class _DraftState:
    """Per-request drafter state: table row, committed tokens with KV, slots allocated."""

    row: int
    computed: int = 0
    capacity: int = 0
