"""``treeserve serve``: an OpenAI-compatible HTTP server over an async engine.

Layout (imports point downward): ``engine_client`` (the engine loop on its own thread behind
``EngineClient``) <- ``protocol`` (request models, errors) and ``metrics`` (Prometheus) <- ``api``
(FastAPI routes) <- ``launch`` (uvicorn, CLI). ``bench_client`` is a load client for any
OpenAI-compatible server.
"""

from __future__ import annotations

from treeserve.server.engine_client import (
    AsyncLLMEngine,
    EngineClient,
    EngineDeadError,
    EngineStats,
    QueueFullError,
    RequestStream,
    read_engine_stats,
)

__all__ = [
    "AsyncLLMEngine",
    "EngineClient",
    "EngineDeadError",
    "EngineStats",
    "QueueFullError",
    "RequestStream",
    "read_engine_stats",
]
