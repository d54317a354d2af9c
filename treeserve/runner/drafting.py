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

from treeserve.sampling import GrammarState, SamplingParams
from treeserve.scheduler import DraftTree, ScheduledBatch, ScheduledItem

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
    running (finished or paused). A drafter with a true ``stateless`` attribute (nothing kept
    per request) may be asked to draft past tokens not yet committed (jump-forward tokens)."""

    def propose_batch(self, requests: Sequence[DraftRequest]) -> list[DraftTree | None]:
        """One draft (None or empty: no draft) of at most ``max_tokens`` nodes per request."""
        ...

    def release(self, key: int) -> None: ...


def fill_drafts(batch: ScheduledBatch, drafter: Drafter | None, jump_forward_tokens: int = 0) -> ScheduledBatch:
    """``batch`` with every item that asks for a draft (``draft_budget > 0``) given its draft
    (the item then computes ``1 + len(draft)`` tokens); items without one stay plain decodes.
    ``ValueError`` when a drafter breaks its budget.

    A grammar-constrained request (``Request.grammar``) drafts in three parts:

    - jump-forward (``jump_forward_tokens > 0``): the tokens its grammar forces next
      (``GrammarState.jump_forward``) open the draft as a chain (``DraftTree.num_forced``);
    - the drafter continues after them when it keeps no per-request state (``stateless``: the
      n-gram lookup, asked with the forced tokens appended to the context); a stateful drafter
      (a draft model, whose KV follows only committed tokens) drafts only when nothing is forced;
    - ``GrammarState.check_draft`` then cuts what the grammar refuses and fills the per-position
      masks verification applies (``DraftTree.bitmask``).
    """
    asks = [i for i, it in enumerate(batch.items) if it.draft_budget > 0]
    if not asks:
        return batch
    items = list(batch.items)
    forced = {i: _forced(items[i], jump_forward_tokens) for i in asks}
    stateless = getattr(drafter, "stateless", False)
    requests, asked = [], []
    for i in asks:
        req, extra = items[i].req, forced[i]
        room = items[i].draft_budget - len(extra)
        if drafter is not None and room > 0 and (not extra or stateless):
            ids = req.all_ids if not extra else [*req.all_ids, *extra]
            requests.append(DraftRequest(req.rid, ids, room, req.params, req.seed, len(req.output_ids) + len(extra)))
            asked.append(i)
    drafts = drafter.propose_batch(requests) if requests else []
    if len(drafts) != len(asked):
        raise ValueError(f"the drafter returned {len(drafts)} drafts for {len(asked)} requests")
    proposed: dict[int, DraftTree | None] = dict(zip(asked, drafts))
    for i in asks:
        draft = _after_forced(forced[i], proposed.get(i))
        if draft and len(draft) > items[i].draft_budget:
            raise ValueError(f"a draft of {len(draft)} nodes exceeds its budget of {items[i].draft_budget}")
        grammar = items[i].req.grammar
        if draft and grammar is not None:
            draft = _checked(grammar, draft)
        if not draft:
            continue
        items[i] = items[i]._replace(draft=draft, num_scheduled_tokens=1 + len(draft))
    return ScheduledBatch(items)


def _forced(item: ScheduledItem, jump_forward_tokens: int) -> list[int]:
    grammar = item.req.grammar
    if grammar is None or jump_forward_tokens <= 0:
        return []
    return grammar.jump_forward(min(jump_forward_tokens, item.draft_budget))


def _after_forced(forced: list[int], draft: DraftTree | None) -> DraftTree | None:
    """The chain ``forced`` with ``draft`` (proposed after it) hung under its last node."""
    if not forced:
        return draft
    n = len(forced)
    if not draft:
        return DraftTree(list(forced), list(range(-1, n - 1)), num_forced=n)
    if draft.probs is not None:
        raise ValueError("a drafter with sampled drafts must not be asked to continue jump-forward tokens")
    parents = [n - 1 if p < 0 else n + p for p in draft.parents]
    return DraftTree([*forced, *draft.tokens], [*range(-1, n - 1), *parents], num_forced=n)


def _checked(grammar: GrammarState, draft: DraftTree) -> DraftTree:
    """``draft`` as ``grammar`` keeps it (``GrammarState.check_draft``), with its masks."""
    check = grammar.check_draft(draft.tokens, draft.parents, sampled=draft.probs is not None)
    keep = check.keep
    if len(keep) == len(draft):
        return DraftTree(draft.tokens, draft.parents, draft.probs, check.masks, draft.num_forced)
    new = {k: j for j, k in enumerate(keep)}
    return DraftTree(
        [draft.tokens[k] for k in keep],
        [-1 if draft.parents[k] < 0 else new[draft.parents[k]] for k in keep],
        None if draft.probs is None else draft.probs[keep],
        check.masks,
        sum(k < draft.num_forced for k in keep),
    )


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
