"""The async engine (slow readers get merged deltas, aborts free pages) and client disconnects
over raw ASGI (streaming and not): the request is aborted and every page comes back."""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from treeserve import SamplingParams
from treeserve.server.api import build_app
from treeserve.server.engine_client import AsyncLLMEngine, EngineDeadError, QueueFullError, RequestStream

from ._helpers import MODEL, assert_engine_drained, running, synthetic_llm, wait_until


@pytest.fixture(scope="module")
def engine():
    eng = AsyncLLMEngine(synthetic_llm())
    with running(eng):
        yield eng


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


def test_slow_reader_gets_one_merged_delta_per_sample(engine) -> None:
    sp = SamplingParams(n=2, max_new_tokens=24, ignore_eos=True, seed=5, logprobs=1)
    (ref,) = engine.llm.generate([[5, 6, 7, 8]], sp, use_tqdm=False)

    async def go():
        stream = await engine.add_request([5, 6, 7, 8], sp, "slow")
        await asyncio.to_thread(wait_until, lambda: "slow" not in engine._streams, 60, "the request to finish")
        assert len(stream._pending) == 2  # bounded: one pending delta per sample, however far behind
        deltas = await stream.get()
        assert stream.finished and [d.index for d in deltas] == [0, 1]
        for d, out in zip(deltas, ref.outputs):
            assert d.token_ids == out.token_ids and d.text == out.text and d.finish_reason == "length"
            assert d.logprobs == pytest.approx(out.logprobs, abs=1e-4) and len(d.top_logprobs) == 24
        assert [x async for x in stream] == []

    run(go())
    assert_engine_drained(engine)


def test_abort_closes_stream_and_frees_pages(engine) -> None:
    async def go():
        stream = await engine.add_request(list(range(3, 60)), SamplingParams(max_new_tokens=400, ignore_eos=True), "ab")
        first = await stream.get()
        assert first and first[0].token_ids
        engine.abort("ab")
        engine.abort("ab")  # idempotent
        rest = [d async for ds in stream for d in ds]
        assert stream.closed_reason == "abort" and all(d.finish_reason is None for d in rest)

    run(go())
    assert_engine_drained(engine)


def test_add_request_errors(engine) -> None:
    async def go():
        with pytest.raises(ValueError, match="max_model_len"):
            await engine.add_request([3] * 600, SamplingParams(), "long")
        with pytest.raises(ValueError, match="token ids"):
            await engine.add_request([10**8], SamplingParams(), "vocab")
        assert "long" not in engine._streams and "vocab" not in engine._streams
        full = AsyncLLMEngine(engine.llm, max_live_requests=1)
        full._thread, full._go = engine._thread, engine._go  # healthy without a second loop: the limit is checked first
        full._streams["x"] = RequestStream("x", 1, asyncio.get_running_loop())
        with pytest.raises(QueueFullError):
            await full.add_request([3, 4], SamplingParams(), "y")

    run(go())
    with pytest.raises(ValueError, match="max_live_requests"):
        AsyncLLMEngine(engine.llm, max_live_requests=0)
    dead = AsyncLLMEngine(engine.llm)
    with pytest.raises(EngineDeadError):
        run(dead.add_request([3, 4], SamplingParams(), "z"))
    assert_engine_drained(engine)


def _scope(path: str) -> dict:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
            "root_path": "", "headers": [(b"content-type", b"application/json"), (b"host", b"test")],
            "client": ("127.0.0.1", 1234), "server": ("test", 80)}  # fmt: skip


async def call_then_disconnect(app, path: str, body: dict, engine: AsyncLLMEngine, after_chunks: int) -> int:
    """Send ``body``; disconnect after ``after_chunks`` body chunks (0: once the request is live
    in the engine). Returns the number of body chunks the app sent."""
    disconnect = asyncio.Event()
    chunks = 0
    sent_body = False

    async def receive():
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
        await disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(msg):
        nonlocal chunks
        if msg["type"] == "http.response.body" and msg.get("body"):
            chunks += 1
            if after_chunks and chunks >= after_chunks:
                disconnect.set()

    task = asyncio.create_task(app(_scope(path), receive, send))
    if not after_chunks:
        for _ in range(1000):
            if engine._streams:
                break
            await asyncio.sleep(0.01)
        assert engine._streams, "the request never went live"
        disconnect.set()
    await asyncio.wait_for(task, 60)
    return chunks


@pytest.mark.parametrize("stream, after_chunks", [(True, 3), (True, 0), (False, 0)])
def test_disconnect_aborts_and_frees_pages(engine, stream, after_chunks) -> None:
    app = build_app(engine, MODEL)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "tell me a long story"}], "max_tokens": 400,
            "ignore_eos": True, "stream": stream, "n": 2}  # fmt: skip
    before = engine.llm.metrics.generated_tokens
    chunks = run(call_then_disconnect(app, "/v1/chat/completions", body, engine, after_chunks))
    assert chunks < 100
    assert_engine_drained(engine)
    assert engine.llm.metrics.generated_tokens - before < 2 * 400  # aborted: never ran to the end


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.tuples(st.integers(1, 3), st.integers(1, 40), st.sampled_from(["done", "abort", "drop"])),
                min_size=1, max_size=6))  # fmt: skip
def test_random_mix_of_finishes_aborts_and_drops_keeps_invariants(engine, plan) -> None:
    app = build_app(engine, MODEL)

    async def one(i: int, n: int, max_tokens: int, how: str):
        body = {"model": MODEL, "prompt": f"shared prefix for all of them, then {i}", "n": n,
                "max_tokens": max_tokens, "ignore_eos": True, "stream": how == "drop"}  # fmt: skip
        if how == "drop":
            await call_then_disconnect(app, "/v1/completions", body, engine, after_chunks=2)
        elif how == "abort":
            stream = await engine.add_request(engine.tokenizer.encode(body["prompt"]),
                                              SamplingParams(n=n, max_new_tokens=max_tokens, ignore_eos=True), f"m{i}")  # fmt: skip
            await stream.get()
            engine.abort(f"m{i}")
        else:
            await call_then_disconnect(app, "/v1/completions", body, engine, after_chunks=10**9)

    async def go():
        await asyncio.gather(*(one(i, *p) for i, p in enumerate(plan)))

    run(go())
    assert_engine_drained(engine)


def test_build_makes_and_steps_the_llm_on_one_thread() -> None:
    """``AsyncLLMEngine.build``: the factory runs on the engine thread, the deferred large-batch
    weights are built there before any step (``LLM.prepare_large``), every step runs there too (one
    OpenMP pool), nothing steps before ``start``; a factory's error reaches the caller."""
    import threading

    where: dict[str, set[int]] = {"built": set(), "prepared": set(), "stepped": set()}

    def factory():
        where["built"].add(threading.get_ident())
        llm = synthetic_llm()
        prepare = llm.prepare_large

        def recorded() -> int:
            assert not where["stepped"]
            where["prepared"].add(threading.get_ident())
            return prepare()

        llm.prepare_large = recorded
        return llm

    eng = AsyncLLMEngine.build(factory)
    eng.step_observer = lambda seconds: where["stepped"].add(threading.get_ident())
    assert not eng.is_healthy() and where["built"] and threading.get_ident() not in where["built"]
    assert where["prepared"] == where["built"]
    with running(eng):
        assert eng.is_healthy()

        async def go():
            stream = await eng.add_request([5, 6, 7], SamplingParams(max_new_tokens=6, ignore_eos=True), "b")
            return [d for ds in [x async for x in stream] for d in ds]

        deltas = run(go())
        assert sum(len(d.token_ids) for d in deltas) == 6
    assert where["stepped"] == where["built"] and not eng.is_healthy()
    assert_engine_drained(eng)

    def broken():
        raise ValueError("no such model: 'x'")

    with pytest.raises(ValueError, match="no such model"):
        AsyncLLMEngine.build(broken)
    with pytest.raises(ValueError, match="max_live_requests"):
        AsyncLLMEngine.build(synthetic_llm, max_live_requests=0)
    never = AsyncLLMEngine.build(synthetic_llm)
    never.shutdown()  # before start: the waiting thread ends, nothing ran
    assert not never.is_healthy() and never.llm.metrics.steps == 0
