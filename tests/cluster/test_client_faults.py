"""``ClusterEngineClient``'s fault handling against a scripted deployment handle (no cluster): a
replica that dies before any output is retried, one that dies after output closes the stream
with the replica-died reason, refusals keep their exception types, aborts cancel the call."""

from __future__ import annotations

import asyncio

import pytest

import ray  # noqa: F401  (the "cluster" extra, which `make test` installs: no skip without it)

from ray.exceptions import ActorDiedError  # noqa: E402

from treeserve.cluster.client import REPLICA_DIED, REPLICAS_DIED, ClusterEngineClient, summed_stats  # noqa: E402
from treeserve.cluster.launch import deploy, replica_threads  # noqa: E402
from treeserve.cluster.wire import Accepted, Closed, EngineInfo, Refused  # noqa: E402
from treeserve.output import SampleDelta  # noqa: E402
from treeserve.sampling import SamplingParams  # noqa: E402
from treeserve.server.engine_client import EngineDeadError, QueueFullError  # noqa: E402

HANG = "hang"


def _delta(text: str, finish: str | None = None) -> list[SampleDelta]:
    return [SampleDelta("r", 0, text, [1] * len(text), [], [], finish, None, 3, 0)]


class _Call:
    def __init__(self, script: list) -> None:
        self.script, self.cancelled = script, False

    def __aiter__(self):
        return self._gen()

    async def _gen(self):
        for item in self.script:
            if isinstance(item, BaseException):
                raise item
            if item == HANG:
                await asyncio.sleep(3600)
            yield item

    def cancel(self) -> None:
        self.cancelled = True


class _Handle:
    deployment_name = "fake"

    def __init__(self, *scripts: list) -> None:
        self.scripts, self.calls = list(scripts), []

    def options(self, **_: object) -> _Handle:
        return self

    def remote(self, ids: list[int], params: SamplingParams, rid: str) -> _Call:
        call = _Call(self.scripts.pop(0))
        self.calls.append(call)
        return call


def _client(handle: _Handle, **kw) -> ClusterEngineClient:
    c = ClusterEngineClient(handle, EngineInfo("m", None, 64), **kw)  # type: ignore[arg-type]
    c.start()
    return c


async def _read(stream) -> tuple[str, str | None]:
    text, finish = "", None
    async for deltas in stream:
        for d in deltas:
            text, finish = text + d.text, d.finish_reason
    return text, finish


def test_death_before_output_is_retried_on_another_call() -> None:
    async def go():
        h = _Handle([Accepted(), ActorDiedError()], [Accepted(), _delta("ab"), _delta("c", "length")])
        c = _client(h)
        s = await c.add_request([1, 2], SamplingParams(max_new_tokens=3), "r")
        assert await _read(s) == ("abc", "length") and s.closed_reason is None
        assert c.retries == 1 and len(h.calls) == 2 and not c._streams

    asyncio.run(go())


def test_death_after_output_fails_the_request_with_a_clear_reason() -> None:
    async def go():
        h = _Handle([Accepted(), _delta("ab"), ActorDiedError()], [Accepted(), _delta("never")])
        c = _client(h)
        s = await c.add_request([1, 2], SamplingParams(max_new_tokens=3), "r")
        await asyncio.sleep(0.05)  # the pump ran to the death: the output so far is pending, the stream closed
        assert [d.text for d in await s.get()] == ["ab"] and s.finished
        assert s.closed_reason == REPLICA_DIED and c.retries == 0 and len(h.calls) == 1

    asyncio.run(go())


def test_death_on_every_attempt_after_acceptance_closes_with_the_attempt_count() -> None:
    async def go():
        c = _client(_Handle([Accepted(), ActorDiedError()], [Accepted(), ActorDiedError()]), max_attempts=2)
        s = await c.add_request([1], SamplingParams(), "r")
        assert await _read(s) == ("", None) and s.closed_reason == REPLICAS_DIED.format(2) and c.retries == 1

    asyncio.run(go())


def test_death_on_every_attempt_before_acceptance_raises_engine_dead() -> None:
    async def go():
        c = _client(_Handle([ActorDiedError()], [ActorDiedError()]), max_attempts=2)
        with pytest.raises(EngineDeadError, match="no replica could serve"):
            await c.add_request([1], SamplingParams(), "r")
        assert not c._streams

    asyncio.run(go())


@pytest.mark.parametrize(("kind", "exc"), [("ValueError", ValueError), ("TypeError", TypeError),
                                           ("QueueFullError", QueueFullError), ("EngineDeadError", EngineDeadError)])  # fmt: skip
def test_refusals_keep_their_type_and_message(kind: str, exc: type) -> None:
    async def go():
        c = _client(_Handle([Refused(kind, "prompt is too long: 70 tokens, max_model_len 64")]))
        with pytest.raises(exc, match="prompt is too long"):
            await c.add_request([1], SamplingParams(), "r")
        assert not c._streams

    asyncio.run(go())


def test_abort_cancels_the_call_and_a_replica_close_ends_the_stream() -> None:
    async def go():
        h = _Handle([Accepted(), _delta("a"), HANG], [Accepted(), Closed("shutdown")])
        c = _client(h)
        s = await c.add_request([1], SamplingParams(), "r1")
        assert (await s.get())[0].text == "a"
        c.abort("r1")
        assert s.closed_reason == "abort"
        await asyncio.sleep(0.05)
        assert h.calls[0].cancelled and not c._pumps
        s2 = await c.add_request([1], SamplingParams(), "r2")
        assert await _read(s2) == ("", None) and s2.closed_reason == "shutdown"

    asyncio.run(go())


def test_limits_and_shutdown() -> None:
    async def go():
        c = _client(_Handle([Accepted(), HANG], [Accepted(), HANG]), max_live_requests=1)
        s = await c.add_request([1], SamplingParams(), "r1")
        with pytest.raises(QueueFullError):
            await c.add_request([1], SamplingParams(), "r2")
        c.shutdown()
        assert s.closed_reason == "shutdown" and not c.is_healthy()
        with pytest.raises(EngineDeadError, match="shut down"):
            await c.add_request([1], SamplingParams(), "r3")

    asyncio.run(go())
    with pytest.raises(ValueError, match="max_attempts"):
        ClusterEngineClient(_Handle(), EngineInfo("m", None, 64), max_attempts=0)  # type: ignore[arg-type]


def test_replica_threads_share_the_cpus_and_reject_bad_counts() -> None:
    assert [replica_threads(n, None, 16) for n in (1, 2, 3, 32)] == [16, 8, 5, 1]
    assert replica_threads(2, 3, 2) == 3
    for kw, field in (({"replicas": 0}, "replicas"), ({"threads": 0}, "threads"), ({"replicas": 1.5}, "replicas")):
        with pytest.raises(ValueError, match=field):
            replica_threads(**{"replicas": 2, "threads": None, "cpus": 4, **kw})
    with pytest.raises(ValueError, match="router must be one of"):
        deploy({}, replicas=1, threads=1, router="round-robin")


def test_replica_stats_sum_field_by_field_nested_ones_too() -> None:
    """/metrics of the cluster: the replicas' EngineStats (as the dicts they report) summed,
    the KV-tier counters inside them too; a replica that lacks a field counts 0."""
    import dataclasses

    from treeserve.kvcache.tiers import TierStats
    from treeserve.server.engine_client import EngineStats

    a = EngineStats(num_running=2, steps=5, busy_seconds=1.5, kv_tiers=TierStats(host_hit_tokens=64, disk_errors=1))
    b = EngineStats(num_running=1, steps=7, busy_seconds=0.5, kv_tiers=TierStats(host_hit_tokens=128))
    old = {"num_running": 3}  # a replica of an older build, without most fields
    total = summed_stats(EngineStats, [dataclasses.asdict(a), dataclasses.asdict(b), old])
    assert (total.num_running, total.steps, total.busy_seconds) == (6, 12, 2.0)
    assert total.kv_tiers == TierStats(host_hit_tokens=192, disk_errors=1)
