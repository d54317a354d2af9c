"""Torch paged attention: the reference and the CPU default.

Requests are split into at most two groups, decode rows (``qo_len == 1``) and the rest, so a
chunked-prefill step does not pad every decode request to the chunk length. Each group's KV is
gathered into a padded ``[b, max_kv_len]`` batch and attended with one
``scaled_dot_product_attention`` call. GQA is done without repeating K/V: with an explicit mask
the ``G = Hq / Hkv`` query heads sharing a KV head are folded into the query axis; a plain causal
group (equal lengths, no cached prefix) uses SDPA's ``is_causal`` with ``enable_gqa`` instead. Gather indices and masks depend
only on the metadata, so the first layer of a step derives them and memoizes them in
``meta.derived`` for the others. Padding keys point at the request's own first token (always
written) and padding queries copy a real query, so no NaN or garbage can leak into real rows.
Half-precision inputs go to SDPA as they are: its fused CPU and CUDA kernels accumulate the
softmax and the weighted sum in float32 (upcasting bfloat16 K/V first would cost 3x on CPU). The
exception is float16 on CPU, whose SDPA kernel ran 2.1x slower than float32 and bfloat16 on an
AVX-512 EPYC (no float16 arithmetic there): its gathered q, K and V are widened to float32 (exact)
and the output rounded back to float16, as the C++ decode operator returns it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from treeserve.kvcache.metadata import AttentionMetadata


@dataclass(slots=True)
class _Group:
    """One SDPA call's worth of requests, padded to ``[bsz, max_qo]`` queries x ``max_kv`` keys."""

    bsz: int
    max_qo: int
    max_kv: int
    kv_slots: torch.Tensor  # [bsz * max_kv] slots to gather; padding -> the request's first slot
    q_index: torch.Tensor | None  # [bsz * max_qo] rows of q per padded row; None: q as it is
    real_rows: torch.Tensor | None  # padded rows that are real queries; None: all of them
    dst_rows: torch.Tensor | None  # rows of the output those real rows go to
    mask: torch.Tensor | None  # [bsz, 1, max_qo | 1, max_kv] bool, True = may attend
    is_causal: bool  # equal lengths, no prefix: SDPA's own causal mask is right
    additive: dict[tuple[int, torch.dtype], torch.Tensor | None] = field(default_factory=dict)

    def additive_mask(self, g: int, dtype: torch.dtype) -> torch.Tensor | None:
        """The mask as an additive float mask (SDPA would convert a bool one on every call), each
        query row repeated for the ``g`` query heads folded into the query axis; memoized."""
        key = (g, dtype)
        if key not in self.additive:
            mask = self.mask
            if mask is not None:
                if g > 1 and mask.shape[-2] > 1:  # a 1-row decode mask broadcasts instead
                    mask = mask.repeat(*([1] * (mask.dim() - 2)), g, 1)  # rows ordered (g, i)
                mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
            self.additive[key] = mask
        return self.additive[key]


def _group(meta: AttentionMetadata, req: torch.Tensor | None, causal: bool) -> _Group:
    """Derive gather indices and the mask for requests ``req`` (None: the whole batch)."""
    dev, ps = meta.device, meta.page_size
    qo_indptr, kv_indptr = meta.qo_indptr.long(), meta.kv_indptr.long()
    q_start, p_start = qo_indptr[:-1], kv_indptr[:-1]
    qo_lens = qo_indptr[1:] - q_start
    kv_lens = (kv_indptr[1:] - p_start - 1) * ps + meta.kv_last_page_len.long()
    tree_start = meta.tree_mask_indptr.long()[:-1] if meta.tree_mask_indptr is not None else None
    if req is not None:
        q_start, p_start, qo_lens, kv_lens = q_start[req], p_start[req], qo_lens[req], kv_lens[req]
        tree_start = tree_start[req] if tree_start is not None else None
    bsz = qo_lens.shape[0]
    max_qo, max_kv = int(qo_lens.max()), int(kv_lens.max())

    j = torch.arange(max_kv, device=dev)
    key_valid = j < kv_lens[:, None]  # [b, max_kv]
    jj = torch.where(key_valid, j, 0)
    page = meta.kv_page_indices.long()[p_start[:, None] + jj // ps]
    kv_slots = (page * ps + jj % ps).reshape(-1)

    same_kv = bool((kv_lens == max_kv).all())
    same_qo = bool((qo_lens == max_qo).all())
    i = torch.arange(max_qo, device=dev)
    ii = torch.minimum(i, qo_lens[:, None] - 1)  # padding rows repeat the last real row
    if req is None and same_qo:
        q_index = real_rows = dst_rows = None
    else:
        q_index = (q_start[:, None] + ii).reshape(-1)
        real = (i < qo_lens[:, None]).reshape(-1)
        real_rows = None if same_qo else real.nonzero().squeeze(1)
        dst_rows = q_index if same_qo else q_index[real_rows]

    def make(mask: torch.Tensor | None, is_causal: bool = False) -> _Group:
        return _Group(bsz, max_qo, max_kv, kv_slots, q_index, real_rows, dst_rows, mask, is_causal)

    if max_qo == 1:  # decode: a one-token row (causal or 1-node tree) sees its whole KV
        return make(None if same_kv else key_valid[:, None, None, :])
    if meta.tree_mask is None and same_kv and same_qo and (not causal or max_qo == max_kv):
        return make(None, causal)
    if not causal:
        return make(key_valid[:, None, None, :])
    prefix = (kv_lens - qo_lens)[:, None, None]  # [b, 1, 1]
    mask = j <= prefix + ii[:, :, None]  # causal at absolute positions; implies j < kv_len
    if meta.tree_mask is not None:
        col = (j - prefix).clamp(min=0, max=max_qo - 1)  # new-token index of key j
        flat = tree_start[:, None, None] + ii[:, :, None] * qo_lens[:, None, None] + col
        in_tree = meta.tree_mask[flat.clamp(max=meta.tree_mask.numel() - 1)]
        mask = (j < prefix) | (mask & in_tree)
    return make(mask[:, None])


def _groups(meta: AttentionMetadata, causal: bool) -> list[_Group]:
    qo_lens = meta.qo_indptr[1:] - meta.qo_indptr[:-1]
    decode = qo_lens == 1
    num_decode = int(decode.sum())
    if num_decode in (0, meta.batch_size):
        return [_group(meta, None, causal)]
    return [_group(meta, decode.nonzero().squeeze(1), causal), _group(meta, (~decode).nonzero().squeeze(1), causal)]


def paged_attention_torch_subset(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    req: torch.Tensor,
    scale: float,
    causal: bool,
) -> torch.Tensor:
    """The torch backend for the requests ``req`` (int64 indices, not all of the batch) only:
    ``[N, Hq, D]`` with those requests' rows written and every other row left uninitialized (the
    caller fills them). The gather indices and mask are memoized in ``meta.derived``, so every call
    with one ``meta`` must pass the same ``req`` (the ``cpu`` backend's split of that step)."""
    key = ("torch-subset", causal)
    group = meta.derived.get(key)
    if group is None:
        group = meta.derived[key] = _group(meta, req, causal)
    return _attend(q, k_cache, v_cache, [group], scale)


def _per_request_groups(meta: AttentionMetadata, causal: bool) -> list[_Group]:
    idx = torch.arange(meta.batch_size, device=meta.device)
    return [_group(meta, idx[i : i + 1], causal) for i in range(meta.batch_size)]


def paged_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    causal: bool,
    per_request: bool = False,
) -> torch.Tensor:
    """Torch backend of :func:`treeserve.kvcache.paged_attention` (inputs already validated).

    Rows are attended in at most two padded groups (decode rows, the rest). ``per_request=True``
    is the batch-invariant variant: one unpadded SDPA call per request, in request order, so a
    request's output depends only on its own queries and KV (no padding to another request's
    length, no shared reduction) and is bitwise the same whatever else is in the batch.
    """
    key = ("torch", causal, per_request)
    groups = meta.derived.get(key)
    if groups is None:
        groups = meta.derived[key] = (_per_request_groups if per_request else _groups)(meta, causal)
    return _attend(q, k_cache, v_cache, groups, scale)


paged_attention_torch_per_request = functools.partial(paged_attention_torch, per_request=True)
"""Batch-invariant torch backend (``paged_attention_torch`` with ``per_request=True``)."""


def _attend(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, groups: list[_Group], scale: float
) -> torch.Tensor:
    n, hq, d = q.shape
    hkv = k_cache.shape[2]
    g = hq // hkv
    out = None
    widen = q.dtype == torch.float16 and q.device.type == "cpu"
    for grp in groups:  # one or two groups (decode rows, the rest), or one per request
        k = k_cache.view(-1, hkv, d).index_select(0, grp.kv_slots).view(grp.bsz, grp.max_kv, hkv, d)
        v = v_cache.view(-1, hkv, d).index_select(0, grp.kv_slots).view(grp.bsz, grp.max_kv, hkv, d)
        qp = q if grp.q_index is None else q.index_select(0, grp.q_index)
        if widen:
            k, v, qp = k.float(), v.float(), qp.float()
        if grp.is_causal:  # SDPA's own causal mask, GQA by broadcasting: its fastest kernels
            qb = qp.reshape(grp.bsz, grp.max_qo, hq, d).transpose(1, 2)
            o = F.scaled_dot_product_attention(
                qb, k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=scale, enable_gqa=g > 1
            )
            o = o.transpose(1, 2).reshape(grp.bsz * grp.max_qo, hq, d)
        else:
            qb = qp.reshape(grp.bsz, grp.max_qo, hkv, g, d).permute(0, 2, 3, 1, 4)
            qb = qb.reshape(grp.bsz, hkv, g * grp.max_qo, d)
            o = F.scaled_dot_product_attention(
                qb, k.transpose(1, 2), v.transpose(1, 2), attn_mask=grp.additive_mask(g, qp.dtype), scale=scale
            )
            o = o.view(grp.bsz, hkv, g, grp.max_qo, d).permute(0, 3, 1, 2, 4).reshape(grp.bsz * grp.max_qo, hq, d)
        o = o.to(q.dtype)
        if grp.dst_rows is None:
            return o
        if out is None:
            out = torch.empty(n, hq, d, dtype=q.dtype, device=q.device)
        out.index_copy_(0, grp.dst_rows, o if grp.real_rows is None else o.index_select(0, grp.real_rows))
    assert out is not None
    return out
