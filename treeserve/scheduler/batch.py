"""What passes between the scheduler and the runner each step.

``ScheduledBatch`` (scheduler -> runner): items, each computing a range of one request's tokens
(``ScheduledItem.num_scheduled_tokens``: the tokens *computed this step*, not the request's
length, which is ``Request.seq_len``). ``SampledToken`` (runner -> scheduler): one per sampled item.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from treeserve.scheduler.request import Request

__all__ = ["DraftTree", "SampledToken", "ScheduledBatch", "ScheduledItem"]


@dataclass(slots=True)
class DraftTree:
    """A speculative draft: node ``k`` holds ``tokens[k]`` and its parent ``parents[k]`` (``-1`` =
    the request's last token, ``parents[k] < k``); a chain has ``parents == [-1, 0, 1, ...]``.
    ``probs [n, V]``: the laws the nodes were drawn from, or None for deterministic (point-mass)
    drafts. A grammar-constrained request's draft also carries ``bitmask [1 + n, W]`` (int32:
    the grammar's mask at the root, then after each node; ``sampling.GrammarState.check_draft``)
    and ``num_forced``: how many of its first nodes (a chain) are jump-forward tokens the grammar
    forces."""

    tokens: list[int]
    parents: list[int]
    probs: torch.Tensor | None = None
    bitmask: torch.Tensor | None = None
    num_forced: int = 0

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise ValueError(f"tokens ({len(self.tokens)}) and parents ({len(self.parents)}) differ in length")
        for k, p in enumerate(self.parents):
            if not -1 <= p < k:
                raise ValueError(f"parents[{k}] = {p} must lie in [-1, {k - 1}]")

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        """Whether the draft is a chain (``parents == [-1, 0, 1, ...]``): its nodes see the ones
        before them, as a causal chunk's tokens do."""
        return all(p == k - 1 for k, p in enumerate(self.parents))

    def depths(self) -> list[int]:
        """Depth of each node (children of the root have depth 1)."""
        d: list[int] = []
        for p in self.parents:
            d.append(1 if p < 0 else d[p] + 1)
        return d


class ScheduledItem(NamedTuple):
    """Compute tokens ``[start, start + num_scheduled_tokens)`` of ``req``; sample a token if ``sample``.

    With a ``draft`` (speculative decoding), the item computes the pending token plus the draft
    nodes (``num_scheduled_tokens == 1 + len(draft)``), laid out in node order after the pending
    token's slot; the runner verifies them and compacts the accepted path's KV.

    ``draft_budget`` (> 0 only on a decoding item, whose ``draft`` is then None): the scheduler
    asks for a draft of at most this many nodes and holds slots and token budget for them; the
    engine's drafting (``treeserve.runner.drafting.fill_drafts``) replaces the item with its
    draft before the step runs. Slots left unused stay the request's (``KVLedger.trim``).
    """

    req: Request
    start: int
    num_scheduled_tokens: int
    sample: bool
    draft: DraftTree | None = None
    draft_budget: int = 0


@dataclass(slots=True)
class ScheduledBatch:
    items: list[ScheduledItem] = field(default_factory=list)

    @property
    def total_scheduled_tokens(self) -> int:
        """Tokens computed by the whole step (the sum of the items' ``num_scheduled_tokens``)."""
        return sum(it.num_scheduled_tokens for it in self.items)

    def __len__(self) -> int:
        return len(self.items)


class SampledToken(NamedTuple):
    """What the runner returns for a sampled row: ``accepted`` draft tokens (their KV already
    compacted to follow the pending token), then ``token`` (sampled, or the verification's
    bonus/correction token). ``logprob`` belongs to ``token``, ``accepted_logprobs`` (empty, or
    one per accepted token) to the accepted tokens; a missing logprob is reported as NaN."""

    token: int
    logprob: float
    top: dict[int, float] | None
    accepted: tuple[int, ...] = ()
    accepted_logprobs: tuple[float, ...] = ()
