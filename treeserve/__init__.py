"""treeserve: LLM-serving components that compose into a small, fast inference engine.

``from treeserve import LLM, SamplingParams`` is the engine API; the subpackages
(``treeserve.kvcache``, ``treeserve.sampling``, ``treeserve.scheduler``, ``treeserve.models``) are
usable on their own.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "LLM": "treeserve.engine",
    "EngineConfig": "treeserve.engine",
    "RequestOutput": "treeserve.engine",
    "CompletionOutput": "treeserve.engine",
    "SamplingParams": "treeserve.sampling",
    "SampleDelta": "treeserve.output",
}


def __getattr__(name: str) -> Any:
    # Lazy so that importing one subpackage does not pull in the whole engine.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'treeserve' has no attribute {name!r}")


__all__ = ["LLM", "CompletionOutput", "EngineConfig", "RequestOutput", "SampleDelta", "SamplingParams", "__version__"]
