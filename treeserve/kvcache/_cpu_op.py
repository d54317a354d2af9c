"""Building and loading the C++ CPU decode-attention operator (no treeserve.kvcache imports).

Kept apart from ``_attention_cpu`` so that ``backends`` can ask whether the operator is usable
without importing the attention modules (which import ``backends`` through ``metadata``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from treeserve._cpp import cpp_op_loader, cpu_flags, load_cpp_op

__all__ = ["SOURCE", "avx2_host", "cpu_decode_op_usable", "load_cpu_decode_op"]

SOURCE = Path(__file__).with_name("csrc") / "paged_decode_attention.cpp"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _fake(q, k_cache, v_cache, kv_indptr, kv_page_indices, kv_last_page_len, scale):  # type: ignore[no-untyped-def]
    """Output shape and dtype for tracing (``torch.compile``): ``q``'s."""
    return torch.empty_like(q)


@cpp_op_loader
def load_cpu_decode_op() -> str | None:
    """Build (first time on this host) and load the operator; ``None`` when it is available,
    else the reason it is not (logged once; callers then use the torch path)."""
    return load_cpp_op(SOURCE, "paged_decode_attention", "C++ CPU decode attention", _fake)


def avx2_host() -> bool:
    """Whether this host's CPU has AVX2 and FMA (the operator is built with ``-march=native``,
    so it then takes its 8-lane paths, 16-bit rows widened on load: bfloat16 by a shift, float16
    by F16C, which every AVX2 CPU has)."""
    flags = cpu_flags().split()
    return "avx2" in flags and "fma" in flags


def cpu_decode_op_usable(device: torch.device, dtype: torch.dtype) -> bool:
    """Backend predicate: a CPU device, a float32 cache -- or a 16-bit (bfloat16, float16) cache on
    an AVX2+FMA host -- and the operator builds.

    bfloat16 is offered where the operator's 8-lane AVX2 path exists: there it measured 2.3-4.0x
    the torch path (1 thread, batch 1-64 x context 128-1024, benches/RESULTS.md, issue 15); float16
    reads the same bytes, widened by F16C. Hosts without AVX2 were not measured and keep the torch
    path for 16-bit caches."""
    if device.type != "cpu" or not (dtype == torch.float32 or (dtype in DTYPES and avx2_host())):
        return False
    return load_cpu_decode_op() is None
