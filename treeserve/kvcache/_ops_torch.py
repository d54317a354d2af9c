"""Torch implementations of the KV ops (inputs validated by ``treeserve.kvcache.ops``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def store_kv_torch(
    k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """``cache[slot[i]] = k[i]`` (and v) for every token ``i``."""
    idx = slots.long()
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, idx, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, idx, v)


def compact_tree_path_torch(
    k_caches: Sequence[torch.Tensor], v_caches: Sequence[torch.Tensor], src_slots: torch.Tensor, dst_slots: torch.Tensor
) -> None:
    """Every layer: copy the rows at ``src_slots`` to ``dst_slots`` (all read before any write)."""
    src, dst = src_slots.long(), dst_slots.long()
    for kc, vc in zip(k_caches, v_caches, strict=True):
        for cache in (kc, vc):
            flat = cache.view(-1, *cache.shape[2:])
            flat.index_copy_(0, dst, flat.index_select(0, src))  # index_select copies first
