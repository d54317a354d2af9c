"""What passes between the scheduler and the runner each step.

``ScheduledBatch`` (scheduler -> runner): items, each computing a range of one request's tokens
(``ScheduledItem.num_scheduled_tokens``: the tokens *computed this step*, not the request's
length, which is ``Request.seq_len``). ``SampledToken`` (runner -> scheduler): one per sampled item.
``SpecStats``: the speculative-decoding counters the scheduler keeps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from treeserve.scheduler.drafter import DraftTree
from treeserve.scheduler.request import Request

__all__ = ["SampledToken", "ScheduledBatch", "ScheduledItem", "SpecStats"]


class ScheduledItem(NamedTuple):
    """Compute tokens ``[start, start + num_scheduled_tokens)`` of ``req``; sample a token if ``sample``.

    With a ``draft`` (speculative decoding), the item computes the pending token plus the draft
    nodes (``num_scheduled_tokens == 1 + len(draft)``), laid out in node order after the pending token's
    slot; the runner verifies them and compacts the accepted path's KV.
    """

    req: Request
    start: int
    num_scheduled_tokens: int
    sample: bool
    draft: DraftTree | None = None


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


@dataclass(slots=True)
class SpecStats:
    """Speculative decoding counters: draft nodes proposed / accepted, verify steps."""

    proposed: int = 0
    accepted: int = 0
    steps: int = 0

    def record(self, proposed: int, accepted: int) -> None:
        self.proposed += proposed
        self.accepted += accepted
        self.steps += 1
