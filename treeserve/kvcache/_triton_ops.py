"""Triton kernels for the KV ops: row copies between token-major K/V buffers and paged caches.

A *row* is one token's K (or V) for all KV heads: ``num_kv_heads * head_dim`` contiguous
elements. A cache ``[num_pages, page_size, H, D]`` is viewed as ``[num_pages * page_size, H*D]``
rows, so a slot index is a row index.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit
def _copy_kv_rows_kernel(
    src_k,
    src_v,
    dst_k,
    dst_v,
    src_idx,
    dst_idx,
    row_size,
    GATHER: tl.constexpr,
    SCATTER: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # dst[dst_idx[i]] = src[src_idx[i]] for K and V; identity index where GATHER/SCATTER is off.
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < row_size
    if GATHER:
        src_row = tl.load(src_idx + i).to(tl.int64)
    else:
        src_row = i.to(tl.int64)
    if SCATTER:
        dst_row = tl.load(dst_idx + i).to(tl.int64)
    else:
        dst_row = i.to(tl.int64)
    src_off = src_row * row_size + cols
    dst_off = dst_row * row_size + cols
    tl.store(dst_k + dst_off, tl.load(src_k + src_off, mask=mask), mask=mask)
    tl.store(dst_v + dst_off, tl.load(src_v + src_off, mask=mask), mask=mask)


def _launch(
    src_k: torch.Tensor,
    src_v: torch.Tensor,
    dst_k: torch.Tensor,
    dst_v: torch.Tensor,
    src_idx: torch.Tensor | None,
    dst_idx: torch.Tensor | None,
    n: int,
) -> None:
    row_size = src_k.shape[-1] * src_k.shape[-2]
    if n == 0:
        return
    grid = (n, triton.cdiv(row_size, _BLOCK))
    dummy = src_idx if src_idx is not None else dst_idx
    _copy_kv_rows_kernel[grid](
        src_k,
        src_v,
        dst_k,
        dst_v,
        src_idx if src_idx is not None else dummy,
        dst_idx if dst_idx is not None else dummy,
        row_size,
        GATHER=src_idx is not None,
        SCATTER=dst_idx is not None,
        BLOCK=_BLOCK,
    )


def store_kv_triton(
    k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """``cache[slot[i]] = k[i]`` (and v) for every token ``i`` (inputs validated by the caller)."""
    _launch(k.contiguous(), v.contiguous(), k_cache, v_cache, None, slots, slots.numel())


def gather_kv_triton(
    k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Copy the K/V rows at ``slots`` out of a layer's caches into new ``[N, H, D]`` tensors."""
    n = slots.numel()
    shape = (n, k_cache.shape[2], k_cache.shape[3])
    k = torch.empty(shape, dtype=k_cache.dtype, device=k_cache.device)
    v = torch.empty(shape, dtype=v_cache.dtype, device=v_cache.device)
    _launch(k_cache, v_cache, k, v, slots, None, n)
    return k, v


def compact_tree_path_triton(
    k_caches: Sequence[torch.Tensor], v_caches: Sequence[torch.Tensor], src_slots: torch.Tensor, dst_slots: torch.Tensor
) -> None:
    """Every layer: gather the rows at ``src_slots``, then write them at ``dst_slots``."""
    for kc, vc in zip(k_caches, v_caches, strict=True):
        k, v = gather_kv_triton(kc, vc, src_slots)
        store_kv_triton(kc, vc, dst_slots, k, v)
