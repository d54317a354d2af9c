"""Where a test runs a kernel backend: chosen deliberately, never by accident.

A Triton test runs its kernel on CUDA tensors when CUDA is present, and on CPU tensors under the
interpreter otherwise (``conftest.py`` sets ``TRITON_INTERPRET=1`` only on machines without
CUDA). Triton on CPU tensors without the interpreter is never what a test means to check.
"""

from __future__ import annotations

import os

import torch


def backend_device(backend: str) -> torch.device:
    """The device a test of ``backend`` runs on: CUDA for ``triton`` / ``flashinfer`` where CUDA is
    present, else the CPU (for ``triton``, only under the interpreter)."""
    if backend in ("triton", "flashinfer") and torch.cuda.is_available():
        return torch.device("cuda")
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("a Triton test on a machine without CUDA needs TRITON_INTERPRET=1 (conftest.py)")
    return torch.device("cpu")
