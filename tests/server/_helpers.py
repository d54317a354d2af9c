"""Small engines and an in-process HTTP client for the server tests.

``synthetic_llm``: a seeded random 2-layer model over the embedded SmolLM2 tokenizer (real chat
template, real multi-byte text), fast on CPU. ``scripted_llm``: a model that writes a fixed text
greedily, for exact stop-string and streaming checks. ``serve`` runs an app around an engine and
hands back an ``httpx.AsyncClient`` speaking to it in process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx
import torch

from treeserve import LLM
from treeserve.models import random_model, tiny_config
from treeserve.server.api import build_app
from treeserve.server.engine_client import AsyncLLMEngine

from ..engine._scripted import ScriptedModel, smol_tokenizer

MODEL = "tiny-synthetic"
ENGINE = dict(kv_cache_tokens=4096, max_batched_tokens=128, max_running=16, max_model_len=512, page_size=4)


def synthetic_llm(wrap: Callable[[torch.nn.Module], torch.nn.Module] | None = None, **kw: Any) -> LLM:
    """The synthetic engine; ``wrap`` replaces its model by ``wrap(model)`` (e.g. a poisoned one)."""
    tok = smol_tokenizer()
    cfg = tiny_config("llama", vocab_size=tok.vocab_size, eos_token_ids=tok.eos_token_ids, max_position_embeddings=1024)
    model = random_model(cfg, seed=0, init_std=0.3)
    return LLM((wrap(model) if wrap else model, tok), **{**ENGINE, **kw})


def scripted_llm(text: str, prompt_len: int, **kw: Any) -> LLM:
    tok = smol_tokenizer()
    script = tok.encode(text, add_special_tokens=False)
    model = ScriptedModel(script, prompt_len, tok.vocab_size, fill=script[-1])
    return LLM((model, tok), **{**ENGINE, **kw})


@contextlib.contextmanager
def running(engine: AsyncLLMEngine) -> Iterator[AsyncLLMEngine]:
    engine.start()
    try:
        yield engine
    finally:
        engine.shutdown()


@contextlib.asynccontextmanager
async def http(engine: AsyncLLMEngine, name: str = MODEL) -> AsyncIterator[httpx.AsyncClient]:
    """An httpx client on an app over ``engine`` (already started: ASGITransport runs no lifespan)."""
    app = build_app(engine, name)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=60) as c:
        c.app = app  # type: ignore[attr-defined]
        yield c


def sse_events(body: str) -> list[Any]:
    """The JSON events of a server-sent-events body; asserts the stream ends with ``[DONE]``."""
    datas = [line[len("data: "):] for line in body.split("\n") if line.startswith("data: ")]
    assert datas and datas[-1] == "[DONE]", f"stream did not end with [DONE]: {datas[-3:]}"
    return [json.loads(d) for d in datas[:-1]]


def wait_until(pred, timeout: float = 20.0, what: str = "condition") -> None:
    """Poll ``pred`` (bounded in time) until true."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


async def async_wait_until(pred, timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def assert_engine_drained(engine: AsyncLLMEngine) -> None:
    """No request left, every page back (free or reclaimable), scheduler/radix invariants hold."""
    llm = engine.llm
    wait_until(lambda: not llm.has_unfinished_requests() and engine.stats().kv_usage == 0.0,
               what="the engine to drain")  # fmt: skip
    with llm._lock:  # the engine thread is idle; hold the lock while reading
        alloc = llm.kv.allocator
        assert llm.radix.protected_tokens == 0
        assert alloc.num_free + llm.radix.evictable_tokens // llm.kv.page_size == alloc.capacity
        llm.scheduler.check_invariants()
