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

import torch

from treeserve.kvcache._attention_torch import paged_attention_torch
from treeserve.kvcache._cpu_op import cpu_decode_op_usable, load_cpu_decode_op
from treeserve.kvcache.metadata import AttentionMetadata

__all__ = ["cpu_decode_op_usable", "load_cpu_decode_op", "paged_attention_cpu", "paged_decode_attention"]


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
