"""Torch paged attention: the reference and the CPU default.

Each request's KV is gathered into a padded ``[B, max_kv_len]`` batch and attended with
``scaled_dot_product_attention``. GQA is done without repeating K/V: the ``G = Hq / Hkv`` query
heads sharing a KV head are folded into the query-length axis. Gather indices and masks depend
only on the metadata, so they are derived by the first layer of a step and memoized in
``meta.derived`` for the rest. Padding keys point at the request's own first token (always
written) and padding queries copy a real query, so no NaN or garbage can leak into real rows.
Half-precision inputs go to SDPA as they are: its fused CPU and CUDA kernels accumulate the
softmax and the weighted sum in float32 (upcasting K/V first would cost 3x on CPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from treeserve.kvcache.attention import AttentionMetadata


@dataclass(slots=True)
class _Plan:
    """Derived per step: gather indices and the attention mask (None when not needed)."""

    kv_slots: torch.Tensor  # [B * max_kv] slots to gather, padding -> request's first slot
    q_index: torch.Tensor | None  # [B * max_qo] rows of q to gather (None: equal qo_lens)
    out_rows: torch.Tensor | None  # real rows of the padded [B * max_qo] output (None: all)
    mask: torch.Tensor | None  # [B, 1, max_qo, max_kv] bool, True = may attend
    is_causal: bool  # uniform prefill without prefix: let SDPA apply the causal mask


def _plan(meta: AttentionMetadata, causal: bool) -> _Plan:
    dev = meta.device
    ps = meta.page_size
    qo_indptr = meta.qo_indptr.long()
    kv_indptr = meta.kv_indptr.long()
    qo_lens = qo_indptr[1:] - qo_indptr[:-1]
    kv_lens = (kv_indptr[1:] - kv_indptr[:-1] - 1) * ps + meta.kv_last_page_len.long()
    max_qo, max_kv = meta.max_qo_len, meta.max_kv_len

    j = torch.arange(max_kv, device=dev)
    key_valid = j < kv_lens[:, None]  # [B, max_kv]
    jj = torch.where(key_valid, j, 0)
    page = meta.kv_page_indices.long()[kv_indptr[:-1, None] + jj // ps]
    kv_slots = (page * ps + jj % ps).reshape(-1)

    same_kv = bool((kv_lens == max_kv).all())
    same_qo = bool((qo_lens == max_qo).all())
    if max_qo == 1:  # decode: a 1-token tree or causal row sees the whole KV
        return _Plan(kv_slots, None, None, None if same_kv else key_valid[:, None, None, :], False)
    if meta.tree_mask is None and same_kv and same_qo and (not causal or max_qo == max_kv):
        return _Plan(kv_slots, None, None, None, causal)  # no mask, or SDPA's (top-left) causal

    i = torch.arange(max_qo, device=dev)
    q_valid = i < qo_lens[:, None]  # [B, max_qo]
    ii = torch.minimum(i, qo_lens[:, None] - 1)  # padding rows repeat the last real row
    q_index = None if same_qo else (qo_indptr[:-1, None] + ii).reshape(-1)
    if not causal:
        mask = key_valid[:, None, :].expand(-1, max_qo, -1)
    else:
        prefix = (kv_lens - qo_lens)[:, None, None]  # [B, 1, 1]
        pos = prefix + ii[:, :, None]  # [B, max_qo, 1] absolute query positions
        mask = j <= pos  # causal; implies j < kv_len
        if meta.tree_mask is not None:
            col = (j - prefix).clamp(min=0, max=max(max_qo - 1, 0))  # new-token index of key j
            qo = qo_lens[:, None, None]
            flat = meta.tree_mask_indptr.long()[:-1, None, None] + ii[:, :, None] * qo + col
            in_tree = meta.tree_mask[flat.clamp(max=max(meta.tree_mask.numel() - 1, 0))]
            mask = (j < prefix) | (mask & in_tree)
    out_rows = None if same_qo else q_valid.reshape(-1).nonzero().squeeze(1)
    return _Plan(kv_slots, q_index, out_rows, mask[:, None], False)


def _additive_mask(meta: AttentionMetadata, plan: _Plan, causal: bool, g: int, dtype: torch.dtype) -> torch.Tensor | None:
    """The plan's mask as an additive float mask (SDPA would convert a bool one on every call),
    with each query row repeated for the ``g`` query heads folded into the query axis."""
    key = ("torch_mask", causal, g, dtype)
    if key in meta.derived:
        return meta.derived[key]
    mask = plan.mask
    if mask is None and plan.is_causal and g > 1:  # SDPA's is_causal cannot see the folding
        mask = torch.ones(meta.max_qo_len, meta.max_qo_len, dtype=torch.bool, device=meta.device).tril_()
    if mask is not None:
        if g > 1 and mask.shape[-2] > 1:  # (a 1-row decode mask broadcasts instead)
            mask = mask.repeat(*([1] * (mask.dim() - 2)), g, 1)  # rows ordered (g, i)
        mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    meta.derived[key] = mask
    return mask


def paged_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    causal: bool,
) -> torch.Tensor:
    """Torch backend of :func:`treeserve.kvcache.paged_attention` (inputs already validated)."""
    key = ("torch", causal)
    plan = meta.derived.get(key)
    if plan is None:
        plan = meta.derived[key] = _plan(meta, causal)
    bsz, max_qo, max_kv = meta.batch_size, meta.max_qo_len, meta.max_kv_len
    n, hq, d = q.shape
    hkv = k_cache.shape[2]
    g = hq // hkv

    def gather(cache: torch.Tensor) -> torch.Tensor:
        rows = cache.view(-1, hkv, d).index_select(0, plan.kv_slots)
        return rows.view(bsz, max_kv, hkv, d).transpose(1, 2)  # [B, Hkv, L, D]

    k, v = gather(k_cache), gather(v_cache)
    mask = _additive_mask(meta, plan, causal, g, q.dtype)
    qp = q if plan.q_index is None else q.index_select(0, plan.q_index)
    qb = qp.reshape(bsz, max_qo, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(bsz, hkv, g * max_qo, d)
    out = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, is_causal=plan.is_causal and g == 1, scale=scale)
    out = out.view(bsz, hkv, g, max_qo, d).permute(0, 3, 1, 2, 4).reshape(bsz * max_qo, hq, d)
    if plan.out_rows is not None:
        out = out.index_select(0, plan.out_rows)
    return out
