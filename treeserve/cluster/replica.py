"""One treeserve engine as a Ray Serve replica (the deployment's user class).

Each replica builds its ``LLM`` on its engine thread (``AsyncLLMEngine.build``) with its share of
CPU threads, and serves ``generate`` as a streaming method (see :mod:`treeserve.cluster.wire`).
``record_routing_stats`` reports its queue and KV gauges to Ray Serve (the router reads them
from ``RunningReplica.routing_stats``); ``check_health`` fails once its engine loop is gone, so
Ray Serve replaces the replica.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from treeserve.cluster.wire import Accepted, Closed, EngineInfo, Refused
from treeserve.engine import LLM
from treeserve.output import SampleDelta
from treeserve.sampling import SamplingParams
from treeserve.server.engine_client import AsyncLLMEngine, EngineDeadError, QueueFullError

__all__ = ["EngineReplica"]


class EngineReplica:
    """A Ray Serve replica owning one engine. ``llm_kwargs`` are ``LLM``'s (``model`` included),
    ``num_threads`` the torch threads of this replica, ``served_model_name`` the name clients use
    (default: the model's). Bad input is refused with a :class:`Refused` message, never raised, so
    the ingress can tell it from a replica that died."""

    def __init__(self, llm_kwargs: dict[str, Any], num_threads: int, max_live_requests: int = 1024,
                 served_model_name: str | None = None) -> None:  # fmt: skip
        kwargs = dict(llm_kwargs)
        self.engine = AsyncLLMEngine.build(lambda: LLM(num_threads=num_threads, **kwargs), max_live_requests)
        self.engine.start()
        self.info = EngineInfo(served_model_name or self.engine.llm.model_name, self.engine.tokenizer,
                               self.engine.max_model_len)  # fmt: skip

    def engine_info(self) -> EngineInfo:
        return self.info

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       request_id: str) -> AsyncIterator[Accepted | Refused | Closed | list[SampleDelta]]:  # fmt: skip
        try:
            stream = await self.engine.add_request(prompt_ids, params, request_id)
        except (ValueError, TypeError, QueueFullError, EngineDeadError) as exc:
            yield Refused(type(exc).__name__, str(exc))
            return
        yield Accepted()
        try:
            async for deltas in stream:
                yield deltas
            if stream.closed_reason is not None:
                yield Closed(stream.closed_reason)
        finally:  # the ingress cancelled us (client gone) or we failed: free the request
            if not stream.finished:
                self.engine.abort(request_id)

    def record_routing_stats(self) -> dict[str, Any]:
        return dataclasses.asdict(self.engine.stats())

    def check_health(self) -> None:
        if not self.engine.is_healthy():
            raise RuntimeError("the engine loop is not running")

    def __del__(self) -> None:  # Ray Serve calls it at replica shutdown
        self.engine.shutdown()
