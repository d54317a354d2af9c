"""C++ CPU decode attention (``torch.ops.treeserve.paged_decode_attention``), built on first use.

The operator (``csrc/paged_decode_attention.cpp``) reads each request's pages in place: no gather
into a padded batch, no mask, each KV head read once for its group of query heads, online
softmax over blocks of keys, float32 accumulation (float32 and bfloat16 caches). It is compiled
with ``torch.utils.cpp_extension.load`` the first time a process needs it and cached in
``TORCH_EXTENSIONS_DIR`` (torch's default build directory) under a name keyed by the source and
the host CPU's flags (it is built for the host CPU), so later processes only load it. Without a
working compiler the build fails once, is logged once, and the torch path serves every step.

Steps that are not pure decode (prefill chunks, draft-tree verification with more than one node)
go to the torch backend.
"""

from __future__ import annotations

import hashlib
import platform
from functools import lru_cache
from pathlib import Path

import torch

from treeserve._utils import log_once
from treeserve.kvcache._attention_torch import paged_attention_torch
from treeserve.kvcache.metadata import AttentionMetadata

__all__ = ["cpu_decode_op_usable", "load_cpu_decode_op", "paged_attention_cpu", "paged_decode_attention"]

SOURCE = Path(__file__).with_name("csrc") / "paged_decode_attention.cpp"
DTYPES = (torch.float32, torch.bfloat16)


def _cpu_flags() -> str:
    """The host CPU's feature flags (Linux), part of the build's cache key."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


@lru_cache(maxsize=1)
def load_cpu_decode_op() -> str | None:
    """Build (first time on this host) and load the operator; ``None`` when it is available,
    else the reason it is not (logged once; callers then use the torch path)."""
    if hasattr(torch.ops.treeserve, "paged_decode_attention"):
        return None
    try:
        from torch.utils.cpp_extension import load

        key = hashlib.sha1(SOURCE.read_bytes() + _cpu_flags().encode() + torch.__version__.encode()).hexdigest()[:12]
        load(
            name=f"treeserve_paged_decode_{key}",
            sources=[str(SOURCE)],
            extra_cflags=["-O3", "-march=native", "-fopenmp-simd"],
            is_python_module=False,
            verbose=False,
        )
    except Exception as exc:  # no compiler / headers / ninja: the torch path serves
        reason = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
        log_once(f"treeserve.kvcache: C++ CPU decode attention unavailable, using the torch path ({reason})")
        return reason
    return None


def cpu_decode_op_usable(device: torch.device, dtype: torch.dtype) -> bool:
    """Backend predicate: a CPU device, a float32 cache, and the operator builds.

    bfloat16 caches are supported by the operator (``paged_decode_attention``) but not offered as
    a backend: on the AVX2 dev machine it measured 0.56-1.45x the torch path (no native bf16
    conversion), so the torch path stays the bf16 default (benches/RESULTS.md, issue 15)."""
    return device.type == "cpu" and dtype == torch.float32 and load_cpu_decode_op() is None


def paged_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """The operator on one decode step (``meta.num_qo_tokens == meta.batch_size``): ``[B, Hq, D]``."""
    return torch.ops.treeserve.paged_decode_attention(
        q, k_cache, v_cache, meta.kv_indptr.int(), meta.kv_page_indices.int(), meta.kv_last_page_len.int(), scale
    )


def paged_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    causal: bool,
) -> torch.Tensor:
    """``cpu`` backend of :func:`treeserve.kvcache.paged_attention`: the C++ operator on pure
    decode steps (one query per request sees its whole KV, causal or not, a one-node tree
    included), the torch backend on every other step."""
    if meta.num_qo_tokens == meta.batch_size:
        return paged_decode_attention(q, k_cache, v_cache, meta, scale)
    return paged_attention_torch(q, k_cache, v_cache, meta, scale, causal)
