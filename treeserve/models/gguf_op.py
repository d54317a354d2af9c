"""GGUF blocks as shipped and the C++ operator ``treeserve::gguf_linear`` that multiplies by them.

``GGUFWeight`` holds a weight ``[N, K]`` as the file's bytes, one row of ``K/32`` blocks per output
row (Q4_0: 18 B, Q4_1: 20 B, Q8_0: 34 B per 32 weights, f16 scales). ``gguf_linear(x, w, exact)``
computes ``x @ dequant(w).T`` with float32 accumulation (AVX2/FMA/F16C where the build host has
them, a scalar loop otherwise), in one of two activation modes, one C++ operator each:

- ``exact=True``, ``treeserve::gguf_linear_exact``: float32 activations; equal to the float32
  product up to summation order (the LM head's first pass);
- ``exact=False``, ``treeserve::gguf_linear`` (the quantized decoder layers' path, ~3x fewer
  instructions per weight than float activations): each
  32-block of each row of ``x`` is rounded once per call to int16, ``x ~ s_b q``, ``s_b = max|x_b| /
  32767``; integer dot products per block, one float32 scale ``d s_b`` per block. Error bound per
  output: ``sum_b 0.51 s_b sum_{j in b} |d q_j|`` plus float32 summation error, i.e. about 2^-16 of
  each block's largest activation (bfloat16 activations: 2^-9 of each activation).

A third operator, ``treeserve::gguf_linear_q8``, rounds each 32-block of ``x`` to int8 instead
(``s_b = max|x_b| / 127``, llama.cpp's Q8_0 activations: about 2^-8 of each block's largest
activation) for the large batches of a model whose codes serve every batch (``quant.use_q8_large``);
``q8_lanes`` says whether it runs its vector kernel here (the rows of ``x`` in the lanes of
``vpdpbusd`` with AVX-512 VNNI or AVX-VNNI, of ``vpmaddubsw`` with AVX2 alone).

Without a compiler the same product runs through torch (``dequantize`` then ``F.linear``, float32
activations in both modes).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from treeserve._cpp import cpp_op_loader, cpu_flags, load_cpp_op

__all__ = ["BLOCK_BYTES", "GROUP", "GGUFWeight", "gguf_linear", "gguf_op_available", "load_gguf_linear_op", "q8_lanes",
           "shared_tensor"]

GROUP = 32
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
SOURCE = Path(__file__).with_name("csrc") / "gguf_linear.cpp"
def shared_tensor(a: np.ndarray) -> torch.Tensor:
    """``a`` as a tensor sharing its memory, no copy, whether or not it is writable (a read-only map of
    a file: the caller never writes through the tensor; torch's warning about it is silenced)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(a)


class GGUFWeight(NamedTuple):
    """A weight ``[N, K]`` as GGUF blocks: ``raw`` uint8 ``[N, K/32 * BLOCK_BYTES[qtype]]``."""

    qtype: str
    raw: torch.Tensor
    in_features: int

    @staticmethod
    def from_bytes(qtype: str, raw: np.ndarray | torch.Tensor, shape: tuple[int, int]) -> GGUFWeight:
        """Check and view ``raw`` (the tensor's bytes) as rows; ``ValueError`` naming the bad field."""
        if qtype not in BLOCK_BYTES:
            raise ValueError(f"qtype must be one of {sorted(BLOCK_BYTES)}, got {qtype!r}")
        n, k = shape
        if k <= 0 or k % GROUP:
            raise ValueError(f"K (shape[1]) must be a positive multiple of {GROUP}, got shape {shape}")
        data = raw if isinstance(raw, torch.Tensor) else shared_tensor(np.ascontiguousarray(raw).view(np.uint8))
        if data.dtype != torch.uint8:
            raise TypeError(f"raw must hold uint8 bytes, got {data.dtype}")
        width = k // GROUP * BLOCK_BYTES[qtype]
        if data.numel() != n * width:
            raise ValueError(f"raw: {qtype} weight of shape {shape} needs {n * width} bytes, got {data.numel()}")
        return GGUFWeight(qtype, data.reshape(n, width).contiguous(), k)

    @property
    def shape(self) -> tuple[int, int]:
        """``(N, K)``."""
        return self.raw.shape[0], self.in_features

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight ``[N, K]`` in ``dtype``: float32 blocks, bitwise ``gguf.quants``' values, then
        cast. Through the C++ operator ``treeserve::gguf_dequantize`` where it is built (one pass,
        parallel over rows: ~20x the torch path), else ``dequantize_blocks`` on rows in chunks of
        ~1M weights, so the temporaries stay a few MB whatever the size."""
        n, k = self.shape
        if gguf_op_available():
            out = torch.ops.treeserve.gguf_dequantize(self.raw, self.qtype, k)
            return out if dtype == torch.float32 else out.to(dtype)
        out = torch.empty(n, k, dtype=dtype)
        step = max(1, _CHUNK_WEIGHTS // k)
        for start in range(0, n, step):
            out[start : start + step] = dequantize_blocks(self.qtype, self.raw[start : start + step], k)
        return out

    def dequantize_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows ``rows`` (int, any shape ``S``) of the weight as float32 ``[*S, K]``: only those rows'
        blocks are read (an embedding lookup from the codes)."""
        return dequantize_blocks(self.qtype, self.raw[rows.reshape(-1)], self.in_features).reshape(*rows.shape, -1)

    def permute_rows(self, perm: torch.Tensor) -> GGUFWeight:
        """The weight with its rows reordered (``perm``: new row i is old row ``perm[i]``)."""
        return GGUFWeight(self.qtype, self.raw[perm].contiguous(), self.in_features)


_CHUNK_WEIGHTS = 1 << 20


def dequantize_blocks(qtype: str, raw: torch.Tensor, k: int) -> torch.Tensor:
    """Rows of GGUF blocks (``raw`` uint8 ``[M, K/32 * BLOCK_BYTES[qtype]]``) as float32 ``[M, K]``, in
    torch: the arithmetic of ``gguf.quants`` (llama.cpp's reference), one float32 rounding per
    operation (Q4_0 ``d * (q - 8)``, Q4_1 ``d * q + m`` as a product then a sum, Q8_0 ``q * d``), so
    the values are bitwise those of ``gguf.quants.dequantize`` (tested), ~10x faster."""
    m = raw.shape[0]
    blocks = raw.reshape(m, k // GROUP, BLOCK_BYTES[qtype])
    d = blocks[..., :2].contiguous().view(torch.float16).float()  # [M, nb, 1]
    if qtype == "Q8_0":
        return (blocks[..., 2:].contiguous().view(torch.int8).float() * d).reshape(m, k)
    qs = blocks[..., -16:]  # byte j: element j (low nibble), j + 16 (high nibble)
    q = torch.cat([qs & 15, qs >> 4], -1)
    if qtype == "Q4_0":
        return (d * (q.to(torch.int8) - 8).float()).reshape(m, k)
    mins = blocks[..., 2:4].contiguous().view(torch.float16).float()
    return (d * q.float() + mins).reshape(m, k)


def _fake(x, w, qtype, k):  # type: ignore[no-untyped-def]
    """Output shape and dtype for tracing (``torch.compile``): ``[M, N]`` in ``x``'s dtype."""
    return x.new_empty((x.shape[0], w.shape[0]))


def _dequantize_fake(w, qtype, k):  # type: ignore[no-untyped-def]
    """Output shape and dtype for tracing: float32 ``[N, K]``."""
    return w.new_empty((w.shape[0], k), dtype=torch.float32)


@cpp_op_loader
def load_gguf_linear_op() -> str | None:
    """Build (first time on this host) and load the operator; ``None`` when usable, else the reason
    (logged once; ``gguf_linear`` then runs the torch path)."""
    for op, what, fake in (("gguf_linear", "C++ GGUF linear", _fake),
                           ("gguf_linear_exact", "C++ GGUF linear (float32 activations)", _fake),
                           ("gguf_dequantize", "C++ GGUF dequantization", _dequantize_fake),
                           ("gguf_linear_q8", "C++ GGUF linear (int8 activations)", _fake),
                           ("codes_row_norms", "C++ row norms of GGUF codes", None),  # eager only
                           ("codes_head_rescore", "C++ re-scoring of a head kept as codes", None)):  # eager only
        reason = load_cpp_op(SOURCE, op, what, fake)
        if reason is not None:
            return reason
    return None

def q8_lanes() -> bool:
    """Whether ``treeserve::gguf_linear_q8`` runs its vector kernel here (the rows of ``x`` in the lanes
    of a register: ``vpdpbusd`` with AVX-512 VNNI, BW and VL or AVX-VNNI, ``vpmaddubsw`` with AVX2
    alone): the operator is built (``-march=native``) and the host has AVX2. Elsewhere it is a scalar
    loop, correct but never faster than ``gguf_linear``: not worth measuring."""
    return gguf_op_available() and "avx2" in cpu_flags().split()


def gguf_op_available() -> bool:
    """Whether ``treeserve::gguf_linear`` is built and loaded."""
    return load_gguf_linear_op() is None


def gguf_linear(x: torch.Tensor, w: GGUFWeight, exact: bool = True) -> torch.Tensor:
    """``x [M, K] @ dequant(w).T`` as float32 ``[M, N]``; ``x`` must be a float32 CPU tensor.
    ``exact=False`` rounds ``x`` to int16 per 32-block (module docstring) when the operator is built.

    ``TypeError`` / ``ValueError`` name the bad argument."""
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32:
        raise TypeError(f"x must be a float32 tensor, got {getattr(x, 'dtype', type(x))}")
    if x.dim() != 2 or x.shape[1] != w.in_features:
        raise ValueError(f"x must have shape [M, {w.in_features}], got {tuple(x.shape)}")
    if gguf_op_available():
        op = torch.ops.treeserve.gguf_linear_exact if exact else torch.ops.treeserve.gguf_linear
        return op(x, w.raw, w.qtype, w.in_features)
    return F.linear(x, w.dequantize())
