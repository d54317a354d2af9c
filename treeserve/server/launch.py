"""``treeserve serve``: build the engine, serve the app with uvicorn, shut down gracefully.

SIGINT / SIGTERM: uvicorn stops accepting connections, in-flight requests get
``graceful_seconds`` to finish (then their connections close, which aborts them), the lifespan
shutdown stops the engine loop, and the process exits 0 without a traceback.
"""

from __future__ import annotations

import logging
import signal
from typing import Any

import uvicorn

from treeserve.engine import LLM
from treeserve.server.api import build_app
from treeserve.server.engine_client import AsyncLLMEngine

__all__ = ["serve"]

log = logging.getLogger("treeserve.server")


def serve(llm: LLM, *, host: str = "127.0.0.1", port: int = 8000, model_name: str | None = None,
          max_live_requests: int = 1024, graceful_seconds: float = 5.0, log_level: str = "info") -> int:  # fmt: skip
    """Serve ``llm`` over HTTP until SIGINT / SIGTERM; returns the exit status (0)."""
    name = model_name or llm.model_name
    app = build_app(AsyncLLMEngine(llm, max_live_requests=max_live_requests), name)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                            timeout_graceful_shutdown=graceful_seconds)  # fmt: skip
    server = _Server(config)
    server.announce = f"treeserve: serving {name!r} at http://{host}:{port}/v1 (Ctrl-C to stop)"
    # uvicorn re-raises the signal it caught once it has shut down: make that a no-op so the
    # process ends with status 0 instead of a KeyboardInterrupt traceback.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    server.run()
    return 0


class _Server(uvicorn.Server):
    """uvicorn's server, logging the URL once it is listening (the real port when ``port=0``)."""

    announce = ""

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        if self.started:
            logging.getLogger("uvicorn.error").info(self.announce)
