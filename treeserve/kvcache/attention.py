"""Paged attention (decode, prefill/extend, token-tree) over the paged KV pool.

Conventions (docs/INTERFACES.md): a step's new tokens have their K/V stored (``store_kv``)
before attention, so ``kv_len`` counts them; query ``i`` of a request with ``qo_len`` new tokens
sits at position ``kv_len - qo_len + i``. Without a tree mask attention is causal; with one, a
new token sees the whole cached prefix plus the new tokens the mask allows (its ancestors and
itself in the draft tree).

:class:`AttentionMetadata` is built once per step and shared by every layer; backends cache
what they derive from it (gather indices, masks, plans) inside it, so only the first layer of a
step pays for that.
"""

from __future__ import annotations

import torch

from treeserve.kvcache._checks import _capturing, check_cache_pair, check_range, debug_checks_enabled
from treeserve.kvcache.backends import KernelBackend, select_backend
from treeserve.kvcache.metadata import AttentionMetadata

__all__ = ["paged_attention"]


def _check_attention_inputs(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
) -> None:
    check_cache_pair(k_cache, v_cache)
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError(f"q must be a [N, num_q_heads, head_dim] tensor, got {getattr(q, 'shape', type(q))}")
    n, hq, d = q.shape
    _, ps, hkv, dk = k_cache.shape
    if n != meta.num_qo_tokens:
        raise ValueError(f"q has {n} tokens but the metadata describes {meta.num_qo_tokens}")
    if d != dk:
        raise ValueError(f"q head_dim {d} differs from the cache head_dim {dk}")
    if hq % hkv:
        raise ValueError(f"num_q_heads ({hq}) must be a multiple of num_kv_heads ({hkv})")
    if q.dtype != k_cache.dtype:
        raise TypeError(f"q dtype {q.dtype} differs from the cache dtype {k_cache.dtype}")
    if q.device != k_cache.device or meta.device != k_cache.device:
        raise ValueError(
            f"q ({q.device}), caches ({k_cache.device}) and metadata ({meta.device}) must share a device"
        )
    if ps != meta.page_size:
        raise ValueError(f"cache page_size {ps} differs from the metadata page_size {meta.page_size}")
    key = ("pages_checked", k_cache.shape[0])
    if debug_checks_enabled() and key not in meta.derived:  # once per step, not per layer
        # Only the pages a request reads are meaningful: a static runner's buffer is longer.
        pages = meta.kv_page_indices
        if not _capturing(pages):
            pages = pages[: int(meta.kv_indptr[-1])]
        check_range("kv_page_indices", pages, 0, k_cache.shape[0])
        meta.derived[key] = True


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float | None = None,
    backend: str | KernelBackend = "auto",
    causal: bool = True,
) -> torch.Tensor:
    """Attention of the step's new queries over each request's paged KV.

    ``q: [N, num_q_heads, head_dim]`` (``N = meta.num_qo_tokens``, same dtype as the caches;
    ``num_q_heads`` a multiple of ``num_kv_heads``), one layer's ``k_cache, v_cache:
    [num_pages, page_size, num_kv_heads, head_dim]``. Returns ``[N, num_q_heads, head_dim]`` in
    ``q``'s dtype; softmax is accumulated in float32 (float64 for float64 inputs). ``scale``
    defaults to ``head_dim ** -0.5``. ``causal=False`` lets every query see its request's whole
    KV (not allowed together with a tree mask). ``backend``: a
    :class:`~treeserve.kvcache.backends.KernelBackend` chosen by the caller, or a name:
    ``auto`` (the metadata's ``attention_backend`` when the runner set one, else flashinfer >
    triton on CUDA, torch on CPU), ``torch``, ``triton``, ``flashinfer`` or any registered name.
    With ``TREESERVE_DEBUG_CHECKS=1`` the page indices are range-checked (a host read, once per
    metadata).
    """
    if not isinstance(meta, AttentionMetadata):
        raise TypeError(f"meta must be an AttentionMetadata, got {type(meta).__name__}")
    _check_attention_inputs(q, k_cache, v_cache, meta)
    if not causal and meta.tree_mask is not None:
        raise ValueError("causal=False cannot be combined with a tree mask")
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if isinstance(backend, KernelBackend):
        kernel = backend
    elif backend == "auto" and meta.attention_backend is not None:
        kernel = meta.attention_backend
    else:
        kernel = select_backend("paged_attention", backend, q.device, q.dtype)
    return kernel(q, k_cache, v_cache, meta, float(scale), causal)
