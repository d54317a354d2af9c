"""Int8 GEMMs for many rows (prefill, batched decode): ``treeserve::int8_linear`` over oneDNN.

Both operands are rotated by one orthogonal ``R`` (``x W^T = (x R)(W R)^T``): 64 x 64
Walsh-Hadamard blocks scaled by 1/8, then a fixed random orthogonal ``B x B`` matrix across the
``B = K/64`` blocks (``mixer``). It spreads the few large activation channels of LLM hidden states
over the whole row before rounding. ``Int8Weight.from_dense(w)`` rounds ``W R`` once to
per-output-channel symmetric 8-bit codes (``scale_n = max|(W R)_n| / 127``) and prepacks them for
oneDNN (``onednn::qlinear_prepack``). ``int8_linear(x, w)`` rotates each row of ``x`` and rounds it
to symmetric codes (``s_m = max|(x R)_m| / x_max()``), multiplies in integers (exact int32
accumulation in oneDNN's kernel) and scales back: a row's output depends only on that row, never
on the rest of the batch. Error per output ``y_mn``: at most ``0.5 s_m |(W R)_n|_1 + 0.5 scale_n
|(x R)_m|_1`` plus float32 rounding. Activations get 8 bits (``x_max() == 127``) where oneDNN
multiplies with VNNI, which adds u8 x s8 products straight into int32, and 7 bits (63) elsewhere:
there the int8 multiply adds pairs of products into a saturating int16, and ``2 * 127 * 127 <
2^15`` keeps it exact (the operator decides: ``csrc/int8_linear.cpp``).

Measured on SmolLM2-135M (Q4_1 GGUF, 1,500 tokens of this repository's docs, 7-bit activations):
perplexity +0.1% over the float32 product of the same weights (the Hadamard blocks alone: +1.0%,
no rotation: +4.8%), where llama.cpp's per-32-block int8 activations give +0.4% and the int16 path
of ``gguf_op`` +0.003%; a projection at 24-512 rows runs 1.1-2.3x faster than the float32 GEMM
(benches/RESULTS.md). Scoring 1,023 tokens of the README in 256-token prefill chunks, every
projection on this path (2026-12-07, Zen 4): +1.71% over the dense weights with 7-bit activations,
+0.71% with 8 bits.

CPU only; ``K`` a multiple of 64. ``int8_available()`` says whether oneDNN's quantized linear
exists in this torch build and the operator builds; otherwise callers keep their dense path.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

import torch

from treeserve._cpp import cpp_op_loader, load_cpp_op

__all__ = ["BLOCK", "W_MAX", "Int8Weight", "int8_available", "int8_linear", "int8_swiglu_linear", "mixer",
           "rotate", "round_rotated", "x_max"]

SOURCE = Path(__file__).with_name("csrc") / "int8_linear.cpp"
W_MAX = 127
"""Largest weight code magnitude."""
BLOCK = 64
"""Walsh-Hadamard block of the rotation (``in_features`` must be a multiple)."""


def _hadamard() -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < BLOCK:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / 8.0


@lru_cache(maxsize=None)
def mixer(blocks: int) -> torch.Tensor:
    """The ``[blocks, blocks]`` float32 orthogonal matrix mixing the Hadamard blocks (fixed seed)."""
    gen = torch.Generator().manual_seed(0)
    q, _ = torch.linalg.qr(torch.randn(blocks, blocks, generator=gen, dtype=torch.float64))
    return q.float().contiguous()


def rotate(t: torch.Tensor) -> torch.Tensor:
    """``t R`` (the rotation of the module docstring) over the last dimension, a multiple of 64, in float32."""
    shape = t.shape
    nb = shape[-1] // BLOCK
    blocks = t.float().reshape(*shape[:-1], nb, BLOCK) @ _hadamard()
    return (mixer(nb) @ blocks).reshape(shape)


def _fake(x, w, w_scales, w_zeros, mix):  # type: ignore[no-untyped-def]
    """Output shape and dtype for tracing: ``[M, N]`` float32."""
    return x.new_empty((x.shape[0], w_scales.shape[0]))


@cpp_op_loader
def int8_available() -> bool:
    """Whether ``treeserve::int8_linear`` can run here (oneDNN quantized linear in torch, operator built)."""
    if not torch.backends.mkldnn.is_available():
        return False
    onednn = torch.ops.onednn
    if not (hasattr(onednn, "qlinear_pointwise") and hasattr(onednn, "qlinear_prepack")):
        return False
    if load_cpp_op(SOURCE, "int8_linear", "C++ int8 linear (oneDNN)", _fake) is not None:
        return False
    torch.library.register_fake("treeserve::int8_swiglu_linear")(_fake)  # same library, same output shape
    return True


def x_max() -> int:
    """Largest activation code magnitude of this host's operator: 127 (8 bits) where oneDNN's
    product is VNNI's, else 63 (see the module docstring). Needs ``int8_available()``."""
    return int(torch.ops.treeserve.int8_activation_max())


def round_rotated(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scales)`` of ``weight [N, K]``: ``W R`` rounded per row to int8 codes in ``[-W_MAX, W_MAX]``
    (``scale_n = max|(W R)_n| / W_MAX``, 1 for a zero row), float32 scales ``[N]``; what
    ``Int8Weight.from_dense`` prepacks."""
    w = rotate(weight.detach())
    amax = w.abs().amax(dim=1)
    scales = torch.where(amax > 0, amax / W_MAX, torch.ones_like(amax))
    codes = torch.round(w / scales[:, None]).clamp_(-W_MAX, W_MAX).to(torch.int8)
    return codes, scales


class Int8Weight(NamedTuple):
    """A weight ``[N, K]`` as oneDNN-prepacked int8 codes with float32 scales ``[N]``."""

    packed: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    mix: torch.Tensor
    in_features: int

    @property
    def operands(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(packed, scales, zeros, mix)``: the weight's operands, in the order the C++ operators
        (``int8_linear``, ``decode_layers``) take them."""
        return self.packed, self.scales, self.zeros, self.mix

    @staticmethod
    def from_dense(weight: torch.Tensor) -> Int8Weight:
        """Rotate ``weight`` (a floating ``[N, K]`` CPU tensor) and round it to codes in ``[-W_MAX, W_MAX]`` per row;
        ``ValueError`` / ``TypeError`` name the bad argument."""
        if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
            raise TypeError(f"weight must be a floating tensor, got {getattr(weight, 'dtype', type(weight))}")
        if weight.dim() != 2 or weight.device.type != "cpu" or 0 in weight.shape or weight.shape[1] % BLOCK:
            raise ValueError(f"weight must be a non-empty 2-D CPU tensor with a multiple of {BLOCK} columns, "
                             f"got {tuple(weight.shape)} on {weight.device}")
        return Int8Weight.from_codes(*round_rotated(weight))

    @staticmethod
    def from_codes(codes: torch.Tensor, scales: torch.Tensor) -> Int8Weight:
        """The weight of ``codes`` (int8 ``[N, K]``, the rotated weight rounded as ``from_dense`` does)
        and per-row ``scales`` (float32 ``[N]``), prepacked for oneDNN (what ``from_dense`` ends with;
        a cache of the rounded codes rebuilds the weight with it)."""
        if codes.dtype != torch.int8 or codes.dim() != 2 or codes.shape[1] % BLOCK:
            raise ValueError(f"codes must be int8 [N, K] with K a multiple of {BLOCK}, got {codes.dtype} {tuple(codes.shape)}")
        if scales.dtype != torch.float32 or tuple(scales.shape) != (codes.shape[0],):
            raise ValueError(f"scales must be float32 [{codes.shape[0]}], got {scales.dtype} {tuple(scales.shape)}")
        packed = torch.ops.onednn.qlinear_prepack(codes, None)
        zeros = torch.zeros(codes.shape[0], dtype=torch.long)
        return Int8Weight(packed, scales.contiguous(), zeros, mixer(codes.shape[1] // BLOCK), codes.shape[1])


def int8_linear(x: torch.Tensor, w: Int8Weight) -> torch.Tensor:
    """``x [M, K] @ W.T`` as float32 ``[M, N]`` with ``x`` rounded per row to int8 (module docstring).
    Requires ``int8_available()``; ``TypeError`` / ``ValueError`` name the bad argument."""
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32:
        raise TypeError(f"x must be a float32 tensor, got {getattr(x, 'dtype', type(x))}")
    if x.dim() != 2 or x.shape[1] != w.in_features:
        raise ValueError(f"x must have shape [M, {w.in_features}], got {tuple(x.shape)}")
    return torch.ops.treeserve.int8_linear(x, *w.operands)


def int8_swiglu_linear(gate_up: torch.Tensor, w: Int8Weight) -> torch.Tensor:
    """``(silu(gate) * up) @ W.T`` for ``gate_up = [gate | up]`` float32 ``[M, 2K]``, as ``int8_linear``
    of that product (computed row by row in the operator, ``exp`` to a few ulp, then rotated and
    rounded the same way): a SwiGLU MLP's down projection without the ``[M, K]`` activation.
    Requires ``int8_available()``; ``TypeError`` / ``ValueError`` name the bad argument."""
    if not isinstance(gate_up, torch.Tensor) or gate_up.dtype != torch.float32:
        raise TypeError(f"gate_up must be a float32 tensor, got {getattr(gate_up, 'dtype', type(gate_up))}")
    if gate_up.dim() != 2 or gate_up.shape[1] != 2 * w.in_features:
        raise ValueError(f"gate_up must have shape [M, {2 * w.in_features}], got {tuple(gate_up.shape)}")
    return torch.ops.treeserve.int8_swiglu_linear(gate_up, *w.operands)
