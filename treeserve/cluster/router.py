"""``PrefixAffinityRouter``: the prefix-cache-aware policy plugged into Ray Serve's ``RequestRouter``.

It lives in the process holding the deployment handle (the ingress), so its prefix tree is a
plain in-process :class:`PrefixIndex` (Ray's own ``PrefixCacheAffinityRouter`` keeps a text
tree in a detached actor, shared by several proxies; here one ingress routes everything, and it
tokenizes before routing, so the tree is over token ids, the unit the replicas' radix trees
share). Loads are Ray Serve's per-replica counts of requests in flight (its queue-length cache,
probed when missing) plus the requests chosen for a replica but not yet sent to it, so a burst
of new prompts spreads instead of following one stale count. The routing stats each replica reports (``EngineReplica.record_routing_stats``)
are published for the ingress's ``/metrics`` through :func:`replica_stats`.
"""

from __future__ import annotations

import importlib
from collections.abc import Hashable
from typing import Any

from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from treeserve.cluster.policy import PendingChoices, Route, RoutingThresholds, choose_replica
from treeserve.cluster.prefix_index import PrefixIndex

__all__ = ["PowerOfTwoRouter", "PrefixAffinityRouter", "replica_stats", "route_counts"]

_STATS: dict[str, dict[str, dict[str, Any]]] = {}  # deployment name -> replica id -> routing stats


_ROUTES: dict[str, dict[str, int]] = {}  # deployment name -> PrefixAffinityRouter.routes


def route_counts(deployment: str) -> dict[str, int]:
    """How this process's prefix router has routed ``deployment``'s prompts so far, by reason
    (``prefix`` / ``balance`` / ``spread``), and how often a replica's load was unknown."""
    return dict(_ROUTES.get(deployment, {}))


def replica_stats(deployment: str) -> dict[str, dict[str, Any]]:
    """The latest routing stats of each live replica of ``deployment``, as seen by this process's
    router (empty before the first update)."""
    return dict(_STATS.get(deployment, {}))


def _shared() -> Any:
    # Ray Serve may ship a router class by value (cloudpickle), with a copy of this module's
    # globals: reach the process's one _STATS / _ROUTES through the imported module instead.
    return importlib.import_module(__name__)


class _PublishStats:
    """Mixin for a ``RequestRouter``: publishes the replicas' routing stats to :func:`replica_stats`."""

    _deployment_id: Any

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)  # type: ignore[misc]
        _shared()._STATS[self._deployment_id.name] = {r.replica_id.unique_id: dict(r.routing_stats) for r in replicas}

    def on_replica_actor_died(self, replica_id: Any) -> None:
        super().on_replica_actor_died(replica_id)  # type: ignore[misc]
        _shared()._STATS.get(self._deployment_id.name, {}).pop(replica_id.unique_id, None)


class PowerOfTwoRouter(_PublishStats, PowerOfTwoChoicesRequestRouter):
    """Ray Serve's default power-of-two-choices router, unchanged, publishing the replicas' stats
    (what ``--router power-of-two`` deploys, so ``/metrics`` reads the same under both routers)."""


class PrefixAffinityRouter(_PublishStats, RequestRouter):
    """Routes ``generate(prompt_ids, ...)`` calls by :func:`choose_replica`; other calls (and
    prompts that are not token-id lists) go to the least-loaded replica. Returns ranks
    ``[[chosen], [the others, least loaded first]]``, so a full replica falls through to the next.

    Counters (for tests and the bench): ``routes`` by reason, published to :func:`route_counts`.
    """

    def initialize_state(self, **kwargs: Any) -> None:
        self.thresholds = RoutingThresholds(**kwargs)
        self.index = PrefixIndex(self.thresholds.block_tokens, self.thresholds.capacity_tokens)
        self.routes: dict[str, int] = {"prefix": 0, "balance": 0, "spread": 0, "load_unknown": 0}
        self._last_load: dict[Hashable, int] = {}
        self._pending = PendingChoices()

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self.index.retain(r.replica_id for r in replicas)
        live = {r.replica_id for r in replicas}
        self._pending.retain(live)
        self._last_load = {rid: q for rid, q in self._last_load.items() if rid in live}

    def on_send_request(self, replica_id: Any) -> None:
        self._pending.sent(replica_id)
        super().on_send_request(replica_id)

    def on_replica_actor_died(self, replica_id: Any) -> None:
        super().on_replica_actor_died(replica_id)
        self.index.remove_replica(replica_id)
        self._last_load.pop(replica_id, None)
        self._pending.forget(replica_id)

    async def _loads(self, replicas: list[RunningReplica]) -> dict[Hashable, int]:
        """Requests in flight per replica: Ray Serve's cache, else a probe, else the last value
        seen (a probe that times out on a loaded host must not drop the replica from the choice:
        that would send every prompt to the other replica, whatever it caches); plus the requests
        this router chose it for that Ray Serve has not sent yet (:class:`PendingChoices`)."""
        cache = self.replica_queue_len_cache
        loads: dict[Hashable, int] = {}
        missing = []
        for r in replicas:
            q = cache.get(r.replica_id)
            if q is None:
                missing.append(r)
            else:
                loads[r.replica_id] = q
        if missing:
            for r, q in await self._probe_queue_lens(missing, 0):
                if q is not None:
                    loads[r.replica_id] = q
        for r in replicas:
            rid = r.replica_id
            if rid not in loads:
                self.routes["load_unknown"] += 1
                loads[rid] = self._last_load.get(rid, 0)
            self._last_load[rid] = loads[rid]
        pending = self._pending.counts(list(loads))
        return {rid: q + pending[rid] for rid, q in loads.items()}

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:  # fmt: skip
        if not candidate_replicas:
            return []
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True
        loads = await self._loads(candidate_replicas)
        by_id = {r.replica_id: r for r in candidate_replicas}
        ids = _prompt_ids(pending_request)
        if ids is None:
            route = Route(min(loads, key=loads.__getitem__), "balance", 0)
        else:
            route = choose_replica(ids, loads, self.index, self.thresholds)
            self.index.insert(ids, route.replica)
            self.routes[route.reason] += 1
            _shared()._ROUTES[self._deployment_id.name] = dict(self.routes)
        self._pending.chose(route.replica, _request_key(pending_request))
        rest = sorted((rid for rid in by_id if rid != route.replica), key=loads.__getitem__)
        return [[by_id[route.replica]]] + ([[by_id[rid] for rid in rest]] if rest else [])


def _request_key(pending: PendingRequest | None) -> Hashable:
    """The request a routing decision is for (a fresh key when Ray Serve passes none)."""
    return object() if pending is None else pending.metadata.internal_request_id


def _prompt_ids(pending: PendingRequest | None) -> list[int] | None:
    if pending is None or pending.metadata.call_method != "generate" or not pending.args:
        return None
    ids = pending.args[0]
    return ids if isinstance(ids, list) and all(isinstance(t, int) for t in ids[:8]) else None
