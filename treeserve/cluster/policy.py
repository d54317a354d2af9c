"""The routing decision of the prefix-cache-aware router, as a pure function (no Ray).

SGLang's cache-aware policy, over :class:`~treeserve.cluster.prefix_index.PrefixIndex`:

1. Loads (requests in flight per replica) are *skewed* when
   ``max - min > balance_abs`` and ``max > balance_rel * min``: then the least-loaded replica gets
   the request, whatever the caches hold (a hot prefix must not pile onto one replica).
2. Otherwise the replica holding the longest prefix gets it, if that prefix covers at least
   ``cache_threshold`` of the prompt (ties: the less loaded, then the smaller cache).
3. Otherwise (nothing worth reusing) the least-loaded replica, ties to the one with the smallest
   cache, so new prefixes spread over the replicas.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from treeserve.cluster.prefix_index import PrefixIndex

__all__ = ["PendingChoices", "Route", "RoutingThresholds", "choose_replica"]


@dataclass(frozen=True, slots=True)
class RoutingThresholds:
    """The router's named thresholds (README "Replicas"; measured in benches/RESULTS.md).

    ``cache_threshold``: the fraction of the prompt (0..1) a replica's cached prefix must cover
    for the request to follow it. ``balance_abs`` (requests) and ``balance_rel`` (ratio, >= 1):
    loads are skewed when the busiest replica has more than ``balance_abs`` requests more than
    the idlest *and* more than ``balance_rel`` times as many. ``block_tokens``: granularity of the
    router's prefix tree (match lengths are multiples of it); ``capacity_tokens``: how many tokens
    of prompts the tree remembers per replica (its KV pool).
    """

    cache_threshold: float = 0.5
    balance_abs: int = 32
    balance_rel: float = 1.5
    block_tokens: int = 16
    capacity_tokens: int = 32768

    def __post_init__(self) -> None:
        if not isinstance(self.cache_threshold, (int, float)) or not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must lie in [0, 1], got {self.cache_threshold!r}")
        if not isinstance(self.balance_abs, int) or self.balance_abs < 0:
            raise ValueError(f"balance_abs must be an int >= 0, got {self.balance_abs!r}")
        if not isinstance(self.balance_rel, (int, float)) or not self.balance_rel >= 1.0:
            raise ValueError(f"balance_rel must be a number >= 1, got {self.balance_rel!r}")
        PrefixIndex(self.block_tokens, self.capacity_tokens)  # validates both

    def skewed(self, loads: Sequence[int]) -> bool:
        hi, lo = max(loads), min(loads)
        return hi - lo > self.balance_abs and hi > self.balance_rel * lo


class Route(NamedTuple):
    """The chosen replica, why (``"balance"``, ``"prefix"`` or ``"spread"``) and its expected
    cached prefix in tokens."""

    replica: Hashable
    reason: str
    matched_tokens: int


def choose_replica(ids: Sequence[int], loads: Mapping[Hashable, int], index: PrefixIndex,
                   thresholds: RoutingThresholds) -> Route:  # fmt: skip
    """Pick one of ``loads``' replicas for prompt ``ids`` (see the module docstring). Read-only:
    the caller records the choice with ``index.insert``. ``loads`` must not be empty."""
    if not loads:
        raise ValueError("loads must name at least one replica")
    replicas = list(loads)
    match = index.match(ids)
    if thresholds.skewed([loads[r] for r in replicas]):
        best = min(replicas, key=lambda r: (loads[r], -match.get(r, 0)))
        return Route(best, "balance", match.get(best, 0))
    best = min(replicas, key=lambda r: (-match.get(r, 0), loads[r], index.cached_tokens(r)))
    got = match.get(best, 0)
    if got > 0 and got >= thresholds.cache_threshold * len(ids):
        return Route(best, "prefix", got)
    best = min(replicas, key=lambda r: (loads[r], index.cached_tokens(r)))
    return Route(best, "spread", match.get(best, 0))


class PendingChoices:
    """Requests routed to a replica but not yet sent to it, per replica.

    Ray Serve counts a request in a replica's load when it is *sent*, a few event-loop turns after
    the router chose the replica; a burst of requests routed in between would all see the same
    loads and pile onto one replica. The router adds :meth:`counts` to the loads it reads, calls
    :meth:`chose` for each decision (keyed by request: a request routed again while it backs off
    replaces its earlier choice) and :meth:`sent` when Ray Serve sends a request. A choice that is
    never sent (the request went to a fallback rank, or was cancelled) stops counting after
    ``horizon_s`` seconds.
    """

    def __init__(self, horizon_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        if not horizon_s > 0:
            raise ValueError(f"horizon_s must be > 0 seconds, got {horizon_s!r}")
        self._horizon = horizon_s
        self._clock = clock
        self._choices: dict[Hashable, tuple[Hashable, float]] = {}  # request -> (replica, when), oldest first

    def chose(self, replica: Hashable, request: Hashable) -> None:
        self._choices.pop(request, None)
        self._choices[request] = (replica, self._clock())

    def sent(self, replica: Hashable) -> None:
        """One request was sent to ``replica``: its oldest pending choice is settled (none: no-op)."""
        self._expire()
        for request, (r, _) in self._choices.items():
            if r == replica:
                del self._choices[request]
                return

    def forget(self, replica: Hashable) -> None:
        self._choices = {q: rt for q, rt in self._choices.items() if rt[0] != replica}

    def retain(self, replicas: Iterable[Hashable]) -> None:
        """Forget the choices of every replica not in ``replicas``."""
        keep = set(replicas)
        self._choices = {q: rt for q, rt in self._choices.items() if rt[0] in keep}

    def _expire(self) -> None:
        oldest = self._clock() - self._horizon
        for request in [q for q, (_, t) in self._choices.items() if t < oldest]:
            del self._choices[request]

    def counts(self, replicas: Sequence[Hashable]) -> dict[Hashable, int]:
        """Pending choices per replica of ``replicas`` (expired ones dropped)."""
        self._expire()
        out = dict.fromkeys(replicas, 0)
        for r, _ in self._choices.values():
            if r in out:
                out[r] += 1
        return out
