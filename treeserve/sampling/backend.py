"""Kernel backend choice for sampling and verification: ``auto`` | ``torch`` | ``triton``."""

from __future__ import annotations

import torch

from treeserve._utils import cuda_ok, log_once, triton_usable

BACKENDS = ("auto", "torch", "triton")


def resolve_backend(backend: str, device: torch.device) -> str:
    """``auto`` -> triton on CUDA (sync-free, graph-capturable), torch elsewhere (fast on CPU).

    Raises ``ValueError`` for an unknown name, or for triton where it cannot run (CPU without
    ``TRITON_INTERPRET=1``). The choice for ``auto`` is logged once.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        backend = "triton" if cuda_ok(device) else "torch"
        log_once(f"treeserve.sampling: backend=auto -> {backend} on {device.type}")
    if backend == "triton" and not triton_usable(device):
        raise ValueError("backend='triton' needs a CUDA device or TRITON_INTERPRET=1")
    return backend
