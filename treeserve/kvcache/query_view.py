"""A step's short requests seen as one-query "requests": the page table of each query row.

A query of a request with ``qo_len`` new tokens (a decode row, a draft-tree verify row, a short
prefill chunk) sees the request's cached prefix plus the new tokens its mask allows (causal: the
ones before it and itself; a tree: its ancestors and itself; ``causal=False``: all). When those
keys can be listed as pages -- always with page size 1; with larger pages only when the visible
new tokens are a leading run (chains, causal chunks) -- the query is exactly a decode query over
its own page list, and the decode-attention operator (``paged_decode_attention``) and the fused
decode layers (``decode_layers``) serve it. :func:`query_view` builds those page lists once per
step (vectorized in numpy on the host, memoized in ``meta.derived``); requests it cannot express are left to the
caller (``QueryView.rest``).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
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


def _host(t: torch.Tensor) -> np.ndarray:
    return t.cpu().numpy().astype(np.int64)


def _visible_new(meta: AttentionMetadata, req: np.ndarray, qo: np.ndarray, b_q: np.ndarray, i_q: np.ndarray,
                 width: int, causal: bool) -> np.ndarray:
    """``[Q, width]`` bool: which new tokens of its request query q sees (a tree mask, or every
    new token: ``_build`` takes the causal case without this)."""
    j = np.arange(width)
    inside = j < qo[b_q][:, None]
    if not causal:
        return inside
    start = _host(meta.tree_mask_indptr)[req][b_q]
    flat = start[:, None] + i_q[:, None] * qo[b_q][:, None] + j
    return meta.tree_mask.cpu().numpy()[np.where(inside, flat, 0)] & inside


def _build(meta: AttentionMetadata, causal: bool) -> QueryView | None:
    """The page lists, computed on the host in numpy (the metadata's index tensors are host
    tensors on the CPU, where both callers run): a verify step's view took ~0.4 ms as ~50 small
    torch operations on the 2-core EPYC. Causal requests (no tree mask) see a leading run of their
    new tokens, which needs no per-token visibility table."""
    ps = meta.page_size
    qo_ptr = _host(meta.qo_indptr)
    qo_all = np.diff(qo_ptr)
    kv_ptr = _host(meta.kv_indptr)
    kv_all = (np.diff(kv_ptr) - 1) * ps + _host(meta.kv_last_page_len)
    req = np.flatnonzero(qo_all <= MAX_VIEW_QUERIES)
    if req.size == 0:
        return None
    qo = qo_all[req]
    b_q = np.repeat(np.arange(req.size), qo)  # request (in req) of each query
    i_q = np.arange(b_q.size) - (np.cumsum(qo) - qo)[b_q]  # index within its request
    extra = None  # [Q, width] bool: new tokens visible after a gap in their query's run
    if causal and meta.tree_mask is None:
        lead = i_q + 1  # visible leading run of new tokens
    else:
        vis = _visible_new(meta, req, qo, b_q, i_q, int(qo.max()), causal)
        lead = np.cumprod(vis, 1).sum(1)
        extra = vis & (np.arange(vis.shape[1]) >= lead[:, None])
        if not extra.any():
            extra = None
    if ps > 1 and extra is not None:  # a gap cannot be listed in whole pages: such requests stay out
        bad = np.zeros(req.size, dtype=bool)
        np.logical_or.at(bad, b_q, extra.any(1))
        keep = ~bad
        req = req[keep]
        if req.size == 0:
            return None
        qo = qo[keep]
        kept_q = keep[b_q]
        b_q = np.repeat(np.arange(req.size), qo)
        i_q, lead, extra = i_q[kept_q], lead[kept_q], None
    prefix = kv_all[req] - qo
    run = prefix[b_q] + lead  # keys in one leading range: the prefix then the run
    run_pages = -(-run // ps)
    n_extra = 0 if extra is None else extra.sum(1)
    indptr = np.zeros(run.size + 1, dtype=np.int64)
    np.cumsum(run_pages + n_extra, out=indptr[1:])
    pages_all = _host(meta.kv_page_indices)
    start = kv_ptr[:-1][req][b_q]
    out = np.empty(int(indptr[-1]), dtype=np.int64)
    off = np.arange(int(run_pages.sum())) - np.repeat(np.cumsum(run_pages) - run_pages, run_pages)
    out[np.repeat(indptr[:-1], run_pages) + off] = pages_all[np.repeat(start, run_pages) + off]
    if extra is not None:  # page size 1: each gap token is its own page
        q_of, j_of = np.nonzero(extra)
        rank = np.cumsum(extra, 1)[q_of, j_of] - 1
        out[indptr[q_of] + run_pages[q_of] + rank] = pages_all[start[q_of] + prefix[b_q][q_of] + j_of]
    last = np.where(n_extra > 0, 1, run - (run_pages - 1) * ps)
    rows = np.repeat(qo_ptr[req], qo) + i_q
    rest = np.ones(qo_all.size, dtype=bool)
    rest[req] = False
    dev = meta.device

    def to(a: np.ndarray, dtype: type) -> torch.Tensor:  # converted in numpy: one torch op less each
        t = torch.from_numpy(a.astype(dtype, copy=False))
        return t if dev.type == "cpu" else t.to(dev)

    return QueryView(to(rows, np.int64), to(indptr, np.int32), to(out, np.int32), to(last, np.int32),
                     to(np.flatnonzero(rest), np.int64))
