"""The async engine: one ``LLM`` stepped on its own thread behind the :class:`EngineClient`
interface (add a request, abort it, read its outputs as an async stream).

Threads: the engine thread is the only one that calls ``LLM.add_request`` / ``step`` /
``abort_request``; the asyncio side hands it commands through a queue and receives outputs
through one :class:`RequestStream` per request. A stream holds at most one pending
``SampleDelta`` per sample: when the reader is slower than the engine, new deltas merge into the
pending one (text and tokens concatenated), so memory never grows with the reader's lag beyond the
request's own output.

Everything the HTTP layer needs from engine internals (queue and KV gauges) goes through
:func:`read_engine_stats`, the one function that reads them.
"""

from __future__ import annotations

import abc
import asyncio
import collections
import logging
import threading
import time
from collections.abc import Callable, Collection
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any

from treeserve.engine import LLM
from treeserve.kvcache import TierStats
from treeserve.output import SampleDelta
from treeserve.sampling import SamplingParams

__all__ = [
    "AsyncLLMEngine",
    "EngineClient",
    "EngineDeadError",
    "EngineStats",
    "QueueFullError",
    "RequestStream",
    "check_admission",
    "read_engine_stats",
]

log = logging.getLogger("treeserve.server")


class QueueFullError(RuntimeError):
    """The engine holds as many live requests as it accepts; retry later (HTTP 503)."""


class EngineDeadError(RuntimeError):
    """The engine loop stopped (shut down or crashed); no request can be served."""


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot of the engine's queue and KV state (pages of ``page_size`` tokens).

    ``kv_usage`` counts pages held by requests (running samples and prefixes they lock) as used;
    pages only kept by the prefix cache are reclaimable, so they count as free (vLLM's meaning).
    ``steps`` / ``busy_seconds``: engine steps so far and the time spent in them (schedule,
    forward, sample, update), to tell engine time from serving overhead. ``draft_tokens`` /
    ``accepted_tokens`` / ``verify_steps``: speculative decoding's proposed and accepted draft
    tokens and its verify passes (request-steps that verified a draft); ``jump_forward_proposed``
    / ``jump_forward_tokens``: structured output's jump-forward tokens proposed and accepted
    (each accepted one a forward pass saved). ``prompt_tokens`` and
    ``kv_tiers``: the engine's prompt tokens and KV-tier hits and bytes moved (``LLM.metrics``).
    """

    num_running: int = 0
    num_waiting: int = 0
    kv_total_pages: int = 1
    kv_free_pages: int = 1
    kv_cached_pages: int = 0
    steps: int = 0
    busy_seconds: float = 0.0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    verify_steps: int = 0
    jump_forward_proposed: int = 0
    jump_forward_tokens: int = 0
    prompt_tokens: int = 0
    kv_tiers: TierStats = field(default_factory=TierStats)

    @property
    def kv_usage(self) -> float:
        used = self.kv_total_pages - self.kv_free_pages - self.kv_cached_pages
        return used / self.kv_total_pages if self.kv_total_pages else 0.0


def read_engine_stats(llm: LLM) -> EngineStats:
    """Queue and KV gauges of ``llm``; the only reader of engine internals in the server (call it
    where no step runs concurrently, i.e. on the engine thread)."""
    sched, alloc, m = llm.scheduler, llm.kv.allocator, llm.metrics
    return EngineStats(
        num_running=len(sched.running),
        num_waiting=len(sched.waiting),
        kv_total_pages=alloc.capacity,
        kv_free_pages=alloc.num_free,
        kv_cached_pages=llm.radix.evictable_tokens // llm.kv.page_size,
        steps=m.steps,
        busy_seconds=m.busy_seconds,
        draft_tokens=m.draft_tokens,
        accepted_tokens=m.accepted_tokens,
        verify_steps=m.verify_steps,
        jump_forward_proposed=m.jump_forward_proposed,
        jump_forward_tokens=m.jump_forward_tokens,
        prompt_tokens=m.prompt_tokens,
        kv_tiers=replace(m.kv_tiers),  # a snapshot: the engine keeps counting
    )


def _merge(a: SampleDelta, b: SampleDelta) -> SampleDelta:
    """``a`` followed by ``b`` as one delta (the later finish fields win)."""
    return SampleDelta(
        request_id=b.request_id,
        index=b.index,
        text=a.text + b.text,
        token_ids=a.token_ids + b.token_ids,
        logprobs=a.logprobs + b.logprobs,
        top_logprobs=a.top_logprobs + b.top_logprobs,
        finish_reason=b.finish_reason,
        stop_reason=b.stop_reason,
        num_prompt_tokens=b.num_prompt_tokens,
        num_cached_tokens=b.num_cached_tokens,
        error=b.error,
    )


class RequestStream:
    """The outputs of one request, read with ``async for deltas in stream`` (a list with at most
    one merged delta per sample each time).

    Iteration ends when all ``n`` samples finished, or when the request was closed by an abort or
    a shutdown (then ``closed_reason`` is set and samples may be unfinished). Timing fields (for
    metrics): ``arrival``, ``first_token_at``, ``step_gaps`` (seconds between consecutive steps
    that gave this request tokens), ``last_token_at``, all ``time.perf_counter`` values written by the engine thread.
    """

    def __init__(self, request_id: str, n: int, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.n = n
        self.arrival = time.perf_counter()
        self.first_token_at: float | None = None
        self.step_gaps: list[float] = []
        self.closed_reason: str | None = None
        self.last_token_at: float | None = None
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: dict[int, SampleDelta] = {}
        self._event = asyncio.Event()
        self._signaled = False
        self._finished: set[int] = set()
        self._delivered_all = False
        self._engine_finished = 0  # samples whose final delta the engine produced

    @property
    def finished(self) -> bool:
        """Every sample's final delta was handed to the reader, or the stream was closed."""
        return self._delivered_all or self.closed_reason is not None

    # -- engine thread
    def _push(self, deltas: list[SampleDelta]) -> None:
        now = time.perf_counter()
        if any(d.token_ids for d in deltas):
            if self.first_token_at is None:
                self.first_token_at = now
            elif self.last_token_at is not None:
                self.step_gaps.append(now - self.last_token_at)
            self.last_token_at = now
        self._engine_finished += sum(d.finish_reason is not None for d in deltas)
        with self._lock:
            for d in deltas:
                old = self._pending.get(d.index)
                self._pending[d.index] = d if old is None else _merge(old, d)
            self._signal_locked()

    def _close(self, reason: str) -> None:
        with self._lock:
            if self.closed_reason is None:
                self.closed_reason = reason
            self._signal_locked()

    def _signal_locked(self) -> None:
        if not self._signaled:
            self._signaled = True
            try:
                self._loop.call_soon_threadsafe(self._event.set)
            except RuntimeError:  # the event loop is closed: nobody reads any more
                pass

    # -- asyncio side
    async def get(self) -> list[SampleDelta]:
        """Wait for new output; return the merged deltas (sample order). Empty only when the
        stream was closed with nothing pending."""
        await self._event.wait()
        self._event.clear()
        with self._lock:
            out = [self._pending[i] for i in sorted(self._pending)]
            self._pending.clear()
            self._signaled = False
        self._finished.update(d.index for d in out if d.finish_reason is not None)
        if len(self._finished) == self.n:
            self._delivered_all = True
        return out

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> list[SampleDelta]:
        if self.finished:
            raise StopAsyncIteration
        out = await self.get()
        if not out and self.closed_reason is not None:
            raise StopAsyncIteration
        return out


class EngineClient(abc.ABC):
    """What the HTTP layer needs from an engine; an in-thread engine today, a process later.

    ``tokenizer`` and ``max_model_len`` describe the served model. ``add_request`` raises
    ``ValueError`` / ``TypeError`` for bad input (nothing queued), :class:`QueueFullError` when
    full and :class:`EngineDeadError` when the engine is gone. ``step_observer``, when set, is
    called with each engine step's wall time in seconds (on the engine's side: keep it cheap and
    thread-safe, e.g. a Prometheus histogram's ``observe``).
    """

    tokenizer: Any
    max_model_len: int
    step_observer: Callable[[float], None] | None = None

    @abc.abstractmethod
    async def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str) -> RequestStream:
        """Queue a tokenized prompt; return the stream of its outputs."""

    @abc.abstractmethod
    def abort(self, request_id: str) -> None:
        """Abort a live request (no-op when unknown or done): its pages are freed by the next
        engine iteration and its stream closes with ``closed_reason == "abort"``. Never blocks."""

    @abc.abstractmethod
    def stats(self) -> EngineStats:
        """The latest queue / KV snapshot."""

    @abc.abstractmethod
    def is_healthy(self) -> bool:
        """True while the engine loop runs."""

    @abc.abstractmethod
    def start(self) -> None:
        """Start the engine loop (idempotent)."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop the loop, abort every live request and close their streams (idempotent)."""


def check_admission(live: Collection[str], max_live_requests: int, request_id: str) -> None:
    """Raise what a new request gets from an :class:`EngineClient` holding the ``live`` request
    ids: :class:`QueueFullError` at ``max_live_requests``, ``ValueError`` for an id already live."""
    if len(live) >= max_live_requests:
        raise QueueFullError(f"the server holds {len(live)} live requests, its limit")
    if request_id in live:
        raise ValueError(f"request_id {request_id!r} is already live")


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    done: Future = field(default_factory=Future)


class AsyncLLMEngine(EngineClient):
    """:class:`EngineClient` over an :class:`LLM` stepped on a daemon thread.

    ``max_live_requests``: requests accepted at once (running + waiting, each with its ``n``
    samples); one more gets :class:`QueueFullError`. ``idle_wait``: seconds the loop sleeps when
    idle before re-checking (commands wake it at once).

    On CPU, prefer :meth:`build`, which constructs the ``LLM`` on the engine thread itself.
    """

    @classmethod
    def build(cls, factory: Callable[[], LLM], max_live_requests: int = 1024, idle_wait: float = 0.5) -> AsyncLLMEngine:
        """An engine whose ``LLM`` is made by ``factory()`` on the engine thread, with the large-batch
        weights that loading deferred built there too (``LLM.prepare_large``), which then steps it once
        :meth:`start` is called (``factory``'s exception is re-raised here).

        Why: OpenMP (libgomp) keeps one worker pool per thread that opens parallel regions, and
        its workers stop spinning between regions once more threads exist than cores. A model
        loaded (its GEMMs measured) on one thread and stepped on another left two pools, and made
        every decode step of the served benchmark ~1.6x slower on a 2-core EPYC
        (benches/RESULTS.md); with load and steps on one thread there is one pool.
        """
        built: Future[LLM] = Future()
        go = threading.Event()
        box: list[AsyncLLMEngine] = []

        def run() -> None:
            try:
                llm = factory()
                llm.prepare_large()  # before serving: a first large request would otherwise build them
            except BaseException as exc:  # handed to the caller, which re-raises it
                built.set_exception(exc)
                return
            built.set_result(llm)
            go.wait()
            if box and not box[0]._stop.is_set():  # empty: the engine's own checks failed
                box[0]._loop()

        thread = threading.Thread(target=run, name="treeserve-engine", daemon=True)
        thread.start()
        try:
            engine = cls(built.result(), max_live_requests, idle_wait)
        except BaseException:
            go.set()
            raise
        engine._thread, engine._go = thread, go
        box.append(engine)
        return engine

    def __init__(self, llm: LLM, max_live_requests: int = 1024, idle_wait: float = 0.5) -> None:
        if not isinstance(max_live_requests, int) or max_live_requests < 1:
            raise ValueError(f"max_live_requests must be an int >= 1, got {max_live_requests!r}")
        self.llm = llm
        self.tokenizer = llm.tokenizer
        self.max_model_len = llm.max_model_len
        self.max_live_requests = max_live_requests
        self._idle_wait = idle_wait
        self._commands: collections.deque[_Add | str] = collections.deque()
        self._wake = threading.Event()
        self._streams: dict[str, RequestStream] = {}
        self._stats = read_engine_stats(llm)
        self._stop = threading.Event()
        self._go = threading.Event()  # set by start() (a build() thread waits on it)
        self._thread: threading.Thread | None = None
        self._dead: str | None = None

    # ------------------------------------------------------------------ EngineClient
    async def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str) -> RequestStream:
        if not self.is_healthy():
            raise EngineDeadError(self._dead or "the engine is not running")
        check_admission(self._streams, self.max_live_requests, request_id)
        stream = RequestStream(request_id, params.n, asyncio.get_running_loop())
        self._streams[request_id] = stream
        cmd = _Add(request_id, prompt_ids, params)
        self._commands.append(cmd)
        self._wake.set()
        try:
            await asyncio.wrap_future(cmd.done)
        except BaseException:
            if self._streams.pop(request_id, None) is not None:
                self._commands.append(request_id)  # cancelled while queuing: abort if it got in
                self._wake.set()
            raise
        return stream

    def abort(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        stream._close("abort")
        self._commands.append(request_id)
        self._wake.set()

    def stats(self) -> EngineStats:
        return self._stats

    def is_healthy(self) -> bool:
        return self._dead is None and self._go.is_set() and self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="treeserve-engine", daemon=True)
            self._thread.start()
        self._go.set()

    def shutdown(self) -> None:
        self._stop.set()
        self._go.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)
        if self._dead is None:
            self._dead = "the engine was shut down"
        self._close_all("shutdown")

    # ------------------------------------------------------------------ engine thread
    def _loop(self) -> None:
        llm = self.llm
        try:
            while not self._stop.is_set():
                self._run_commands()
                if llm.has_unfinished_requests():
                    t0 = time.perf_counter()
                    try:
                        deltas = llm.step()
                    except Exception as exc:  # failed requests get their error deltas next step
                        log.error("engine step failed: %s: %s", type(exc).__name__, exc)
                        deltas = []
                    if self.step_observer is not None:
                        self.step_observer(time.perf_counter() - t0)
                    self._dispatch(deltas)
                else:
                    self._wake.wait(self._idle_wait)
                    self._wake.clear()
                self._stats = read_engine_stats(llm)
        except BaseException as exc:  # a bug in the loop itself: fail loudly, free everyone
            self._dead = f"engine loop crashed: {type(exc).__name__}: {exc}"
            log.exception("engine loop crashed")
        finally:
            self._close_all("shutdown" if self._dead is None else "error")
            if llm.tiers is not None:
                llm.tiers.flush()  # released requests' write-through to the disk KV tier

    def _run_commands(self) -> None:
        while self._commands:
            cmd = self._commands.popleft()
            if isinstance(cmd, str):
                self.llm.abort_request(cmd)
                continue
            if cmd.done.cancelled():
                continue
            try:
                self.llm.add_request(cmd.prompt_ids, cmd.params, request_id=cmd.request_id)
            except Exception as exc:
                cmd.done.set_exception(exc)
            else:
                cmd.done.set_result(None)

    def _dispatch(self, deltas: list[SampleDelta]) -> None:
        by_request: dict[str, list[SampleDelta]] = {}
        for d in deltas:
            by_request.setdefault(d.request_id, []).append(d)
        for rid, ds in by_request.items():
            stream = self._streams.get(rid)
            if stream is not None:
                stream._push(ds)
                if stream._engine_finished == stream.n:
                    self._streams.pop(rid, None)

    def _close_all(self, reason: str) -> None:
        thread = self._thread
        engine_idle = thread is None or not thread.is_alive() or threading.current_thread() is thread
        for rid, stream in list(self._streams.items()):
            if engine_idle:  # else the loop is still stepping: never touch the LLM from here
                self.llm.abort_request(rid)
            stream._close(reason)
        self._streams.clear()
