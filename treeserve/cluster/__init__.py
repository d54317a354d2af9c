"""Data-parallel replicas on Ray Serve behind one OpenAI endpoint (optional extra ``cluster``).

Layout (imports point downward; nothing below ``server`` imports this package):
``prefix_index`` (the router's approximate per-replica prefix tree) <- ``policy`` (the routing
decision and its thresholds) <- ``router`` (``PrefixAffinityRouter``, Ray Serve's
``RequestRouter``); ``wire`` (messages) <- ``replica`` (``EngineReplica``) and ``client``
(``ClusterEngineClient``, the ingress) <- ``launch`` (``treeserve serve --replicas N``). Only
``prefix_index``, ``policy`` and ``wire`` import without Ray.
"""

from __future__ import annotations

from treeserve.cluster.policy import PendingChoices, Route, RoutingThresholds, choose_replica
from treeserve.cluster.prefix_index import PrefixIndex

__all__ = ["PendingChoices", "PrefixIndex", "Route", "RoutingThresholds", "choose_replica"]
