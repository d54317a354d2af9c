"""Residual add + RMSNorm in one pass (``torch.ops.treeserve.add_rms_norm``, ``csrc/rmsnorm.cpp``).

``add_rms_norm(x, residual, weight, eps)`` returns ``(s, y)``: ``s = x + residual`` (``x`` itself
when ``residual`` is None) and ``y = rms_norm(s) * weight`` (statistics and products in float32,
one rounding to bfloat16, as torch's fused CPU ``F.rms_norm``). On CPU float32/bfloat16 tensors the C++
operator does it in one visit of each row (AVX2 on hosts that have it); everywhere else (other
devices, dtypes, under ``torch.compile``, or without a compiler) torch's add and ``F.rms_norm``
serve. Built on first use with ``treeserve._cpp`` (cached per host).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from treeserve._cpp import cpp_op_loader, load_cpp_op

__all__ = ["SOURCE", "add_rms_norm", "add_rms_norm_torch", "load_norm_op"]

SOURCE = Path(__file__).with_name("csrc") / "rmsnorm.cpp"
DTYPES = (torch.float32, torch.bfloat16)


@cpp_op_loader
def load_norm_op() -> str | None:
    """Build (first time on this host) and load the operator; ``None`` when it is available,
    else the reason it is not (logged once; the torch path then serves)."""
    return load_cpp_op(SOURCE, "add_rms_norm", "C++ CPU residual-add + RMSNorm")


def add_rms_norm_torch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference: ``s = x + residual``, ``F.rms_norm(s)`` (the fallback path)."""
    s = x if residual is None else x + residual
    return s, F.rms_norm(s, weight.shape, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x + residual, rms_norm(x + residual) * weight)`` over the last dimension (see module)."""
    if (
        x.device.type == "cpu"
        and x.dtype in DTYPES
        and weight.dtype == x.dtype
        and not torch.compiler.is_compiling()
        and load_norm_op() is None
    ):
        return torch.ops.treeserve.add_rms_norm(x, residual, weight, eps)
    return add_rms_norm_torch(x, residual, weight, eps)
