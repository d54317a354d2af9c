"""C++ CPU decode attention (``torch.ops.treeserve.paged_decode_attention``), built on first use.

The operator (``csrc/paged_decode_attention.cpp``) reads each request's pages in place: no gather
into a padded batch, no mask, each KV head read once for its group of query heads, online
softmax over blocks of keys, float32 accumulation (float32 and bfloat16 caches). It is compiled
with ``torch.utils.cpp_extension.load`` the first time a process needs it and cached in
``TORCH_EXTENSIONS_DIR`` (torch's default build directory) under a name keyed by the source and
the host CPU's flags (it is built for the host CPU), so later processes only load it. Without a
working compiler the build fails once, is logged once, and the torch path serves every step.

Steps that are not pure decode take the operator for every query row of their short requests
(decode rows, draft-tree verify rows, short chunks: each a one-query request over its own page
list, :func:`~treeserve.kvcache.query_view.query_view`) and the torch backend for the rest
(long prefill chunks; with pages larger than one token, trees whose visible nodes leave a gap).
"""

from __future__ import annotations

import torch

from treeserve.kvcache._attention_torch import paged_attention_torch, paged_attention_torch_subset
from treeserve.kvcache._cpu_op import cpu_decode_op_usable, load_cpu_decode_op
from treeserve.kvcache.metadata import AttentionMetadata
from treeserve.kvcache.query_view import query_view

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
    included) and on the rows of every request the step's query view covers; the torch backend
    for the other requests."""
    if meta.num_qo_tokens == meta.batch_size:
        return paged_decode_attention(q, k_cache, v_cache, meta, scale)
    view = query_view(meta, causal)
    if view is None:
        return paged_attention_torch(q, k_cache, v_cache, meta, scale, causal)
    op = torch.ops.treeserve.paged_decode_attention
    if view.covers_all:
        return op(q, k_cache, v_cache, view.kv_indptr, view.kv_page_indices, view.kv_last_page_len, scale)
    out = paged_attention_torch_subset(q, k_cache, v_cache, meta, view.rest, scale, causal)
    viewed = op(q.index_select(0, view.rows), k_cache, v_cache, view.kv_indptr, view.kv_page_indices,
                view.kv_last_page_len, scale)
    return out.index_copy_(0, view.rows, viewed)
