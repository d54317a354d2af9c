"""Small utilities shared by every subpackage (the only treeserve import kvcache/sampling may use)."""

from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger("treeserve")

_logged_once: set[str] = set()


def log_once(msg: str) -> None:
    """Log ``msg`` at INFO level the first time it is seen in this process."""
    if msg not in _logged_once:
        _logged_once.add(msg)
        log.info(msg)


def cuda_ok(device: torch.device | str | None = None) -> bool:
    """True when ``device`` (or the default) is a usable CUDA device."""
    if device is not None and torch.device(device).type != "cuda":
        return False
    return torch.cuda.is_available()


def interpreting() -> bool:
    """Triton kernels run under its CPU interpreter (``TRITON_INTERPRET=1``) in this process."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_usable(device: torch.device | str) -> bool:
    """Triton kernels run on CUDA, or on CPU tensors under ``TRITON_INTERPRET=1``."""
    return torch.device(device).type == "cuda" or interpreting()


def flashinfer_available() -> bool:
    try:
        import flashinfer  # noqa: F401
    except Exception:
        return False
    return torch.cuda.is_available()
