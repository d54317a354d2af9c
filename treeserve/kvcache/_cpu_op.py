"""Building and loading the C++ CPU decode-attention operator (no treeserve.kvcache imports).

Kept apart from ``_attention_cpu`` so that ``backends`` can ask whether the operator is usable
without importing the attention modules (which import ``backends`` through ``metadata``).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch

from treeserve._cpp import load_cpp_op

__all__ = ["SOURCE", "cpu_decode_op_usable", "load_cpu_decode_op"]

SOURCE = Path(__file__).with_name("csrc") / "paged_decode_attention.cpp"
DTYPES = (torch.float32, torch.bfloat16)


@lru_cache(maxsize=1)
def load_cpu_decode_op() -> str | None:
    """Build (first time on this host) and load the operator; ``None`` when it is available,
    else the reason it is not (logged once; callers then use the torch path)."""
    reason = load_cpp_op(SOURCE, "paged_decode_attention", "C++ CPU decode attention")
    if reason is None:
        _register_fake()
    return reason


@lru_cache(maxsize=1)
def _register_fake() -> None:
    """The operator's output shape and dtype for tracing (``torch.compile``): ``q``'s."""

    @torch.library.register_fake("treeserve::paged_decode_attention")
    def _fake(q, k_cache, v_cache, kv_indptr, kv_page_indices, kv_last_page_len, scale):  # type: ignore[no-untyped-def]
        return torch.empty_like(q)


def cpu_decode_op_usable(device: torch.device, dtype: torch.dtype) -> bool:
    """Backend predicate: a CPU device, a float32 cache, and the operator builds.

    bfloat16 caches are supported by the operator (``paged_decode_attention``) but not offered as
    a backend: on the AVX2 dev machine it measured 0.56-1.45x the torch path (no native bf16
    conversion), so the torch path stays the bf16 default (benches/RESULTS.md, issue 15)."""
    return device.type == "cpu" and dtype == torch.float32 and load_cpu_decode_op() is None
