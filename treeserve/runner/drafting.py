"""Drafting for speculative decoding, run by the engine between ``schedule`` and ``run``.

The scheduler never runs a drafter: it marks decoding items with a ``draft_budget`` (and holds
slots and token budget for that many nodes). :func:`fill_drafts` asks the engine's
:class:`Drafter` for every such item at once and returns the batch with the drafts in place.
Both drafters go through here: :class:`~treeserve.runner.ngram.NgramDrafter` (prompt lookup, no
model) and :class:`~treeserve.runner.draft_model.DraftModelDrafter` (one batched forward of a
smaller model per draft depth).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

from treeserve.sampling import SamplingParams
from treeserve.scheduler import DraftTree, ScheduledBatch

__all__ = ["DraftRequest", "Drafter", "draft_pool_tokens", "fill_drafts"]


class DraftRequest(NamedTuple):
    """Draft at most ``max_tokens`` nodes continuing ``tokens`` for the request keyed ``key``.

    ``params`` / ``seed`` / ``num_generated`` (the request's sampling parameters, its seed and
    how many of ``tokens`` are output) let a model drafter sample from its processed law; with
    ``params`` None or greedy it drafts deterministically."""

    key: int
    tokens: Sequence[int]
    max_tokens: int
    params: SamplingParams | None = None
    seed: int = 0
    num_generated: int = 0


class Drafter(Protocol):
    """Proposes draft trees; ``release(key)`` drops per-request state when a request stops
    running (finished or paused)."""

    def propose_batch(self, requests: Sequence[DraftRequest]) -> list[DraftTree | None]:
        """One draft (None or empty: no draft) of at most ``max_tokens`` nodes per request."""
        ...

    def release(self, key: int) -> None: ...


def fill_drafts(batch: ScheduledBatch, drafter: Drafter) -> ScheduledBatch:
    """``batch`` with every item that asks for a draft (``draft_budget > 0``) given the drafter's
    proposal (the item then computes ``1 + len(draft)`` tokens); items without a proposal stay
    plain decodes. ``ValueError`` when a drafter breaks its budget."""
    asks = [i for i, it in enumerate(batch.items) if it.draft_budget > 0]
    if not asks:
        return batch
    items = list(batch.items)
    requests = []
    for i in asks:
        req = items[i].req
        requests.append(DraftRequest(req.rid, req.all_ids, items[i].draft_budget, req.params, req.seed, len(req.output_ids)))
    drafts = drafter.propose_batch(requests)
    if len(drafts) != len(asks):
        raise ValueError(f"the drafter returned {len(drafts)} drafts for {len(asks)} requests")
    for i, draft in zip(asks, drafts):
        if not draft:
            continue
        if len(draft) > items[i].draft_budget:
            raise ValueError(f"a draft of {len(draft)} nodes exceeds its budget of {items[i].draft_budget}")
        items[i] = items[i]._replace(draft=draft, num_scheduled_tokens=1 + len(draft))
    return ScheduledBatch(items)


def draft_pool_tokens(max_running: int, max_model_len: int, num_speculative_tokens: int, target_kv_tokens: int) -> int:
    """KV tokens the draft model's pool needs (page size 1, dummy slot not counted).

    The draft model holds KV only for running requests (no prefix cache): each needs its
    context plus its draft nodes, so ``max_running * (max_model_len + k)`` always suffices; and
    the running contexts also fit in the target's pool, so ``target_kv_tokens + max_running * k``
    suffices unless prefixes are shared there (a request whose context does not fit is then
    simply not drafted). The pool gets the smaller of the two.
    """
    for name, value in (("max_running", max_running), ("max_model_len", max_model_len),
                        ("num_speculative_tokens", num_speculative_tokens), ("target_kv_tokens", target_kv_tokens)):  # fmt: skip
        if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "num_speculative_tokens" else 1):
            raise ValueError(f"{name} must be an int >= {0 if name == 'num_speculative_tokens' else 1}, got {value!r}")
    k = num_speculative_tokens
    return min(max_running * (max_model_len + k), target_kv_tokens + max_running * k)
