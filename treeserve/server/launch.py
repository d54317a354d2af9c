"""``treeserve serve``: build the engine, serve the app with uvicorn, shut down gracefully.

SIGINT / SIGTERM: uvicorn stops accepting connections; in-flight requests get half of
``graceful_seconds`` to finish, then the engine shuts down, which aborts what still runs (streams
end with an error event, non-streaming requests get 503) before uvicorn would cancel them; a
second signal aborts at once. The process exits 0 without a traceback.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from typing import Any

import uvicorn

from treeserve.engine import LLM
from treeserve.server.api import build_app
from treeserve.server.engine_client import AsyncLLMEngine, EngineClient

__all__ = ["serve", "serve_client"]

log = logging.getLogger("treeserve.server")


def serve(llm: LLM | Callable[[], LLM], *, host: str = "127.0.0.1", port: int = 8000, model_name: str | None = None,
          max_live_requests: int = 1024, graceful_seconds: float = 5.0, log_level: str = "info") -> int:  # fmt: skip
    """Serve ``llm`` over HTTP until SIGINT / SIGTERM; returns the exit status (0). Given a
    factory instead, the model is built on the engine thread (``AsyncLLMEngine.build``: what
    ``treeserve serve`` does, one OpenMP pool for load and steps). Either way the large-batch weights
    that loading deferred are built before it listens (``LLM.prepare_large``)."""
    if isinstance(llm, LLM):
        llm.prepare_large()  # deferred large-batch weights, before the first request (build does it on its thread)
        engine = AsyncLLMEngine(llm, max_live_requests=max_live_requests)
    else:
        engine = AsyncLLMEngine.build(llm, max_live_requests=max_live_requests)
    return serve_client(engine, model_name or engine.llm.model_name, host=host, port=port,
                        graceful_seconds=graceful_seconds, log_level=log_level)  # fmt: skip


def serve_client(engine: EngineClient, name: str, *, host: str = "127.0.0.1", port: int = 8000,
                 graceful_seconds: float = 5.0, log_level: str = "info") -> int:  # fmt: skip
    """Serve the app over any :class:`EngineClient` (one engine, or a cluster's replicas) as
    :func:`serve` does; returns 0 once stopped by SIGINT / SIGTERM (the engine is shut down)."""
    config = uvicorn.Config(build_app(engine, name), host=host, port=port, log_level=log_level, access_log=False,
                            timeout_graceful_shutdown=graceful_seconds)  # fmt: skip
    server = _Server(config, engine, graceful_seconds / 2)
    server.announce = f"treeserve: serving {name!r} at http://{host}:{port}/v1 (Ctrl-C to stop)"
    # uvicorn re-raises the signal it caught once it has shut down: make that a no-op so the
    # process ends with status 0 instead of a KeyboardInterrupt traceback.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    server.run()
    return 0


class _Server(uvicorn.Server):
    """uvicorn's server: logs the URL once listening; on an exit signal, shuts the engine down
    ``abort_after`` seconds later (in-flight requests end cleanly instead of being cancelled)."""

    announce = ""

    def __init__(self, config: uvicorn.Config, engine: EngineClient, abort_after: float) -> None:
        super().__init__(config)
        self.engine, self.abort_after = engine, abort_after
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)
        if self.started:
            logging.getLogger("uvicorn.error").info(self.announce)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self._loop is None:
            super().handle_exit(sig, frame)
        elif not self.should_exit:
            self._loop.call_soon_threadsafe(self._loop.call_later, self.abort_after, self.engine.shutdown)
            super().handle_exit(sig, frame)
        else:
            # A second signal (Ctrl-C twice): abort everything now, so every response ends with an
            # error event / 503, instead of uvicorn's force exit, which cancels handlers mid-response
            # and logs their tracebacks.
            self._loop.call_soon_threadsafe(self.engine.shutdown)
