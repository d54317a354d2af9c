"""C++ CPU decode attention (``torch.ops.treeserve.paged_decode_attention``), built on first use.

The operator (``csrc/paged_decode_attention.cpp``) reads each request's pages in place: no gather
into a padded batch, no mask, each KV head read once for its group of query heads, online
softmax over blocks of keys, float32 accumulation (float32 and bfloat16 caches). It is compiled
with ``torch.utils.cpp_extension.load`` the first time a process needs it and cached in
``TORCH_EXTENSIONS_DIR`` (torch's default build directory) under a name keyed by the source and
the host CPU's flags (it is built for the host CPU), so later processes only load it. Without a
working compiler the build fails once, is logged once, and the torch path serves every step.

Steps that are not pure decode (prefill chunks, draft-tree verification with more than one node)
go to the torch backend, except for their decode rows (requests with one query: a decode, or a
one-node tree): those still take the operator, on the page table of those requests alone.
"""

from __future__ import annotations

import torch

from treeserve.kvcache._attention_torch import paged_attention_torch, paged_attention_torch_subset
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
    included); on mixed steps the operator for the one-query requests and the torch backend for
    the others; the torch backend on steps without one-query requests."""
    if meta.num_qo_tokens == meta.batch_size:
        return paged_decode_attention(q, k_cache, v_cache, meta, scale)
    split = meta.derived.get("cpu-split")
    if split is None:
        split = meta.derived["cpu-split"] = _split_decode_rows(meta)
    if not split:
        return paged_attention_torch(q, k_cache, v_cache, meta, scale, causal)
    rest, rows, indptr, pages, last = split
    out = paged_attention_torch_subset(q, k_cache, v_cache, meta, rest, scale, causal)
    decoded = torch.ops.treeserve.paged_decode_attention(q.index_select(0, rows), k_cache, v_cache, indptr, pages,
                                                         last, scale)
    return out.index_copy_(0, rows, decoded)


def _split_decode_rows(meta: AttentionMetadata) -> tuple[torch.Tensor, ...] | tuple[()]:
    """For a step mixing one-query requests with longer ones: (the other requests' indices, the
    one-query requests' q rows, and their own ``kv_indptr``, ``kv_page_indices``,
    ``kv_last_page_len`` in int32); ``()`` when the step has no one-query request."""
    qo = meta.qo_indptr.long()
    single = (qo[1:] - qo[:-1]) == 1
    if not bool(single.any()):
        return ()
    dec = single.nonzero().squeeze(1)
    kv = meta.kv_indptr.long()
    starts, counts = kv[:-1][dec], (kv[1:] - kv[:-1])[dec]
    indptr = torch.zeros(dec.numel() + 1, dtype=torch.long, device=qo.device)
    torch.cumsum(counts, 0, out=indptr[1:])
    offset = torch.arange(int(indptr[-1]), device=qo.device) - indptr[:-1].repeat_interleave(counts)
    pages = meta.kv_page_indices.long()[starts.repeat_interleave(counts) + offset]
    return ((~single).nonzero().squeeze(1), qo[:-1][dec], indptr.int(), pages.int(),
            meta.kv_last_page_len[dec].int().contiguous())
