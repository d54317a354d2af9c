"""Admission: which waiting requests start running this step, and their first prefill chunk.

Prefix-aware: with at most ``lpm_window`` waiting, the longest cached prefix goes first (paused
requests keep priority: they were running); beyond that FCFS. A request is admitted only when
the pages of its first chunk can be had now while one page per running request stays
obtainable (admission never starves running decodes), and its chunk fits the step's remaining
token budget (chunked prefill). A request sharing ``min_shared_prefix`` uncached leading tokens
with a prompt being prefilled waits for that prefill to be cached instead of duplicating it;
sample ``i > 0`` of an ``n``-sample group waits for the leader's prompt KV. With KV tiers, a
request whose prefix the host or disk tier holds has it promoted first and is admitted once the
copy is done (at once on CPU, where it is synchronous).
"""

from __future__ import annotations

from treeserve.kvcache import RadixCache
from treeserve.scheduler.batch import ScheduledBatch, ScheduledItem
from treeserve.scheduler.queues import RequestQueues
from treeserve.scheduler.request import Request, RequestState

__all__ = ["admit"]


def admit(
    queues: RequestQueues, batch: ScheduledBatch, budget: int, max_running: int, lpm_window: int, min_shared_prefix: int
) -> int:
    """Admit waiting requests into ``batch`` while ``budget`` tokens and rows remain; return
    the budget left."""
    ledger = queues.ledger
    running = queues.running
    # Prompts whose KV is being computed and not yet in the radix tree.
    in_flight = [r.prompt_ids for r in running if r.num_computed_tokens < r.num_prompt_tokens]
    for req in admission_order(queues, ledger.radix, lpm_window):
        if budget <= 0 or len(running) >= max_running:
            return budget
        if req.group is not None and req.sample_index > 0 and not req.group.prompt_cached:
            continue  # wait for the leader's prompt KV, then share it via the radix tree
        if ledger.table.num_free == 0:
            return budget
        if shares_in_flight_prefix(ledger.radix, req, in_flight, min_shared_prefix):
            continue  # admitted once that prefix is cached, instead of computing it twice
        if not ledger.prefix_ready(req, headroom=len(running)):
            continue  # its prefix is being copied up from a lower KV tier: admitted once it landed
        ledger.attach(req)
        computed = req.num_computed_tokens
        n = min(req.seq_len - computed, budget)
        if not ledger.try_reserve(req, computed + n, headroom=len(running)):
            ledger.release(req, cache=False)  # nothing was computed: undo the attach
            return budget
        queues.start(req)
        if computed < req.num_prompt_tokens:
            in_flight.append(req.prompt_ids)
        batch.items.append(ScheduledItem(req, computed, n, computed + n == req.seq_len))
        budget -= n
    return budget


def admission_order(queues: RequestQueues, radix: RadixCache, lpm_window: int) -> list[Request]:
    """Waiting requests in the order admission tries them."""
    waiting = list(queues.waiting)
    if radix.disable or len(waiting) > lpm_window or len(waiting) < 2:
        return waiting
    lengths = {id(r): radix.prefix_len(r.all_ids) for r in waiting}
    return sorted(waiting, key=lambda r: (r.state is not RequestState.PAUSED, -lengths[id(r)]))


def shares_in_flight_prefix(radix: RadixCache, req: Request, in_flight: list[list[int]], need: int) -> bool:
    """True when ``req`` shares at least ``need`` uncached leading tokens with a prompt being
    prefilled now (in-batch prefix sharing, as SGLang does it)."""
    if radix.disable or not in_flight:
        return False
    ids = req.prompt_ids
    if len(ids) <= need:
        return False
    head = ids[:need]
    return any(len(p) > need and p[:need] == head for p in in_flight) and radix.prefix_len(ids) < need
