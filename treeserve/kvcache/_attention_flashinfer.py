"""FlashInfer paged attention (CUDA only, when the ``flashinfer`` package is installed).

Our metadata already is FlashInfer's paged layout (NHD caches, int32 ``qo_indptr`` /
``kv_indptr`` / ``kv_page_indices`` / ``kv_last_page_len``). Decode batches without a tree use
``BatchDecodeWithPagedKVCacheWrapper``; everything else uses
``BatchPrefillWithPagedKVCacheWrapper`` (bottom-right aligned causal mask, i.e. query ``i`` at
``kv_len - qo_len + i``), with ``custom_mask`` for token trees: FlashInfer wants, per request,
the row-major ``qo_len x kv_len`` mask, so the prefix columns are filled in here. The planned
wrapper is memoized in the metadata, so ``plan`` runs once per step, not once per layer.
"""

from __future__ import annotations

from typing import Any

import torch

from treeserve.kvcache.metadata import AttentionMetadata

_WORKSPACE_BYTES = 128 * 1024 * 1024
_workspaces: dict[torch.device, torch.Tensor] = {}


def _workspace(device: torch.device) -> torch.Tensor:
    if device not in _workspaces:
        _workspaces[device] = torch.zeros(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    return _workspaces[device]


def _full_custom_mask(meta: AttentionMetadata) -> torch.Tensor:
    """Per request ``[qo_len, kv_len]`` rows: prefix visible, new tokens per the tree mask."""
    assert meta.tree_mask is not None and meta.tree_mask_indptr is not None
    qo_indptr = meta.qo_indptr.tolist()
    kv_indptr = meta.kv_indptr.tolist()
    last = meta.kv_last_page_len.tolist()
    tree_indptr = meta.tree_mask_indptr.tolist()
    parts = []
    for b in range(meta.batch_size):  # once per step, host side
        qo = qo_indptr[b + 1] - qo_indptr[b]
        kv = (kv_indptr[b + 1] - kv_indptr[b] - 1) * meta.page_size + last[b]
        tree = meta.tree_mask[tree_indptr[b] : tree_indptr[b + 1]].view(qo, qo)
        prefix = torch.ones(qo, kv - qo, dtype=torch.bool, device=meta.device)
        parts.append(torch.cat([prefix, tree], dim=1).reshape(-1))
    return torch.cat(parts)


def _plan(meta: AttentionMetadata, q: torch.Tensor, k_cache: torch.Tensor, scale: float, causal: bool) -> Any:
    import flashinfer

    hq, d = q.shape[1], q.shape[2]
    hkv = k_cache.shape[2]
    ws = _workspace(q.device)
    if meta.max_qo_len == 1:
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
        wrapper.plan(
            meta.kv_indptr,
            meta.kv_page_indices,
            meta.kv_last_page_len,
            hq,
            hkv,
            d,
            meta.page_size,
            q_data_type=q.dtype,
            kv_data_type=k_cache.dtype,
            sm_scale=scale,
        )
        return wrapper
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
    custom = _full_custom_mask(meta) if meta.tree_mask is not None else None
    wrapper.plan(
        meta.qo_indptr,
        meta.kv_indptr,
        meta.kv_page_indices,
        meta.kv_last_page_len,
        hq,
        hkv,
        d,
        meta.page_size,
        custom_mask=custom,
        causal=causal and custom is None,
        sm_scale=scale,
        q_data_type=q.dtype,
        kv_data_type=k_cache.dtype,
    )
    return wrapper


def paged_attention_flashinfer(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    causal: bool,
) -> torch.Tensor:
    """FlashInfer backend of :func:`treeserve.kvcache.paged_attention` (inputs already validated)."""
    key = ("flashinfer", q.shape[1], k_cache.shape[2], q.shape[2], q.dtype, scale, causal)
    wrapper = meta.derived.get(key)
    if wrapper is None:
        wrapper = meta.derived[key] = _plan(meta, q, k_cache, scale, causal)
    return wrapper.run(q, (k_cache, v_cache))
