"""Input checks shared by the KV ops and attention: fail early with the field name and range."""

from __future__ import annotations

import os

import torch

_INDEX_DTYPES = (torch.int32, torch.int64)


_debug_checks = os.environ.get("TREESERVE_DEBUG_CHECKS") == "1"


def debug_checks_enabled() -> bool:
    """Whether value checks that read the device on the host run (``TREESERVE_DEBUG_CHECKS=1``)."""
    return _debug_checks


def set_debug_checks(enabled: bool) -> bool:
    """Turn the host-reading value checks on or off; returns the previous setting."""
    global _debug_checks
    previous, _debug_checks = _debug_checks, bool(enabled)
    return previous


def _capturing(t: torch.Tensor) -> bool:
    # Value checks need a device->host sync, which is illegal while a CUDA graph is captured, and
    # under torch.compile would break the graph and specialize the code on the checked values.
    return torch.compiler.is_compiling() or (t.is_cuda and torch.cuda.is_current_stream_capturing())


def check_index_tensor(name: str, idx: torch.Tensor, ndim: int = 1) -> None:
    """``idx`` must be an int32/int64 tensor with ``ndim`` dims (TypeError / ValueError)."""
    if not isinstance(idx, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(idx).__name__}")
    if idx.dtype not in _INDEX_DTYPES:
        raise TypeError(f"{name} must be int32 or int64, got {idx.dtype}")
    if idx.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dim(s), got shape {tuple(idx.shape)}")


def check_range(name: str, idx: torch.Tensor, lo: int, hi: int) -> None:
    """Every value of ``idx`` must lie in ``[lo, hi)`` (skipped while capturing or compiling)."""
    if idx.numel() == 0 or _capturing(idx):
        return
    mn, mx = torch.aminmax(idx)
    mn_i, mx_i = int(mn), int(mx)
    if mn_i < lo or mx_i >= hi:
        raise ValueError(f"{name} must lie in [{lo}, {hi}), got values in [{mn_i}, {mx_i}]")


def check_distinct(name: str, idx: torch.Tensor, ignore_below: int = 0) -> None:
    """Values of ``idx`` that are ``>= ignore_below`` must be pairwise distinct (skipped while
    capturing or compiling)."""
    if idx.numel() == 0 or _capturing(idx):
        return
    if ignore_below:
        idx = idx[idx >= ignore_below]
    if torch.unique(idx).numel() != idx.numel():
        raise ValueError(f"{name} must be distinct, got a repeated value")


def check_cache_pair(k_cache: torch.Tensor, v_cache: torch.Tensor, name: str = "k_cache") -> None:
    """A layer's K and V caches: same 4-D shape ``[num_pages, page_size, H, D]``, dtype, device."""
    for label, t in ((name, k_cache), (name.replace("k_", "v_"), v_cache)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{label} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{label} must be [num_pages, page_size, num_kv_heads, head_dim], got {tuple(t.shape)}"
            )
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k/v cache shapes differ: {tuple(k_cache.shape)} vs {tuple(v_cache.shape)}")
    if k_cache.dtype != v_cache.dtype:
        raise TypeError(f"k/v cache dtypes differ: {k_cache.dtype} vs {v_cache.dtype}")
    if k_cache.device != v_cache.device:
        raise ValueError(f"k/v caches on different devices: {k_cache.device} vs {v_cache.device}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k/v caches must be contiguous")
