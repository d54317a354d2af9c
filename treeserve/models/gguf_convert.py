"""Tensors of other GGUF quantization types as the blocks the GGUF operator multiplies.

The C++ operator (``treeserve.models.gguf_op``) multiplies Q4_0, Q4_1 and Q8_0 blocks. The files
people run are mostly k-quant mixtures (llama.cpp's ``Q4_K_M``: Q4_K for most projections, Q6_K
for the output head and for ``attn_v`` / ``ffn_down`` in some layers), and llama.cpp's own Q4_0
files ship a Q6_K head. Loaded densely those tensors take 4 bytes a weight (an 8B Q4_K_M, 4.6 GiB,
would need ~30 GiB); converted at load they stay near their file size:

- **Q4_K -> Q4_1, repacked** (5.0 bits a weight, the file's 4.5): each 32-weight sub-block is
  ``w = (d sc) q - (dmin m)`` with 4-bit ``q``, which is Q4_1's ``w = d' q + m'`` with
  ``d' = f16(d sc)`` and ``m' = f16(-dmin m)``: the same codes, each scale rounded once to f16
  (a relative 2^-11 of the scale: |w' - w| <= 2^-11 (|d sc q| + |dmin m|), against the 4-bit
  code's step ``d sc``).
- **Q4_0 -> Q8_0** (where a fused group needs one type): ``d (q - 8)`` is Q8_0 with the same ``d``
  and codes ``q - 8``: exact.
- **Any other quantized type** (Q6_K, Q5_K, Q5_0, Q5_1, Q3_K, Q2_K, the IQ types, ...) **-> Q8_0,
  requantized** (8.5 bits a weight) from the tensor's exact float32 values (``gguf.quants``), as
  llama.cpp's ``quantize_row_q8_0`` rounds, but with the codes taken against the stored f16
  scale: ``d = f16(max|w_b| / 127)``, ``q = round(w / d)`` clipped to +-127, so |w' - w| <= d / 2
  (plus f16's rounding of ``d`` at the block's largest weight): about 1/250 of each block's
  largest weight; a Q6_K block's own step is 1/32 of it.

Plain float tensors (F32, F16, BF16) are not converted: they load dense, as before. A fused group
(q|k|v, gate|up) whose tensors end in different types takes Q8_0 for all of them
(:func:`as_blocks` with ``target="Q8_0"``). Conversion runs over chunks of rows (~1M weights of
float32 at a time, on every core of the process), so its peak memory is the result plus a few MB
per core.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import Q4_K, dequantize

from treeserve.models.gguf_file import GGUFTensor
from treeserve.models.gguf_op import BLOCK_BYTES, GROUP

__all__ = ["PLAIN_TYPES", "as_blocks", "converted_type", "q8_0_from_float", "q4_1_from_q4_k"]

PLAIN_TYPES = frozenset({"F32", "F16", "BF16", "F64", "I8", "I16", "I32", "I64"})
"""Element types that are not quantized: such tensors load dense, unconverted."""

_CHUNK_WEIGHTS = 1 << 20  # float32 weights per chunk of a requantization (4 MB)
_Q4_K_BYTES, _SUPER = 144, 256  # a Q4_K super-block: f16 d, f16 dmin, 12 B of 6-bit scales / mins, 128 B codes


def converted_type(qtype: str) -> str | None:
    """The block type the GGUF operator gets for a tensor of ``qtype`` (module docstring): itself
    for Q4_0 / Q4_1 / Q8_0, Q4_1 for Q4_K, Q8_0 for any other quantized type; None for a plain
    float or integer type (loaded dense) or a name ``gguf`` does not know."""
    if qtype in BLOCK_BYTES:
        return qtype
    if qtype in PLAIN_TYPES or qtype not in GGMLQuantizationType.__members__:
        return None
    return "Q4_1" if qtype == "Q4_K" else "Q8_0"


def as_blocks(t: GGUFTensor, shape: tuple[int, int], target: str | None = None) -> tuple[str, np.ndarray] | None:
    """``t`` (of ``shape = (N, K)`` in numpy order) as ``(qtype, rows)``: ``rows`` uint8
    ``[N, K/32 * BLOCK_BYTES[qtype]]`` for the GGUF operator. ``target`` None: the type
    :func:`converted_type` names (the file's own bytes, no copy, where that is ``t``'s type);
    ``target="Q8_0"``: Q8_0 whatever ``t``'s type (exact from Q8_0 and Q4_0, requantized from the
    others). None where ``t`` is not quantized or ``K`` is not a multiple of 32 (a Q4_K / Q6_K
    tensor's K is a multiple of 256)."""
    qtype = t.tensor_type.name
    out = target or converted_type(qtype)
    n, k = shape
    if out is None or converted_type(qtype) is None or k % GROUP or n * k != t.n_elements:
        return None
    raw = np.asarray(t.data).view(np.ndarray).view(np.uint8).reshape(n, -1)
    if out == qtype:
        return qtype, raw
    source = GGMLQuantizationType[qtype]

    def convert(part: np.ndarray) -> np.ndarray:
        if qtype == "Q4_K" and out == "Q4_1":
            return q4_1_from_q4_k(part, k)
        if qtype == "Q4_0" and out == "Q8_0":
            return _q8_0_from_q4_0(part, k)
        return q8_0_from_float(np.asarray(dequantize(part, source), np.float32).reshape(-1, k))

    result = np.empty((n, k // GROUP * BLOCK_BYTES[out]), dtype=np.uint8)
    _by_chunks(raw, result, convert, max(1, _CHUNK_WEIGHTS // k))
    return out, result


def _by_chunks(raw: np.ndarray, result: np.ndarray, convert: Callable[[np.ndarray], np.ndarray], rows: int) -> None:
    """``result[i:j] = convert(raw[i:j])`` over chunks of ``rows`` rows, on this process's cores (numpy's
    array operations release the GIL: ~1.8x on 2 cores)."""
    starts = range(0, raw.shape[0], rows)

    def one(start: int) -> None:
        result[start : start + rows] = convert(raw[start : start + rows])

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    workers = min(len(starts), cores)
    if workers <= 1:
        for start in starts:
            one(start)
        return
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(one, starts))


def q8_0_from_float(w: np.ndarray) -> np.ndarray:
    """Rows of float32 ``w [N, K]`` (``K`` a multiple of 32) as Q8_0 blocks ``[N, K/32 * 34]``:
    per block ``d = f16(max|w| / 127)``, codes ``round(w / d)`` (half away from zero, as llama.cpp
    rounds) clipped to +-127; an all-zero block gets ``d = 0`` and zero codes. ``ValueError`` on a
    non-finite weight (a corrupt file: the requantized block would hide it)."""
    n, k = w.shape
    if k % GROUP:
        raise ValueError(f"K must be a multiple of {GROUP}, got {k}")
    if not np.isfinite(w).all():
        raise ValueError("the tensor holds a non-finite weight: the file is corrupt")
    blocks = w.reshape(n, k // GROUP, GROUP)
    d = (np.abs(blocks).max(axis=-1) / 127.0).astype(np.float16)
    inv = np.divide(1.0, d.astype(np.float32), out=np.zeros(d.shape, dtype=np.float32), where=d != 0)
    scaled = blocks * inv[..., None]
    q = np.clip(np.trunc(scaled + np.copysign(np.float32(0.5), scaled)), -127, 127).astype(np.int8)
    out = np.empty((n, k // GROUP, 2 + GROUP), dtype=np.uint8)
    out[..., :2] = d.view(np.uint8).reshape(n, k // GROUP, 2)
    out[..., 2:] = q.view(np.uint8)
    return out.reshape(n, -1)


def _q8_0_from_q4_0(raw: np.ndarray, k: int) -> np.ndarray:
    """Q4_0 rows as Q8_0, exactly: the same f16 ``d``, codes ``q - 8`` (element ``j`` is byte
    ``j``'s low nibble, element ``j + 16`` its high one, in both layouts' element order)."""
    n = raw.shape[0]
    blocks = raw.reshape(n, k // GROUP, BLOCK_BYTES["Q4_0"])
    nibbles = blocks[..., 2:]
    out = np.empty((n, k // GROUP, 2 + GROUP), dtype=np.uint8)
    out[..., :2] = blocks[..., :2]
    codes = np.concatenate([nibbles & 15, nibbles >> 4], axis=-1).astype(np.int8) - np.int8(8)
    out[..., 2:] = codes.view(np.uint8)
    return out.reshape(n, -1)


def q4_1_from_q4_k(raw: np.ndarray, k: int) -> np.ndarray:
    """Q4_K rows ``[N, K/256 * 144]`` as Q4_1 rows ``[N, K/32 * 20]``: per 32-weight sub-block
    ``d' = f16(d sc)``, ``m' = f16(-dmin m)`` (``gguf``'s own unpacking of the 6-bit scales and
    mins) and the same 4-bit codes, repacked from Q4_K's order (sub-blocks ``2c`` / ``2c + 1``
    are the low / high nibbles of 32 bytes) to Q4_1's (element ``j`` in byte ``j``'s low nibble,
    ``j + 16`` in its high one)."""
    if k % _SUPER:
        raise ValueError(f"a Q4_K tensor's K must be a multiple of {_SUPER}, got {k}")
    n = raw.shape[0]
    sup = raw.reshape(-1, _Q4_K_BYTES)  # [S, 144], S = N K / 256
    d = sup[:, 0:2].copy().view(np.float16).astype(np.float32)  # [S, 1]
    dmin = sup[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, mn = Q4_K.get_scale_min(np.ascontiguousarray(sup[:, 4:16]))  # [S, 8] each
    out = np.empty((sup.shape[0], 8, BLOCK_BYTES["Q4_1"]), dtype=np.uint8)
    for at, scale in ((0, d * sc.astype(np.float32)), (2, -(dmin * mn.astype(np.float32)))):
        out[..., at : at + 2] = np.ascontiguousarray(scale, dtype=np.float16).view(np.uint8).reshape(-1, 8, 2)
    qs = sup[:, 16:].reshape(-1, 4, GROUP)  # [S, 4 chunks, 32 bytes]
    for half, codes in enumerate((qs & 15, qs >> 4)):  # sub-blocks 2c (low nibbles), 2c + 1 (high)
        out[:, half::2, 4:] = codes[..., :16] | (codes[..., 16:] << 4)
    return out.reshape(n, -1)
