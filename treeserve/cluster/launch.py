"""``treeserve serve --replicas N``: start (or join) a Ray cluster, deploy N engine replicas on Ray
Serve, and serve the OpenAI app over them from this process.

The ingress (HTTP, tokenization, validation, the request router) runs in the ``treeserve serve``
process, the engines in Ray Serve replica actors. Without ``address`` the process starts a local
Ray cluster and owns it: on SIGINT / SIGTERM it drains like ``treeserve serve``, then shuts Serve
and Ray down, which stops every Ray process it started. With ``address`` it deploys into that
cluster and on exit deletes only its own application.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from treeserve.cluster.client import ClusterEngineClient
from treeserve.cluster.policy import RoutingThresholds
from treeserve.cluster.replica import EngineReplica
from treeserve.cluster.router import PowerOfTwoRouter, PrefixAffinityRouter, route_counts
from treeserve.server.launch import serve_client

__all__ = ["ROUTERS", "deploy", "replica_threads", "serve_cluster"]

log = logging.getLogger("treeserve.cluster")

APP_NAME = "treeserve"
DEPLOYMENT_NAME = "treeserve-engine"
ROUTERS = ("prefix", "power-of-two")
# How often replicas report queue / KV gauges (routing stats, /metrics) and are health-checked.
STATS_PERIOD_S = 1.0
HEALTH_CHECK_PERIOD_S = 2.0


def replica_threads(replicas: int, threads: int | None, cpus: float) -> int:
    """Torch threads per replica: ``threads`` when given, else an equal share of ``cpus`` (>= 1)."""
    if not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"replicas must be an int >= 1, got {replicas!r}")
    if threads is not None:
        if not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be an int >= 1, got {threads!r}")
        return threads
    return max(1, int(cpus) // replicas)


def deploy(llm_kwargs: dict[str, Any], *, replicas: int, threads: int, max_live_requests: int = 1024,
           served_model_name: str | None = None, router: str = "prefix",
           thresholds: RoutingThresholds | None = None) -> DeploymentHandle:  # fmt: skip
    """Deploy ``replicas`` engine replicas (``threads`` CPUs and torch threads each) on the
    connected Ray cluster as Serve app ``treeserve``; returns its handle once every replica is up.
    ``router``: ``"prefix"`` (:class:`PrefixAffinityRouter` with ``thresholds``) or
    ``"power-of-two"`` (Ray Serve's default)."""
    if router not in ROUTERS:
        raise ValueError(f"router must be one of {ROUTERS}, got {router!r}")
    cfg: dict[str, Any] = {"request_routing_stats_period_s": STATS_PERIOD_S, "request_routing_stats_timeout_s": 10.0}
    if router == "prefix":
        t = thresholds or RoutingThresholds()
        cfg.update(request_router_class=PrefixAffinityRouter,
                   request_router_kwargs={f: getattr(t, f) for f in t.__dataclass_fields__})  # fmt: skip
    else:
        cfg.update(request_router_class=PowerOfTwoRouter)
    deployment = serve.deployment(EngineReplica).options(
        name=DEPLOYMENT_NAME, num_replicas=replicas, ray_actor_options={"num_cpus": threads},
        max_ongoing_requests=max_live_requests, health_check_period_s=HEALTH_CHECK_PERIOD_S,
        health_check_timeout_s=30.0, graceful_shutdown_timeout_s=5.0, graceful_shutdown_wait_loop_s=0.5,
        request_router_config=RequestRouterConfig(**cfg),
    )  # fmt: skip
    app = deployment.bind(llm_kwargs, threads, max_live_requests, served_model_name)
    return serve.run(app, name=APP_NAME, route_prefix=None)


def serve_cluster(llm_kwargs: dict[str, Any], *, replicas: int, address: str | None = None, threads: int | None = None,
                  host: str = "127.0.0.1", port: int = 8000, served_model_name: str | None = None,
                  max_live_requests: int = 1024, router: str = "prefix", thresholds: RoutingThresholds | None = None,
                  graceful_seconds: float = 5.0) -> int:  # fmt: skip
    """Run the cluster server until SIGINT / SIGTERM; returns the exit status (0)."""
    replica_threads(replicas, threads, 1)  # validates both before any cluster is touched
    own_cluster = address is None
    if own_cluster:
        threads = replica_threads(replicas, threads, os.cpu_count() or 1)
        ray.init(num_cpus=max(os.cpu_count() or 1, replicas * threads), include_dashboard=False)
    else:
        ray.init(address=address)
        threads = replica_threads(replicas, threads, ray.cluster_resources().get("CPU", replicas))
    try:
        serve.start(proxy_location="Disabled")
        log.warning("treeserve: starting %d replicas x %d threads (router: %s)", replicas, threads, router)
        handle = deploy(llm_kwargs, replicas=replicas, threads=threads, max_live_requests=max_live_requests,
                        served_model_name=served_model_name, router=router, thresholds=thresholds)  # fmt: skip
        info = handle.engine_info.remote().result()
        client = ClusterEngineClient(handle, info, max_live_requests=max_live_requests)
        status = serve_client(client, info.model_name, host=host, port=port, graceful_seconds=graceful_seconds)
        log.warning("treeserve: routed %s, %d retried after a replica died", route_counts(DEPLOYMENT_NAME) or router,
                    client.retries)  # fmt: skip
        return status
    finally:
        # A cluster of our own goes down whole (ray.shutdown stops the processes ray.init started;
        # after Ctrl-C they may be stopping already, so no Serve-level teardown is waited for).
        if not own_cluster:
            serve.delete(APP_NAME)
        ray.shutdown()
