"""Preemption policy: when pages run out, pause the newest running requests.

A paused request's computed KV goes to the radix tree (evictable) and it resumes later by prefix
match, so pausing loses no work unless the tree evicts it meanwhile.
"""

from __future__ import annotations

from collections.abc import Sequence

from treeserve.scheduler.queues import RequestQueues
from treeserve.scheduler.request import Request, RequestState

__all__ = ["reserve_decode_slots", "reserve_or_preempt"]


def reserve_or_preempt(queues: RequestQueues, req: Request, kv_len: int) -> bool:
    """Make running ``req`` own slots for positions ``< kv_len``, pausing the newest running
    requests while the pages cannot be had. False when ``req`` itself was paused."""
    ledger = queues.ledger
    while not ledger.try_reserve(req, kv_len):
        victim = queues.running[-1]
        queues.pause(victim)
        if victim is req:
            return False
    return True


def reserve_decode_slots(queues: RequestQueues, full: Sequence[Request]) -> None:
    """Give every one of the decoding requests ``full`` (their slots all used: the pending
    token needs a new one) a run of pages (``KVLedger.decode_run``), in one allocation. A request
    that drafts reserves its draft slots past them itself (``Scheduler._ask_for_drafts``, a run as
    well), and keeps its unused pages after that step unless the pool is short (``KVLedger.trim``);
    with speculation on, decode steps of 16 rows that drafted nothing ran 5-10% slower with one page
    a step: each request's K/V rows 16 slots apart.

    Pauses the newest running requests while the pages cannot be had (a paused request's own
    need goes with it).
    """
    ledger = queues.ledger
    needy = list(full)
    while needy and not ledger.obtain(len(needy), 0):
        queues.pause(queues.running[-1])
        needy = [r for r in needy if r.state is RequestState.RUNNING]
    if needy:
        ledger.grow(needy, ledger.decode_run(needy))
