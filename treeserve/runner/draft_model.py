"""Drafts from a smaller model: the drafter that runs a model, so it lives with the runner.

It implements :class:`~treeserve.runner.drafting.Drafter`; all requests of a step are drafted
together (one batched forward per draft depth) with the runner's step-input builder.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from treeserve.kvcache import KVPool, ReqToTokenTable
from treeserve.runner.drafting import DraftRequest
from treeserve.sampling import SamplingBatch, SamplingParams, draw_siblings
from treeserve.runner.inputs import build_step_inputs
from treeserve.scheduler import DraftTree

__all__ = ["DraftModelDrafter"]


class DraftModelDrafter:
    """Drafts from a smaller model that shares the tokenizer, over its own paged KV.

    ``model`` follows the runner's model contract (``treeserve.models.LlamaForCausalLM``, e.g. a
    layer-truncated copy of the target for self-speculation); ``kv`` is its pool (page size 1;
    sized by :func:`~treeserve.runner.drafting.draft_pool_tokens`). Tree shape: ``width``
    siblings under the root, the first one extended into a chain (``width == 1``: a chain).

    A greedy request (or one without ``params``) gets the draft model's argmax chain and the
    root's next most likely tokens as siblings: deterministic, so verification uses the point-mass
    form. A request that samples gets its nodes drawn from the draft model's processed law (its
    own temperature / top-k / top-p / penalties; ``sampling.draw_siblings``: siblings without
    replacement, counter-based randomness keyed by (seed, position, DRAFT, sibling)) and the
    law of each node in ``DraftTree.probs`` for verification. ``eos_token_ids`` feed the
    ``min_new_tokens`` ban of that law. ``sample=False`` gives every request the point-mass draft
    (the comparison ``benches/bench_speculative.py`` measures).

    KV: each request gets a row of the drafter's own table. Only committed tokens count as
    computed: KV written for draft tokens is rolled back by simply being recomputed (overwritten)
    at the next call, which also gives a fully accepted chain its extra decode step. A request
    whose slots cannot be had (pool or table full) gets no draft (it decodes plainly).
    """

    def __init__(self, model: Any, kv: KVPool, max_requests: int, max_len: int, width: int = 1,
                 eos_token_ids: Sequence[int] = (), sample: bool = True) -> None:
        if kv.page_size != 1:
            raise ValueError(f"the draft KV pool must have page_size 1, got {kv.page_size}")
        if width < 1:
            raise ValueError(f"width must be >= 1, got {width}")
        self.model, self.kv, self.width = model, kv, width
        self.eos_token_ids = list(eos_token_ids)
        self.sample = sample  # False: every request gets the deterministic (point-mass) draft
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
        """The (greedy) draft of one request (:meth:`propose_batch` of one)."""
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
        reqs = [r for _, r, _ in live]
        root = self._draw(logits, reqs, [len(r.tokens) for r in reqs], max(widths))
        chains = [[row[0]] for row in root.tokens]
        laws = [[row[0]] for row in root.laws]
        for _, r, st in live:
            st.computed = len(r.tokens)  # draft tokens' KV beyond this is overwritten next time
        # Extend each chain (its first sibling) until it has max_tokens - width + 1 tokens.
        while True:
            going = [j for j, r in enumerate(reqs) if len(chains[j]) < r.max_tokens - widths[j] + 1]
            if not going:
                break
            rows = [live[j][2].row for j in going]
            pos = [len(reqs[j].tokens) + len(chains[j]) - 1 for j in going]
            out = self._forward(rows, pos, [1] * len(going), [chains[j][-1] for j in going])
            nxt = self._draw(out, [reqs[j] for j in going], [p + 1 for p in pos], 1)
            for k, j in enumerate(going):
                chains[j].append(nxt.tokens[k][0])
                laws[j].append(nxt.laws[k][0])
        for j, (i, _, _) in enumerate(live):
            w, ext = widths[j], chains[j][1:]
            parents = [-1] * w + [0 if e == 0 else w + e - 1 for e in range(len(ext))]
            probs = None
            if root.laws[j][0] is not None:
                probs = torch.stack(root.laws[j][:w] + laws[j][1:])
            drafts[i] = DraftTree(root.tokens[j][:w] + ext, parents, probs)
        return drafts

    def _draw(self, logits: torch.Tensor, reqs: Sequence[DraftRequest], positions: list[int], width: int) -> _Drawn:
        """``width`` tokens per row of ``logits`` (see the class): per row its tokens and, for a
        sampling request, the law of each (None for a greedy one)."""
        sampled = [self.sample and r.params is not None and not r.params.greedy for r in reqs]
        if not any(sampled):
            top = torch.topk(logits, width).indices.tolist()
            return _Drawn(top, [[None] * width for _ in reqs])
        batch = SamplingBatch.build(
            [r.params or _GREEDY for r in reqs], [r.seed for r in reqs], [r.tokens for r in reqs],
            logits.shape[1], logits.device, self.eos_token_ids, [r.num_generated for r in reqs],
        )
        drawn = draw_siblings(logits, batch, torch.tensor(positions, dtype=torch.int64, device=logits.device), width)
        laws = [list(drawn.probs[j].unbind(0)) if s else [None] * width for j, s in enumerate(sampled)]
        return _Drawn(drawn.tokens.tolist(), laws)

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


class _Drawn(NamedTuple):
    """Drawn tokens ``[R][W]`` and their laws (``[V]`` tensors, or None for point masses)."""

    tokens: list[list[int]]
    laws: list[list[torch.Tensor | None]]


_GREEDY = SamplingParams(temperature=0.0)


@dataclass(slots=True)
class _DraftState:
    """Per-request drafter state: table row, committed tokens with KV, slots allocated."""

    row: int
    computed: int = 0
    capacity: int = 0
