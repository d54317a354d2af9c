"""The request queues and the transitions that move a request between them.

``waiting`` (FIFO; paused requests re-enter at the front) and ``running`` (admission order, so
``running[-1]`` is the newest). Leaving ``running`` -- pause or finish -- always goes through
:meth:`RequestQueues.release`, which hands the request's KV back through the ledger and tells
``on_release`` (the engine's drafter drops its per-request state there).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from treeserve.scheduler.ledger import KVLedger
from treeserve.scheduler.request import FinishReason, Request, RequestState

__all__ = ["RequestQueues"]


class RequestQueues:
    """``waiting`` and ``running`` over one :class:`KVLedger`; counts preemptions."""

    def __init__(self, ledger: KVLedger, on_release: Callable[[Request], None] | None = None) -> None:
        self.ledger = ledger
        self.on_release = on_release
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def start(self, req: Request) -> None:
        """Move an attached waiting (or paused) ``req`` to ``running``."""
        self.waiting.remove(req)
        if req.state is RequestState.PAUSED:
            req.metrics.num_preemptions += 1
        elif req.metrics.first_scheduled is None:
            req.metrics.cached_prompt_tokens = req.num_cached_tokens
        req.state = RequestState.RUNNING
        if req.metrics.first_scheduled is None:
            req.metrics.first_scheduled = time.perf_counter()
        self.running.append(req)

    def release(self, req: Request, cache: bool = True) -> None:
        """Take ``req`` out of ``running`` and give back its KV (cached unless ``cache`` is False)."""
        self.ledger.release(req, cache)
        if self.on_release is not None:
            self.on_release(req)
        self.running.remove(req)

    def pause(self, req: Request) -> None:
        """Preempt ``req``: its KV stays in the radix tree (evictable); it resumes by prefix match."""
        self.release(req)
        req.state = RequestState.PAUSED
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def finish(self, req: Request, reason: FinishReason) -> None:
        """Finish a running ``req`` (KV of an ``ERROR`` finish is never published)."""
        self.release(req, cache=reason is not FinishReason.ERROR)
        req.state = RequestState.FINISHED
        req.finish_reason = reason
        req.metrics.finished = time.perf_counter()
        release_group(req)

    def abort(self, req: Request, reason: FinishReason) -> None:
        """Finish ``req`` now from any unfinished state, releasing everything it holds."""
        if req.state is RequestState.RUNNING:
            self.finish(req, reason)
            return
        self.waiting.remove(req)
        req.state = RequestState.FINISHED
        req.finish_reason = reason
        release_group(req)


def release_group(req: Request) -> None:
    """A leader that ends before its prompt is cached must not block its siblings forever."""
    if req.group is not None and req.sample_index == 0:
        req.group.prompt_cached = True
