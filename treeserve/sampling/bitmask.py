"""Token bitmasks: which tokens a row may take next, packed 32 per int32 word.

Layout (xgrammar's): token ``t`` is allowed iff bit ``t % 32`` of word ``t // 32`` is set;
``-1`` (all bits) allows all 32 tokens of a word. A batch's mask is ``[R, bitmask_words(V)]``
int32; an unconstrained row is all ``-1``. No host sync: a host mask is unpacked by numpy (one pass over
bytes, ~30x torch's shift-and-test at 64 x 49152 on the AVX2 EPYC), a device mask by torch ops.
The sampling path applies a batch mask in place (:func:`apply_token_bitmask_`): on CPU the C++
operator ``torch.ops.treeserve.apply_token_bitmask_`` (``csrc/token_bitmask.cpp``: a word at a
time, rows in parallel; built on first use like every treeserve operator), without a compiler one
numpy unpack plus a masked ``copyto`` of -inf (both faster than xgrammar's CPU kernel, itself 2-3x
``torch.where``: benches/RESULTS.md, issue 31); elsewhere xgrammar's kernel (CUDA).
:func:`apply_token_bitmask` is the out-of-place reference.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from treeserve._cpp import cpp_op_loader, load_cpp_op

__all__ = [
    "apply_token_bitmask", "apply_token_bitmask_", "bitmask_words", "load_bitmask_op", "stack_bitmasks",
    "unpack_bitmask", "unpack_bitmask_torch",
]  # fmt: skip

SOURCE = Path(__file__).with_name("csrc") / "token_bitmask.cpp"


@cpp_op_loader
def load_bitmask_op() -> str | None:
    """Build (first time on this host) and load the CPU operator; ``None`` when it is available,
    else the reason it is not (logged once; :func:`apply_token_bitmask_` then uses numpy)."""
    return load_cpp_op(SOURCE, "apply_token_bitmask_", "C++ CPU token-bitmask apply")


def bitmask_words(vocab_size: int) -> int:
    """int32 words per row for a ``vocab_size`` vocabulary."""
    return -(-vocab_size // 32)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``bool [R, vocab_size]``: True where ``bitmask [R, W]`` (int32) allows the token."""
    if bitmask.dim() != 2 or bitmask.dtype != torch.int32 or bitmask.shape[1] != bitmask_words(vocab_size):
        raise ValueError(
            f"bitmask must be int32 [rows, {bitmask_words(vocab_size)}], got {bitmask.dtype} {tuple(bitmask.shape)}"
        )
    if bitmask.device.type == "cpu":  # little-endian int32: byte k of a word holds bits 8k..8k+7
        bits = np.unpackbits(bitmask.contiguous().numpy().view(np.uint8), axis=1, bitorder="little")
        return torch.from_numpy(bits.view(np.bool_))[:, :vocab_size]
    return unpack_bitmask_torch(bitmask, vocab_size)


def unpack_bitmask_torch(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``unpack_bitmask`` with torch ops only (any device; what non-CPU masks take)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask[:, :, None] >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_token_bitmask(x: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """``x [R, V]`` with every token ``bitmask`` disallows set to -inf (a new tensor)."""
    return torch.where(unpack_bitmask(bitmask, x.shape[1]), x, float("-inf"))


def apply_token_bitmask_(x: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Set every token ``bitmask [R, W]`` disallows to -inf in ``x [R, V]`` (float32 or bf16,
    contiguous), in place; returns ``x``. The same values as :func:`apply_token_bitmask`;
    ``ValueError`` for a mask of the wrong shape or dtype."""
    vocab = x.shape[1]
    if bitmask.dim() != 2 or bitmask.dtype != torch.int32 or bitmask.shape != (x.shape[0], bitmask_words(vocab)):
        raise ValueError(
            f"bitmask must be int32 [{x.shape[0]}, {bitmask_words(vocab)}], got {bitmask.dtype} {tuple(bitmask.shape)}"
        )
    if not x.is_contiguous() or x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"x must be a contiguous float32 or bfloat16 tensor, got {x.dtype}")
    if x.device.type == "cpu":
        if load_bitmask_op() is None:
            return torch.ops.treeserve.apply_token_bitmask_(x, bitmask.cpu())
        return apply_token_bitmask_numpy_(x, bitmask.cpu())
    import xgrammar as xgr  # imported with the first grammar (sampling.grammar) anyway

    xgr.apply_token_bitmask_inplace(x, bitmask.to(x.device), vocab_size=vocab)
    return x


def apply_token_bitmask_numpy_(x: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """:func:`apply_token_bitmask_`'s path on a CPU without the operator (no compiler): one numpy
    unpack and a masked ``copyto`` of -inf. Arguments as checked there (CPU tensors)."""
    banned = ~unpack_bitmask(bitmask, x.shape[1]).numpy()
    if x.dtype == torch.float32:
        np.copyto(x.numpy(), np.float32(-np.inf), where=banned)
    else:  # numpy has no bfloat16: write -inf's bit pattern (0xFF80) through an int16 view
        np.copyto(x.view(torch.int16).numpy(), np.int16(-128), where=banned)
    return x


def stack_bitmasks(rows: Sequence[torch.Tensor | None], vocab_size: int, device: torch.device | str) -> torch.Tensor | None:
    """The batch mask ``[len(rows), W]`` on ``device`` from per-row host masks (``None``: the row is
    unconstrained, all ``-1``); ``None`` when no row is constrained."""
    if all(r is None for r in rows):
        return None
    out = torch.full((len(rows), bitmask_words(vocab_size)), -1, dtype=torch.int32)
    for i, r in enumerate(rows):
        if r is not None:
            out[i] = r
    return out.to(device, non_blocking=True)
