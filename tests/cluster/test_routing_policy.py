"""The router's prefix index and routing decision, against plain references (no Ray).

``PrefixIndex`` is checked by a hypothesis state machine against a reference that keeps every
replica's inserted prompts in LRU order and recomputes the held blocks from scratch;
``choose_replica`` against the rules in its docstring, written out independently.
"""

from __future__ import annotations

from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from treeserve.cluster import PendingChoices, PrefixIndex, RoutingThresholds, choose_replica

B = 4
CAP = 6 * B
prompts = st.lists(st.integers(0, 2), min_size=0, max_size=7 * B)
replica_ids = st.sampled_from(["r0", "r1", "r2"])


class _Reference:
    """Each replica's blocks as full-prefix tuples, evicting least recently touched first, where
    a prompt touches its blocks leaf first (so a prefix is never older than its extensions)."""

    def __init__(self) -> None:
        self.lru: dict[str, OrderedDict[tuple[int, ...], None]] = {}

    def insert(self, ids: list[int], r: str) -> None:
        lru = self.lru.setdefault(r, OrderedDict())
        for end in range((len(ids) // B) * B, 0, -B):
            lru[tuple(ids[:end])] = None
            lru.move_to_end(tuple(ids[:end]))
        while len(lru) > CAP // B:
            lru.popitem(last=False)

    def match(self, ids: list[int]) -> dict[str, int]:
        out = {}
        for r, lru in self.lru.items():
            n = 0
            while n + B <= len(ids) and tuple(ids[: n + B]) in lru:
                n += B
            if n:
                out[r] = n
        return out


class IndexMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.index = PrefixIndex(block_tokens=B, capacity_tokens=CAP)
        self.ref = _Reference()
        self.seen: list[list[int]] = [[]]

    @rule(ids=prompts, r=replica_ids)
    def insert(self, ids: list[int], r: str) -> None:
        self.index.insert(ids, r)
        self.ref.insert(ids, r)
        self.seen.append(ids)

    @rule(data=st.data(), extra=prompts)
    def match(self, data: st.DataObject, extra: list[int]) -> None:
        base = data.draw(st.sampled_from(self.seen))
        ids = base[: data.draw(st.integers(0, len(base)))] + extra
        assert self.index.match(ids) == self.ref.match(ids)

    @rule(r=replica_ids)
    def remove(self, r: str) -> None:
        self.index.remove_replica(r)
        self.ref.lru.pop(r, None)

    @invariant()
    def consistent(self) -> None:
        self.index.check_invariants()
        for r in ("r0", "r1", "r2"):
            assert self.index.cached_tokens(r) == len(self.ref.lru.get(r, ())) * B


TestIndexMachine = IndexMachine.TestCase
TestIndexMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_match_is_read_only_and_eviction_drops_the_oldest_prompt() -> None:
    idx = PrefixIndex(block_tokens=2, capacity_tokens=8)  # 4 blocks
    a, b, c = [1, 1, 1, 1], [2, 2, 2, 2], [3, 3, 3, 3]
    idx.insert(a, "x")
    idx.insert(b, "x")
    for _ in range(3):
        assert idx.match(a) == {"x": 4}  # matching does not refresh a
    idx.insert(c, "x")  # 6 blocks > 4: a's two go
    assert idx.match(a) == {} and idx.match(b) == {"x": 4} and idx.match(c + [9]) == {"x": 4}
    idx.retain(["y"])
    assert idx.match(b) == {} and idx.replicas == []


@pytest.mark.parametrize(("kw", "field"), [
    ({"block_tokens": 0}, "block_tokens"), ({"capacity_tokens": 3}, "capacity_tokens"),
    ({"cache_threshold": 1.5}, "cache_threshold"), ({"balance_abs": -1}, "balance_abs"),
    ({"balance_rel": 0.5}, "balance_rel"), ({"balance_abs": 2.5}, "balance_abs"),
])  # fmt: skip
def test_bad_thresholds_name_the_field(kw: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        RoutingThresholds(**{"block_tokens": 4, **kw})


def test_choose_needs_a_replica() -> None:
    with pytest.raises(ValueError, match="loads"):
        choose_replica([1, 2], {}, PrefixIndex(4), RoutingThresholds(block_tokens=4))


@settings(max_examples=150, deadline=None)
@given(
    history=st.lists(st.tuples(prompts, replica_ids), max_size=8),
    ids=prompts,
    loads=st.fixed_dictionaries({"r0": st.integers(0, 20), "r1": st.integers(0, 20), "r2": st.integers(0, 20)}),
    cache_threshold=st.sampled_from([0.0, 0.3, 0.5, 0.9, 1.0]),
    balance_abs=st.integers(0, 10),
    balance_rel=st.sampled_from([1.0, 1.5, 3.0]),
)
def test_choose_replica_follows_its_rules(history, ids, loads, cache_threshold, balance_abs, balance_rel) -> None:
    t = RoutingThresholds(cache_threshold=cache_threshold, balance_abs=balance_abs, balance_rel=balance_rel,
                          block_tokens=B, capacity_tokens=CAP)  # fmt: skip
    idx = PrefixIndex(B, CAP)
    ref = _Reference()
    for p, r in history:
        idx.insert(p, r)
        ref.insert(p, r)
    route = choose_replica(ids, loads, idx, t)
    match = ref.match(ids)
    hi, lo = max(loads.values()), min(loads.values())
    assert route.matched_tokens == match.get(route.replica, 0)
    if hi - lo > balance_abs and hi > balance_rel * lo:
        assert route.reason == "balance" and loads[route.replica] == lo
        return
    best = max(match.values(), default=0)
    if best > 0 and best >= cache_threshold * len(ids):
        assert route.reason == "prefix" and match[route.replica] == best
        assert loads[route.replica] == min(loads[r] for r in loads if match.get(r, 0) == best)
    else:
        assert route.reason == "spread" and loads[route.replica] == lo
        assert idx.cached_tokens(route.replica) == min(idx.cached_tokens(r) for r in loads if loads[r] == lo)


def test_shared_system_prompts_stick_to_one_replica_each() -> None:
    """The bench's workload in miniature: 8 system prompts x 6 users, balanced loads. Each prompt's
    first request spreads (the replicas get 4 prompts each); every later one follows its prefix."""
    t = RoutingThresholds(block_tokens=16)
    idx = PrefixIndex(16, 1 << 20)
    systems = [[1000 + s] * 300 for s in range(8)]
    owner: dict[int, str] = {}
    loads = {"a": 0, "b": 0}
    for user in range(6):
        for s, system in enumerate(systems):
            ids = system + [user, s, 7]
            route = choose_replica(ids, loads, idx, t)
            idx.insert(ids, route.replica)
            if user == 0:
                assert route.reason == "spread"
                owner[s] = route.replica
                loads[route.replica] += 1  # it keeps running: the next prompt goes to the other
            else:
                assert route == (owner[s], "prefix", 288)
    assert sorted(owner.values()).count("a") == 4


def test_pending_choices_count_until_sent_or_expired() -> None:
    now = [0.0]
    pending = PendingChoices(horizon_s=1.0, clock=lambda: now[0])
    for i, r in enumerate(["a", "a", "b"]):
        pending.chose(r, f"req{i}")
    assert pending.counts(["a", "b", "c"]) == {"a": 2, "b": 1, "c": 0}
    pending.sent("a")
    pending.sent("c")  # a send the router did not choose (a fallback rank): nothing to settle
    assert pending.counts(["a", "b", "c"]) == {"a": 1, "b": 1, "c": 0}
    pending.chose("b", "req1")  # req1 backed off and was routed again: its choice moves, not adds
    assert pending.counts(["a", "b", "c"]) == {"a": 0, "b": 2, "c": 0}
    now[0] = 0.5
    pending.chose("c", "req3")
    now[0] = 1.2  # the choices made at 0.0 were never sent: they no longer count
    assert pending.counts(["a", "b", "c"]) == {"a": 0, "b": 0, "c": 1}
    pending.forget("c")
    assert pending.counts(["c"]) == {"c": 0}
    pending.chose("b", "req6")
    pending.chose("c", "req7")
    pending.retain(["c"])  # b left the deployment
    assert pending.counts(["b", "c"]) == {"b": 0, "c": 1}
    pending.chose("a", "req4")
    now[0] = 1.8
    pending.chose("a", "req5")
    now[0] = 2.4  # req4 expired, with no count read since: a send settles req5, the live one
    pending.sent("a")
    assert pending.counts(["a"]) == {"a": 0}
    with pytest.raises(ValueError, match="horizon_s"):
        PendingChoices(horizon_s=0)


@settings(max_examples=100, deadline=None)
@given(n_replicas=st.integers(1, 4), burst=st.integers(1, 24), stale=st.integers(0, 3))
def test_a_burst_of_new_prompts_spreads_while_loads_are_stale(n_replicas, burst, stale) -> None:
    """Requests routed before Ray Serve sends any see the same (stale) loads: counted as pending,
    they spread evenly over the replicas instead of piling onto the first."""
    t = RoutingThresholds(block_tokens=B, capacity_tokens=CAP)
    idx = PrefixIndex(B, CAP)
    pending = PendingChoices()
    replicas = [f"r{i}" for i in range(n_replicas)]
    got = dict.fromkeys(replicas, 0)
    for i in range(burst):
        extra = pending.counts(replicas)
        route = choose_replica([9000 + i, 7], {r: stale + extra[r] for r in replicas}, idx, t)
        idx.insert([9000 + i, 7], route.replica)
        pending.chose(route.replica, i)
        got[route.replica] += 1
    assert max(got.values()) - min(got.values()) <= 1, got


class PendingChoicesMachine(RuleBasedStateMachine):
    """PendingChoices against a list of (request, replica, time) in the order chosen: a request's new
    choice replaces its old one, a send settles the replica's oldest, a choice expires after the horizon."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.pending = PendingChoices(horizon_s=1.0, clock=lambda: self.now)
        self.model: list[tuple[int, str, float]] = []

    @rule(replica=st.sampled_from("ab"), request=st.integers(0, 3))
    def chose(self, replica: str, request: int) -> None:
        self.pending.chose(replica, request)
        self.model = [c for c in self.model if c[0] != request] + [(request, replica, self.now)]

    @rule(replica=st.sampled_from("abc"), dt=st.sampled_from([0.0, 0.6]))
    def sent(self, replica: str, dt: float) -> None:
        self.now += dt  # time may pass with no count read in between (counts drops expired choices)
        self.pending.sent(replica)
        live = [c for c in self.model if c[2] >= self.now - 1.0]
        mine = [c for c in live if c[1] == replica]
        self.model = [c for c in live if c is not mine[0]] if mine else live

    @rule(dt=st.sampled_from([0.6, 1.5]))
    def wait(self, dt: float) -> None:
        self.now += dt

    @rule(replica=st.sampled_from("ab"))
    def forget(self, replica: str) -> None:
        self.pending.forget(replica)
        self.model = [c for c in self.model if c[1] != replica]

    @invariant()
    def counts_match(self) -> None:
        live = [c for c in self.model if c[2] >= self.now - 1.0]
        assert self.pending.counts(list("abc")) == {r: sum(c[1] == r for c in live) for r in "abc"}


TestPendingChoices = PendingChoicesMachine.TestCase
TestPendingChoices.settings = settings(max_examples=200, stateful_step_count=20, deadline=None)
