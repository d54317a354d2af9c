"""A step's short requests seen as one-query "requests": the page table of each query row.

A query of a request with ``qo_len`` new tokens (a decode row, a draft-tree verify row, a short
prefill chunk) sees the request's cached prefix plus the new tokens its mask allows (causal: the
ones before it and itself; a tree: its ancestors and itself; ``causal=False``: all). When those
keys can be listed as pages -- always with page size 1; with larger pages only when the visible
new tokens are a leading run (chains, causal chunks) -- the query is exactly a decode query over
its own page list, and the decode-attention operator (``paged_decode_attention``) and the fused
decode layers (``decode_layers``) serve it. :func:`query_view` builds those page lists once per
step (vectorized, memoized in ``meta.derived``); requests it cannot express are left to the
caller (``QueryView.rest``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from treeserve.kvcache.metadata import AttentionMetadata

__all__ = ["MAX_VIEW_QUERIES", "QueryView", "query_view"]

MAX_VIEW_QUERIES = 16
"""Requests with more new tokens than this (prefill chunks) stay on the batched attention path."""


class QueryView(NamedTuple):
    """One page table per covered query row (all int32, on ``meta``'s device).

    ``rows [Q]``: the covered rows of the step's query tensor, in order; ``kv_indptr [Q+1]``,
    ``kv_page_indices``, ``kv_last_page_len [Q]``: their pages, in the metadata's layout;
    ``rest``: indices of the requests not covered (int64; empty when every row is)."""

    rows: torch.Tensor
    kv_indptr: torch.Tensor
    kv_page_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    rest: torch.Tensor

    @property
    def covers_all(self) -> bool:
        """Whether every request of the step is covered (``rows`` is then ``0..N-1``)."""
        return self.rest.numel() == 0


def query_view(meta: AttentionMetadata, causal: bool = True) -> QueryView | None:
    """The per-query page tables of ``meta``'s short requests (see the module), or ``None`` when
    no request can be expressed. Memoized per ``causal`` in ``meta.derived``: every layer of a
    step (and the fused decode path) shares one."""
    key = ("query-view", causal)
    if key not in meta.derived:
        meta.derived[key] = _build(meta, causal)
    return meta.derived[key]


def _visible_new(meta: AttentionMetadata, req: torch.Tensor, qo: torch.Tensor, b_q: torch.Tensor,
                 i_q: torch.Tensor, width: int, causal: bool) -> torch.Tensor:
    """``[Q, width]`` bool: which new tokens of its request query q sees."""
    j = torch.arange(width, device=qo.device)
    inside = j < qo[b_q][:, None]
    if not causal:
        return inside
    if meta.tree_mask is None:
        return j <= i_q[:, None]
    start = meta.tree_mask_indptr.long()[req][b_q]
    flat = start[:, None] + i_q[:, None] * qo[b_q][:, None] + j
    return meta.tree_mask[torch.where(inside, flat, 0)] & inside


def _build(meta: AttentionMetadata, causal: bool) -> QueryView | None:
    dev, ps = meta.device, meta.page_size
    qo_all = meta.qo_indptr.long().diff()
    kv_ptr = meta.kv_indptr.long()
    npages = kv_ptr.diff()
    kv_all = (npages - 1) * ps + meta.kv_last_page_len.long()
    req = (qo_all <= MAX_VIEW_QUERIES).nonzero().squeeze(1)
    if req.numel() == 0:
        return None
    qo = qo_all[req]
    b_q = torch.arange(req.numel(), device=dev).repeat_interleave(qo)  # request (in req) of each query
    first = torch.cumsum(qo, 0) - qo
    i_q = torch.arange(b_q.numel(), device=dev) - first[b_q]  # index within its request
    vis = _visible_new(meta, req, qo, b_q, i_q, int(qo.max()), causal)
    lead = torch.cumprod(vis.int(), 1).sum(1)  # visible leading run of new tokens
    extra = vis & (torch.arange(vis.shape[1], device=dev) >= lead[:, None])  # visible after a gap
    if ps > 1:  # a gap cannot be listed in whole pages: such requests stay out
        bad = torch.zeros(req.numel(), dtype=torch.bool, device=dev).index_put_((b_q,), extra.any(1), accumulate=True)
        if bool(bad.any()):
            keep = ~bad
            req = req[keep]
            if req.numel() == 0:
                return None
            qo = qo[keep]
            kept_q = keep[b_q]
            b_q = torch.arange(req.numel(), device=dev).repeat_interleave(qo)
            i_q, lead, extra = i_q[kept_q], lead[kept_q], extra[kept_q]
    prefix = kv_all[req] - qo
    run = prefix[b_q] + lead  # keys in one leading range: the prefix then the run
    run_pages = -(-run // ps)
    n_extra = extra.sum(1)
    counts = run_pages + n_extra
    indptr = torch.zeros(counts.numel() + 1, dtype=torch.long, device=dev)
    torch.cumsum(counts, 0, out=indptr[1:])
    pages_all = meta.kv_page_indices.long()
    start = kv_ptr[:-1][req][b_q]
    out = torch.empty(int(indptr[-1]), dtype=torch.long, device=dev)
    off = torch.arange(int(run_pages.sum()), device=dev) - (torch.cumsum(run_pages, 0) - run_pages).repeat_interleave(run_pages)
    out[indptr[:-1].repeat_interleave(run_pages) + off] = pages_all[start.repeat_interleave(run_pages) + off]
    if bool(n_extra.any()):  # page size 1: each gap token is its own page
        q_of, j_of = extra.nonzero(as_tuple=True)
        rank = torch.cumsum(extra.int(), 1)[q_of, j_of] - 1
        out[indptr[q_of] + run_pages[q_of] + rank] = pages_all[start[q_of] + prefix[b_q][q_of] + j_of]
    last = torch.where(n_extra > 0, 1, run - (run_pages - 1) * ps)
    rows = meta.qo_indptr.long()[req].repeat_interleave(qo) + i_q
    rest = (torch.ones_like(qo_all, dtype=torch.bool).index_fill_(0, req, False)).nonzero().squeeze(1)
    return QueryView(rows, indptr.int(), out.int(), last.int(), rest)
