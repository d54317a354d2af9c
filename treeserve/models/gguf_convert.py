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
- **Q5_0 -> Q8_0**, and Q4_0 where a fused group needs one type: ``d (q - 16)`` (``d (q - 8)``) is
  Q8_0 with the same ``d`` and codes ``q - 16`` (``q - 8``): exact. llama.cpp falls back to Q5_0
  in its k-quant mixtures for rows whose width is not a multiple of 256 (SmolLM2's 576).
- **Any other quantized type** (Q6_K, Q5_K, Q5_1, Q3_K, Q2_K, the IQ types, ...) **-> Q8_0,
  requantized** (8.5 bits a weight) from the tensor's float32 values (as ``gguf.quants`` decodes
  them), as llama.cpp's Q8_0 quantizer does but with the codes taken against the stored f16 scale:
  ``d = f16(max|w_b| / 127)``, ``q = round(w / d)`` (ties to even) clipped to +-127, so |w' - w| <= d / 2
  (plus f16's rounding of ``d`` at the block's largest weight): about 1/250 of each block's
  largest weight; a Q6_K block's own step is 1/32 of it.

Plain float tensors (F32, F16, BF16) are not converted: they load dense, as before. A fused group
(q|k|v, gate|up) whose tensors end in different types takes Q8_0 for all of them
(:func:`as_blocks` with ``target="Q8_0"``). The C++ operator ``treeserve::gguf_convert``
(``csrc/gguf_convert.cpp``, parallel over rows) repacks Q4_K and decodes Q4_K / Q5_K / Q6_K itself;
other types are decoded by ``gguf.quants`` a chunk of rows at a time (~1M weights) before the
operator requantizes them, so the peak memory is the result plus a few MB. Without the operator
(no compiler) those tensors load dense, as before.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from treeserve._cpp import cpp_op_loader, load_cpp_op
from treeserve.models.gguf_file import GGUFTensor
from treeserve.models.gguf_op import BLOCK_BYTES, GROUP, shared_tensor

__all__ = ["PLAIN_TYPES", "as_blocks", "convert_op_available", "converted_type", "load_gguf_convert_op"]

PLAIN_TYPES = frozenset({"F32", "F16", "BF16", "F64", "I8", "I16", "I32", "I64"})
"""Element types that are not quantized: such tensors load dense, unconverted."""

SOURCE = Path(__file__).with_name("csrc") / "gguf_convert.cpp"
_NATIVE = ("Q4_K", "Q5_K", "Q6_K")  # decoded by the operator itself; other types by gguf.quants first
_EXACT_Q8_0 = ("Q4_0", "Q5_0")  # d (q - bias) types that are Q8_0 exactly
_CHUNK_WEIGHTS = 1 << 20  # weights per chunk of the types gguf.quants decodes (4 MB of float32)


@cpp_op_loader
def load_gguf_convert_op() -> str | None:
    """Build (first time on this host) and load ``treeserve::gguf_convert``; ``None`` when usable,
    else the reason (logged once; tensors of other types then load dense, as before)."""
    return load_cpp_op(SOURCE, "gguf_convert", "C++ GGUF type conversion")


def convert_op_available() -> bool:
    """Whether ``treeserve::gguf_convert`` is built and loaded."""
    return load_gguf_convert_op() is None


def converted_type(qtype: str) -> str | None:
    """The block type the GGUF operator gets for a tensor of ``qtype`` (module docstring): itself
    for Q4_0 / Q4_1 / Q8_0, Q4_1 for Q4_K, Q8_0 for any other quantized type; None for a plain
    float or integer type (loaded dense) or a name ``gguf`` does not know."""
    if qtype in BLOCK_BYTES:
        return qtype
    if qtype in PLAIN_TYPES or qtype not in GGMLQuantizationType.__members__:
        return None
    return "Q4_1" if qtype == "Q4_K" else "Q8_0"


def as_blocks(t: GGUFTensor, shape: tuple[int, int], target: str | None = None,
              into: torch.Tensor | None = None) -> tuple[str, np.ndarray] | None:
    """``t`` (of ``shape = (N, K)`` in numpy order) as ``(qtype, rows)``: ``rows`` uint8
    ``[N, K/32 * BLOCK_BYTES[qtype]]`` for the GGUF operator. ``target`` None: the type
    :func:`converted_type` names (the file's own bytes, no copy, where that is ``t``'s type);
    ``target="Q8_0"``: Q8_0 whatever ``t``'s type (exact from Q8_0, Q4_0 and Q5_0, requantized from
    the others). ``into``: a contiguous uint8 tensor of that shape (a fused buffer's rows) the rows are
    written to (``rows`` is then its numpy view); else a converted tensor gets a buffer of its own.
    None where ``t`` is not quantized, ``K`` is not a multiple of 32 (a k-quant tensor's K is a
    multiple of 256), or a conversion is needed and ``treeserve::gguf_convert`` is not built."""
    qtype = t.tensor_type.name
    out = target or converted_type(qtype)
    n, k = shape
    if out is None or converted_type(qtype) is None or k % GROUP or n * k != t.n_elements:
        return None
    raw = np.asarray(t.data).view(np.ndarray).view(np.uint8).reshape(n, -1)
    if out != qtype and qtype not in _EXACT_Q8_0 and not convert_op_available():
        return None
    if out == qtype and into is None:
        return qtype, raw
    width = k // GROUP * BLOCK_BYTES[out]
    dst = into if into is not None else torch.empty(n, width, dtype=torch.uint8)
    if tuple(dst.shape) != (n, width) or dst.dtype != torch.uint8 or not dst.is_contiguous():
        raise ValueError(f"into must be a contiguous uint8 [{n}, {width}], got {dst.dtype} {list(dst.shape)}")
    if out == qtype:
        dst.numpy()[:] = raw
    elif qtype in _EXACT_Q8_0:
        _q8_0_exact(raw, qtype, k, dst.numpy())
    elif qtype in _NATIVE:
        _convert(raw, qtype, k, out, dst)
    else:
        rows = max(1, _CHUNK_WEIGHTS // k)
        source = GGMLQuantizationType[qtype]
        for start in range(0, n, rows):
            part = np.asarray(dequantize(raw[start : start + rows], source), np.float32).reshape(-1, k)
            _convert(part, "F32", k, "Q8_0", dst[start : start + rows])
    return out, dst.numpy()


def _convert(src: np.ndarray, qtype: str, k: int, out: str, dst: torch.Tensor) -> None:
    """``treeserve::gguf_convert`` of ``src`` (a read-only map of the file is read, never written) into
    ``dst``."""
    torch.ops.treeserve.gguf_convert(shared_tensor(src), qtype, k, out, dst)


def _q8_0_exact(raw: np.ndarray, qtype: str, k: int, dst: np.ndarray) -> None:
    """Q4_0 or Q5_0 rows written into ``dst`` as Q8_0, exactly: the same f16 ``d``, codes ``q - 8`` /
    ``q - 16``. Element ``j < 16`` is byte ``j``'s low nibble, ``j + 16`` its high one, in both
    layouts' order; Q5_0's fifth bit of element ``i`` is bit ``i`` of the little-endian 32-bit word
    after ``d``."""
    n, width = raw.shape[0], GGML_QUANT_SIZES[GGMLQuantizationType[qtype]][1]
    blocks = raw.reshape(n, k // GROUP, width)
    nibbles = blocks[..., width - 16 :]
    codes = np.concatenate([nibbles & 15, nibbles >> 4], axis=-1)
    if qtype == "Q5_0":
        high = blocks[..., 2:6].copy().view("<u4") >> np.arange(GROUP, dtype=np.uint32)
        codes |= ((high & 1) << 4).astype(np.uint8)
    out = dst.reshape(n, k // GROUP, 2 + GROUP)
    out[..., :2] = blocks[..., :2]
    out[..., 2:] = (codes.astype(np.int8) - np.int8(8 if qtype == "Q4_0" else 16)).view(np.uint8)
