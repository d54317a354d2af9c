"""The OpenAI-compatible HTTP API (FastAPI) over an :class:`EngineClient`.

``POST /v1/chat/completions``, ``POST /v1/completions`` (streamed as server-sent events or not),
``GET /v1/models``, ``/health``, ``/version``, ``/metrics``. Every error is OpenAI's shape
``{"error": {"message", "type", "param", "code"}}``: 400 for bad input (naming the field), 503 with
``Retry-After`` when the engine is full, 500 when a request fails while running. A client that
disconnects (streaming or not) has its request aborted, which frees its KV pages.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import treeserve
from treeserve.output import SampleDelta
from treeserve.sampling import SamplingParams
from treeserve.server.engine_client import EngineClient, EngineDeadError, QueueFullError, RequestStream
from treeserve.server.metrics import CONTENT_TYPE, ServerMetrics
from treeserve.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    ErrorResponse,
    Usage,
    sampling_params,
)

__all__ = ["build_app"]

log = logging.getLogger("treeserve.server")

RETRY_AFTER_SECONDS = 1


@dataclass(slots=True)
class _Sample:
    """What one sample produced so far."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None

    def add(self, d: SampleDelta) -> None:
        self.text += d.text
        self.token_ids += d.token_ids
        self.logprobs += d.logprobs
        self.top_logprobs += d.top_logprobs
        self.finish_reason, self.stop_reason, self.error = d.finish_reason, d.stop_reason, d.error


@dataclass(slots=True)
class _Job:
    """One accepted request and how to format its outputs."""

    chat: bool
    request_id: str
    model: str
    stream: RequestStream
    logprobs: int | None
    echo: str
    streaming: bool
    include_usage: bool
    samples: list[_Sample]
    watcher: asyncio.Future | None = None  # aborts the request when the client disconnects
    created: int = field(default_factory=lambda: int(time.time()))
    prompt_tokens: int = 0
    cached_tokens: int = 0

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def usage(self) -> dict[str, Any]:
        out = sum(len(s.token_ids) for s in self.samples)
        return Usage(prompt_tokens=self.prompt_tokens, completion_tokens=out, total_tokens=self.prompt_tokens + out,
                     prompt_tokens_details={"cached_tokens": self.cached_tokens}).model_dump()  # fmt: skip

    def record(self, d: SampleDelta) -> None:
        self.samples[d.index].add(d)
        self.prompt_tokens, self.cached_tokens = d.num_prompt_tokens, d.num_cached_tokens


class _TokenText:
    """Token id -> its text (cached), for logprobs."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, tid: int) -> str:
        s = self._cache.get(tid)
        if s is None:
            s = self._cache[tid] = self._tok.decode([tid])
        return s

    def chat_logprobs(self, ids: list[int], lps: list[float], tops: list[dict[int, float]]) -> dict[str, Any]:
        def entry(t: int, lp: float) -> dict[str, Any]:
            s = self(t)
            return {"token": s, "logprob": lp, "bytes": list(s.encode())}

        content = []
        for i, (t, lp) in enumerate(zip(ids, lps)):
            top = tops[i] if i < len(tops) else {}
            e = entry(t, lp)
            e["top_logprobs"] = [entry(k, v) for k, v in sorted(top.items(), key=lambda kv: -kv[1])]
            content.append(e)
        return {"content": content}

    def completion_logprobs(self, ids: list[int], lps: list[float], tops: list[dict[int, float]],
                            offset: int) -> dict[str, Any]:  # fmt: skip
        tokens = [self(t) for t in ids]
        offsets = []
        for s in tokens:
            offsets.append(offset)
            offset += len(s)
        top = [{self(k): v for k, v in sorted(d.items(), key=lambda kv: -kv[1])} for d in tops[: len(ids)]]
        return {"tokens": tokens, "token_logprobs": list(lps), "top_logprobs": top, "text_offset": offsets}


def _error_response(err: APIError) -> JSONResponse:
    return JSONResponse(ErrorResponse.of(err).model_dump(), status_code=err.status, headers=err.headers)


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if not errors:
        return APIError("invalid request body")
    # a union reports one error per member: our own validators' complaint is the precise one
    first = next((e for e in errors if e.get("type") == "value_error"), errors[0])
    parts: list[str] = []
    for x in first.get("loc", ())[1:]:
        if isinstance(x, int):
            parts.append(f"[{x}]")
        elif isinstance(x, str) and x.isidentifier() and x not in ("str", "int", "float", "bool", "list", "dict"):
            parts.append(("." if parts else "") + x)
    param = "".join(parts) or None
    kind = first.get("type", "")
    if kind == "extra_forbidden":
        return APIError(f"{param} is not supported by this server", param=param, code="unsupported_field")
    if kind == "json_invalid":
        return APIError("request body is not valid JSON")
    return APIError(f"{param or 'body'}: {first.get('msg', 'invalid value')}", param=param)


async def _until_disconnect(raw: Request) -> None:
    """Return when the client goes away (the request body has been read already)."""
    while True:
        msg = await raw.receive()
        if msg["type"] == "http.disconnect":
            return


class _Server:
    """The route handlers' shared state and logic."""

    def __init__(self, client: EngineClient, model_name: str) -> None:
        self.client = client
        self.model_name = model_name
        self.metrics = ServerMetrics(client, model_name)
        self.token_text = _TokenText(client.tokenizer)

    # ------------------------------------------------------------------ request intake
    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(f"model {name!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")  # fmt: skip

    def chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        tok = self.client.tokenizer
        msgs = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in req.messages]
        try:
            text = tok.apply_chat_template(msgs, add_generation_prompt=True)
        except Exception as exc:  # the template's own errors
            raise APIError(f"chat template failed on these messages: {exc}", param="messages") from None
        return tok.encode(text)

    def completion_prompt(self, prompt: str | list[int]) -> tuple[list[int], str]:
        if isinstance(prompt, str):
            return self.client.tokenizer.encode(prompt), prompt
        bad = [t for t in prompt if not 0 <= t < self.client.tokenizer.vocab_size]
        if bad:
            raise APIError(f"prompt token ids must lie in [0, {self.client.tokenizer.vocab_size}), got {bad[:5]}",
                           param="prompt")  # fmt: skip
        return list(prompt), self.client.tokenizer.decode(prompt)

    def max_tokens(self, requested: int | None, prompt_len: int, param: str) -> int:
        """The output budget: ``requested``, or what the context leaves when omitted. A request
        that cannot fit (prompt + ``requested`` > ``max_model_len``) is refused naming ``param``,
        as OpenAI and vLLM do; a prompt too long on its own is the engine's error to report."""
        room = self.client.max_model_len - prompt_len
        if requested is None:
            return max(1, room)
        if room >= 1 and requested > room:
            raise APIError(f"{param}={requested} does not fit: the context holds {self.client.max_model_len} "
                           f"tokens and the prompt takes {prompt_len}, leaving {room}", param=param)  # fmt: skip
        return requested

    async def submit(self, ids: list[int], params: SamplingParams, req: ChatCompletionRequest | CompletionRequest,
                     chat: bool) -> tuple[str, RequestStream]:  # fmt: skip
        """Queue a request; its id is also the response id. Engine refusals become ``APIError``
        naming ``req``'s field."""
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        try:
            return rid, await self.client.add_request(ids, params, rid)
        except QueueFullError as exc:
            raise APIError(str(exc), status=503, type="server_error", code="overloaded",
                           headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from None  # fmt: skip
        except EngineDeadError as exc:
            raise APIError(str(exc), status=503, type="server_error", code="engine_unavailable") from None
        except (ValueError, TypeError) as exc:
            param = req.api_field_of(str(exc))
            raise APIError(str(exc), param="messages" if chat and param == "prompt" else param) from None

    async def respond(self, raw: Request, job: _Job) -> Response:
        """Stream or collect ``job``; from here on a disconnect aborts the request, even before
        the first byte of a streamed answer is sent."""
        job.watcher = asyncio.ensure_future(self._abort_on_disconnect(raw, job.request_id))
        if job.streaming:
            return StreamingResponse(self._sse(job), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})  # fmt: skip
        return await self._collect(job)

    async def _abort_on_disconnect(self, raw: Request, request_id: str) -> None:
        await _until_disconnect(raw)
        self.client.abort(request_id)  # a no-op once the request finished

    # ------------------------------------------------------------------ non-streaming
    async def _collect(self, job: _Job) -> Response:
        assert job.watcher is not None
        try:
            reader = asyncio.ensure_future(self._drain(job))
            done, _ = await asyncio.wait({reader, job.watcher}, return_when=asyncio.FIRST_COMPLETED)
            if reader not in done:  # the client left: the request is aborted, nobody reads on
                reader.cancel()
                return Response(status_code=499)
            reader.result()
        finally:
            self._finish(job)
        if job.stream.closed_reason is not None:
            raise APIError(f"request ended early: the server is {job.stream.closed_reason}", status=503,
                           type="server_error", code="engine_unavailable")  # fmt: skip
        failed = next((s.error for s in job.samples if s.finish_reason == "error"), None)
        if failed is not None:
            raise APIError(f"request failed while running: {failed}", status=500, type="server_error")
        choices = [self._full_choice(job, i, s) for i, s in enumerate(job.samples)]
        body = {"id": job.request_id, "object": job.object, "created": job.created, "model": job.model,
                "choices": choices, "usage": job.usage()}  # fmt: skip
        return JSONResponse(body)

    async def _drain(self, job: _Job) -> None:
        async for deltas in job.stream:
            for d in deltas:
                job.record(d)

    def _full_choice(self, job: _Job, index: int, s: _Sample) -> dict[str, Any]:
        lp = None
        if job.chat:
            if job.logprobs is not None:
                lp = self.token_text.chat_logprobs(s.token_ids, s.logprobs, s.top_logprobs)
            return {"index": index, "message": {"role": "assistant", "content": s.text}, "logprobs": lp,
                    "finish_reason": s.finish_reason, "stop_reason": s.stop_reason}  # fmt: skip
        if job.logprobs is not None:
            lp = self.token_text.completion_logprobs(s.token_ids, s.logprobs, s.top_logprobs, len(job.echo))
        return {"index": index, "text": job.echo + s.text, "logprobs": lp, "finish_reason": s.finish_reason,
                "stop_reason": s.stop_reason}  # fmt: skip

    # ------------------------------------------------------------------ streaming
    async def _sse(self, job: _Job) -> AsyncIterator[str]:
        try:
            if job.chat:
                for i in range(len(job.samples)):
                    yield self._chunk(job, [{"index": i, "delta": {"role": "assistant", "content": ""},
                                             "logprobs": None, "finish_reason": None}])  # fmt: skip
            started = [False] * len(job.samples)
            async for deltas in job.stream:
                choices = []
                for d in deltas:
                    job.record(d)
                    if d.finish_reason == "error":
                        err = APIError(f"request failed while running: {d.error}", status=500, type="server_error")
                        yield f"data: {json.dumps(ErrorResponse.of(err).model_dump())}\n\n"
                        return
                    choice = self._delta_choice(job, d, started)
                    if choice is not None:
                        choices.append(choice)
                if choices:
                    yield self._chunk(job, choices)
            if job.stream.closed_reason is not None:
                err = APIError(f"request ended early: the server is {job.stream.closed_reason}", status=503,
                               type="server_error", code="engine_unavailable")  # fmt: skip
                yield f"data: {json.dumps(ErrorResponse.of(err).model_dump())}\n\n"
                return
            if job.include_usage:
                yield self._chunk(job, [], usage=job.usage())
            yield "data: [DONE]\n\n"
        finally:
            self._finish(job)

    def _delta_choice(self, job: _Job, d: SampleDelta, started: list[bool]) -> dict[str, Any] | None:
        asked = job.logprobs is not None and bool(d.token_ids)
        if not (d.text or d.finish_reason or asked or (job.echo and not started[d.index])):
            return None
        text = d.text
        if not started[d.index]:
            started[d.index] = True
            text = job.echo + text
        lp = None
        if job.chat:
            if asked:
                lp = self.token_text.chat_logprobs(d.token_ids, d.logprobs, d.top_logprobs)
            return {"index": d.index, "delta": {"content": text}, "logprobs": lp, "finish_reason": d.finish_reason,
                    "stop_reason": d.stop_reason}  # fmt: skip
        if asked:
            done = len(job.samples[d.index].text) - len(d.text)
            lp = self.token_text.completion_logprobs(d.token_ids, d.logprobs, d.top_logprobs, len(job.echo) + done)
        return {"index": d.index, "text": text, "logprobs": lp, "finish_reason": d.finish_reason,
                "stop_reason": d.stop_reason}  # fmt: skip

    @staticmethod
    def _chunk(job: _Job, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> str:
        body: dict[str, Any] = {"id": job.request_id, "object": "chat.completion.chunk" if job.chat else "text_completion",
                                "created": job.created, "model": job.model, "choices": choices}  # fmt: skip
        if usage is not None:
            body["usage"] = usage
        return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"

    # ------------------------------------------------------------------ end of a request
    def _finish(self, job: _Job) -> None:
        """Abort the request unless all of it was delivered; record its metrics. Called once."""
        if job.watcher is not None:
            job.watcher.cancel()
        if not job.stream.finished:
            self.client.abort(job.request_id)
        first = job.samples[0].finish_reason or "abort"
        out = sum(len(s.token_ids) for s in job.samples)
        self.metrics.observe(job.stream, job.prompt_tokens, job.cached_tokens, out, first)

    # ------------------------------------------------------------------ endpoints
    async def chat(self, raw: Request, req: ChatCompletionRequest) -> Response:
        self.check_model(req.model)
        logprobs = req.num_logprobs()
        ids = self.chat_prompt(req)
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        params = sampling_params(req, self.max_tokens(req.requested_max_tokens(), len(ids), param), logprobs)
        return await self._start(raw, req, ids, params, logprobs, echo="", chat=True)

    async def completion(self, raw: Request, req: CompletionRequest) -> Response:
        self.check_model(req.model)
        logprobs = req.num_logprobs()
        ids, text = self.completion_prompt(req.single_prompt())
        params = sampling_params(req, self.max_tokens(req.max_tokens, len(ids), "max_tokens"), logprobs)
        return await self._start(raw, req, ids, params, logprobs, echo=text if req.echo else "", chat=False)

    async def _start(self, raw: Request, req: ChatCompletionRequest | CompletionRequest, ids: list[int],
                     params: SamplingParams, logprobs: int | None, *, echo: str, chat: bool) -> Response:  # fmt: skip
        include_usage = req.include_usage  # validated before anything is queued
        rid, stream = await self.submit(ids, params, req, chat)
        job = _Job(chat=chat, request_id=rid, model=self.model_name,
                   stream=stream, logprobs=logprobs, echo=echo, streaming=req.stream,
                   include_usage=include_usage, samples=[_Sample() for _ in range(params.n)])  # fmt: skip
        job.prompt_tokens = len(ids)
        return await self.respond(raw, job)

    def models(self) -> dict[str, Any]:
        card = {"id": self.model_name, "object": "model", "created": int(time.time()), "owned_by": "treeserve",
                "root": self.model_name, "max_model_len": self.client.max_model_len}  # fmt: skip
        return {"object": "list", "data": [card]}


def build_app(client: EngineClient, model_name: str) -> FastAPI:
    """The OpenAI-compatible app serving ``client`` as ``model_name``. The app's lifespan starts
    the engine loop and shuts it down (aborting whatever still runs)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client.start()
        try:
            yield
        finally:
            client.shutdown()

    app = FastAPI(title="treeserve", version=treeserve.__version__, lifespan=lifespan)
    server = _Server(client, model_name)
    app.state.server = server

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _error_response(_validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error_response(APIError(str(exc.detail), status=exc.status_code, type=kind))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return _error_response(APIError(f"internal error: {type(exc).__name__}", status=500, type="server_error"))

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request, req: ChatCompletionRequest) -> Response:
        return await server.chat(raw, req)

    @app.post("/v1/completions")
    async def completions(raw: Request, req: CompletionRequest) -> Response:
        return await server.completion(raw, req)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return server.models()

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if client.is_healthy() else 503)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": treeserve.__version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)

    return app
