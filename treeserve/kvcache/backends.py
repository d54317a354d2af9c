"""Backend selection shared by the KV ops and the attention dispatcher."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

import torch

from treeserve._utils import flashinfer_available, log_once, triton_usable

Backend = Literal["auto", "torch", "triton", "flashinfer"]

_graph_safe_depth = 0


@contextmanager
def graph_safe_backends() -> Iterator[None]:
    """Within this block ``auto`` skips FlashInfer, whose planning reads the metadata on the host.

    Used around CUDA-graph warm-up and capture (``treeserve.runner.graph``), so that the kernels
    warmed up are the ones captured, and nothing syncs with the host during capture.
    """
    global _graph_safe_depth
    _graph_safe_depth += 1
    try:
        yield
    finally:
        _graph_safe_depth -= 1


def resolve_backend(
    family: str, backend: str, device: torch.device, allowed: tuple[str, ...]
) -> str:
    """Turn ``backend`` into a concrete implementation name for ``family`` on ``device``.

    ``auto`` picks flashinfer (when listed in ``allowed`` and installed) > triton on CUDA, and
    torch elsewhere; the automatic choice is logged once per (family, device type). An explicit
    name must be in ``allowed`` and runnable on ``device`` (triton needs CUDA or
    ``TRITON_INTERPRET=1``; flashinfer needs CUDA), otherwise ``ValueError``.
    """
    if backend == "auto":
        if device.type == "cuda":
            use_fi = "flashinfer" in allowed and not _graph_safe_depth and flashinfer_available()
            chosen = "flashinfer" if use_fi else "triton"
        else:
            chosen = "torch"
        log_once(f"treeserve.kvcache.{family}: backend={chosen} on {device.type}")
        return chosen
    if backend not in allowed:
        raise ValueError(f"backend must be 'auto' or one of {allowed}, got {backend!r}")
    if backend == "triton" and not triton_usable(device):
        raise ValueError(
            f"backend='triton' needs a CUDA tensor or TRITON_INTERPRET=1 (tensors are on {device})"
        )
    if backend == "flashinfer" and (device.type != "cuda" or not flashinfer_available()):
        raise ValueError(f"backend='flashinfer' needs CUDA and the flashinfer package (device {device})")
    return backend
