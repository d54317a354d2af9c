"""The ingress side: an :class:`EngineClient` whose engine is a Ray Serve deployment of
:class:`~treeserve.cluster.replica.EngineReplica`, so the server's FastAPI app (``build_app``: the
same endpoints, fields, validation, 400s, streaming and ``/metrics``) runs over N replicas.

Each request is one streaming call ``generate(prompt_ids, params, request_id)`` through the
deployment handle (routed by the deployment's request router); a pump task moves its messages into
the request's :class:`RequestStream`. Faults: when the replica dies (Ray raises an actor error)
before any token reached the stream, the request is sent again (up to ``max_attempts`` calls; the
router only sees live replicas); after that, the stream closes with a reason saying the replica
died, which the API turns into a 503 / an error event. ``abort`` cancels the call, which aborts
the request on its replica.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.handle import DeploymentHandle

from treeserve.cluster.router import replica_stats
from treeserve.cluster.wire import Accepted, Closed, EngineInfo, Refused
from treeserve.sampling import SamplingParams
from treeserve.server.engine_client import (
    EngineClient,
    EngineDeadError,
    EngineStats,
    QueueFullError,
    RequestStream,
    check_admission,
)

__all__ = ["REPLICAS_DIED", "REPLICA_DIED", "ClusterEngineClient"]

log = logging.getLogger("treeserve.cluster")

# The API words it "request ended early: the server is <reason>".
REPLICA_DIED = "unavailable (the replica serving this request died; it was not retried because output had been sent)"
REPLICAS_DIED = "unavailable (the replica serving this request died on each of its {} attempts)"
_REPLICA_GONE = (RayActorError, ActorUnavailableError)
_REFUSALS: dict[str, Callable[[str], Exception]] = {
    "ValueError": ValueError, "TypeError": TypeError, "QueueFullError": QueueFullError,
    "EngineDeadError": EngineDeadError,
}  # fmt: skip


class ClusterEngineClient(EngineClient):
    """:class:`EngineClient` over a deployment handle of ``EngineReplica``.

    ``info``: the replicas' model (from ``EngineReplica.engine_info``). ``max_live_requests``
    bounds the requests in flight through this ingress (more get :class:`QueueFullError`).
    ``stats()`` sums the replicas' last reported gauges (Ray Serve's routing-stats period late).
    Must be used from one event loop.
    """

    def __init__(self, handle: DeploymentHandle, info: EngineInfo, max_live_requests: int = 1024,
                 max_attempts: int = 2) -> None:  # fmt: skip
        if not isinstance(max_attempts, int) or max_attempts < 1:
            raise ValueError(f"max_attempts must be an int >= 1, got {max_attempts!r}")
        self.handle = handle.options(stream=True, method_name="generate")
        self.deployment = handle.deployment_name
        self.tokenizer = info.tokenizer
        self.max_model_len = info.max_model_len
        self.model_name = info.model_name
        self.max_live_requests = max_live_requests
        self.max_attempts = max_attempts
        self.retries = 0  # requests re-sent after their replica died
        self._pumps: dict[str, asyncio.Task] = {}
        self._streams: dict[str, RequestStream] = {}
        self._started = False
        self._dead: str | None = None

    # ------------------------------------------------------------------ EngineClient
    async def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str) -> RequestStream:
        if not self._started or self._dead is not None:
            raise EngineDeadError(self._dead or "the cluster client is not started")
        check_admission(self._streams, self.max_live_requests, request_id)
        stream = RequestStream(request_id, params.n, asyncio.get_running_loop())
        accepted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._streams[request_id] = stream
        self._pumps[request_id] = asyncio.ensure_future(self._pump(list(prompt_ids), params, stream, accepted))
        try:
            await asyncio.shield(accepted)
        except BaseException:
            self._forget(request_id, cancel=True)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is None:
            return
        stream._close("abort")
        self._forget(request_id, cancel=True)

    def stats(self) -> EngineStats:
        reports = [s for s in replica_stats(self.deployment).values() if s]
        if not reports:
            return EngineStats()
        return summed_stats(EngineStats, reports)

    def is_healthy(self) -> bool:
        """Started, not shut down, and at least one replica is running (``/health``: 503 while
        every replica is down; requests then wait for Ray Serve to bring one back)."""
        return self._started and self._dead is None and bool(replica_stats(self.deployment))

    def start(self) -> None:
        self._started = True

    def shutdown(self) -> None:
        if self._dead is None:
            self._dead = "the server was shut down"
        for rid, stream in list(self._streams.items()):
            stream._close("shutdown")
            self._forget(rid, cancel=True)

    # ------------------------------------------------------------------ one request
    async def _pump(self, ids: list[int], params: SamplingParams, stream: RequestStream,
                    accepted: asyncio.Future[None]) -> None:  # fmt: skip
        rid = stream.request_id
        try:
            for attempt in range(1, self.max_attempts + 1):
                sent_output = False
                call = self.handle.remote(ids, params, rid)
                try:
                    async for msg in call:
                        if isinstance(msg, Refused):
                            accepted.set_exception(_REFUSALS.get(msg.kind, RuntimeError)(msg.message))
                            return
                        if isinstance(msg, Accepted):
                            if not accepted.done():
                                accepted.set_result(None)
                        elif isinstance(msg, Closed):
                            stream._close(msg.reason)
                            return
                        else:
                            sent_output = sent_output or any(d.token_ids or d.text for d in msg)
                            stream._push(msg)
                    return
                except asyncio.CancelledError:  # aborted: cancel the call, which aborts it on the replica
                    call.cancel()
                    raise
                except _REPLICA_GONE as exc:
                    if sent_output or attempt == self.max_attempts:
                        log.warning("request %s lost its replica: %s", rid, type(exc).__name__)
                        if not accepted.done():
                            accepted.set_exception(EngineDeadError(f"no replica could serve the request: {exc}"))
                        stream._close(REPLICA_DIED if sent_output else REPLICAS_DIED.format(attempt))
                        return
                    self.retries += 1
                    log.warning("request %s: its replica died before any output; re-sending", rid)
        except Exception as exc:  # anything else: fail this request alone, loudly
            log.exception("request %s failed in the ingress", rid)
            if not accepted.done():
                accepted.set_exception(EngineDeadError(f"the request failed in the ingress: {exc}"))
            stream._close("error")
        finally:
            self._forget(rid, cancel=False)

    def _forget(self, request_id: str, *, cancel: bool) -> None:
        self._streams.pop(request_id, None)
        pump = self._pumps.pop(request_id, None)
        if cancel and pump is not None and pump is not asyncio.current_task():
            pump.cancel()


def summed_stats(cls: type, reports: list[dict[str, Any]]) -> Any:
    """``cls`` (a dataclass of counters) with each field the sum over ``reports`` (its fields as
    dicts, one per replica; a missing field counts 0), nested dataclass fields summed the same way."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        factory = f.default_factory
        if factory is not dataclasses.MISSING and dataclasses.is_dataclass(factory):
            values[f.name] = summed_stats(factory, [r.get(f.name) or {} for r in reports])
        else:
            values[f.name] = sum(r.get(f.name, 0) for r in reports)
    return cls(**values)
