"""treeserve: LLM-serving components that compose into a small, fast inference engine."""

from __future__ import annotations

__version__ = "0.1.0"
