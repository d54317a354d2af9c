"""Weight-only quantized linears on CPU: GGUF Q4_0 / Q4_1 / Q8_0 kept as shipped, and an exact head.

Every supported code maps onto torch's CPU int4 "scales and zeros" form, group 32, whose kernel
(``torch._weight_int4pack_mm_for_cpu``) computes ``w = (c - 8) * scale + zero`` per 4-bit code
``c`` in ``[0, 15]`` (checked by ``tests/models/test_quant.py``):

- **Q4_1** ``w = d * q + m``: ``c = q``, ``scale = d``, ``zero = m + 8 d``.
- **Q4_0** ``w = d * (q - 8)``: ``c = q``, ``scale = d``, ``zero = 0``.
- **Q8_0** ``w = d * q``, ``q`` int8: ``q = 16 hi + lo`` with ``lo = q & 15`` and ``hi = q >> 4``
  (in ``[-8, 7]``); two 4-bit planes laid side by side along K (``c = lo``, ``scale = d``,
  ``zero = 8 d``; ``c = hi + 8``, ``scale = 16 d``, ``zero = 0``) and the activations repeated
  twice along K: one int4 GEMM over ``2K`` reads exactly the int8 bytes. (``_weight_int8pack_mm``
  takes one scale per output channel, which a per-32-group code cannot use without re-quantizing.)

No code is re-quantized here: the codes are bit-identical to the loader's (the file's for Q4_0 /
Q4_1 / Q8_0 tensors; other GGUF types arrive converted, ``gguf_convert``) and the scales are its
f16 values. The kernel's activations/scales dtype is a choice: on this torch build float32
activations take a scalar path (~10x slower than bfloat16 on an AVX2 EPYC, see
``benches/bench_quant.py``), so the fast path casts the (few) activation rows and the scales to
bfloat16 — scales then carry bf16 precision (relative 2^-9), the codes stay exact.
``PackedLinear`` also keeps the dequantized weight in the model dtype for prefill and large
batches, where a GEMM over all rows wins: an int8 GEMM (``int8_op``: a Hadamard rotation, then
the weight rounded once more to per-channel 8-bit codes and the activations to 7-bit codes per
row) where it is available and measured faster than the dense one (``use_int8``), else the dense
float GEMM. Both choices, and the crossover in rows per step from the packed path to the
large-batch one, are measured on the machine (``measure_crossover``), never assumed.

HF (float) checkpoints can opt in: ``quantize_int4`` (asymmetric group-32 min/max, the Q4_1
form) and ``quantize_int8`` (symmetric group-32, the Q8_0 form).

``ExactHead`` runs the LM head in bfloat16 and re-scores, in float32, every vocabulary entry that
a rigorous error bound cannot rule out, so greedy picks the same token as the float32 head.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from treeserve._cpp import cpp_op_loader, load_cpp_op
from treeserve._tuning import measured
from treeserve.models.gguf_op import GGUFWeight, gguf_op_available, q8_lanes
from treeserve.models.int8_op import BLOCK as INT8_BLOCK
from treeserve.models.int8_cache import int8_weight
from treeserve.models.int8_op import Int8Weight, int8_available, int8_linear, int8_swiglu_linear
from treeserve.models.vocab_codes import INT16_HEAD_QTYPES, CodesHead

__all__ = [
    "GROUP",
    "LARGE_TIER_MEMORY_FRACTION",
    "QUANTIZATIONS",
    "ExactHead",
    "GGUFWeight",
    "Int4Planes",
    "PACKABLE",
    "PackedLinear",
    "check_quantization",
    "large_tier_budget",
    "measure_crossover",
    "pack_model",
    "planes_from_gguf",
    "plain_rows",
    "prepare_large_weights",
    "quantize_int4",
    "quantize_int8",
    "restore_dense",
    "routed_rows",
    "use_codes_large",
    "use_int8",
    "use_q8_head",
    "use_q8_large",
]

GROUP = 32  # every supported code: 32 weights per scale
_GGUF_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


class Int4Planes(NamedTuple):
    """A weight ``[N, K]`` as ``planes`` 4-bit planes side by side: ``codes [N, planes*K]`` (uint8,
    0..15), ``scales`` and ``zeros [N, planes*K/32]`` (float32). ``w[:, k] = sum over planes p of
    (codes[:, p*K+k] - 8) * scale + zero`` of that plane's group."""

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    planes: int

    @property
    def shape(self) -> tuple[int, int]:
        """``(N, K)`` of the weight."""
        return self.codes.shape[0], self.codes.shape[1] // self.planes

    def dequantize(self) -> torch.Tensor:
        """The float32 weight ``[N, K]`` (computed in float64, so exact for f16 scales)."""
        n, k = self.shape
        c = self.codes.double().view(n, -1, GROUP) - 8
        w = c * self.scales.double()[..., None] + self.zeros.double()[..., None]
        return w.view(n, self.planes, k).sum(1).float()

    def with_planes(self, planes: int) -> Int4Planes:
        """The same weight over ``planes`` (>= self.planes) planes: extra planes contribute 0."""
        if planes < self.planes:
            raise ValueError(f"planes must be >= {self.planes}, got {planes}")
        n, k = self.shape
        pad = _zero_rows(n, (planes - self.planes) * k)
        return Int4Planes(*(torch.cat([mine, extra], 1) for mine, extra in zip(self[:3], pad)), planes)

    @staticmethod
    def cat_rows(parts: list[Int4Planes]) -> Int4Planes:
        """Stack weights along N (a fused projection); planes are padded to the largest count."""
        planes = max(p.planes for p in parts)
        parts = [p.with_planes(planes) for p in parts]
        return Int4Planes(*(torch.cat([p[i] for p in parts]) for i in range(3)), planes)

    def permute_rows(self, fn: Callable[[np.ndarray], np.ndarray]) -> Int4Planes:
        """Apply a row permutation ``fn`` (numpy, on ``[N, ...]`` arrays) to every field."""
        moved = (torch.from_numpy(np.ascontiguousarray(fn(field.numpy()))) for field in self[:3])
        return Int4Planes(*moved, self.planes)


def planes_from_gguf(qtype: str, raw: np.ndarray, shape: tuple[int, int]) -> Int4Planes:
    """The planes of a GGUF ``Q4_0`` / ``Q4_1`` / ``Q8_0`` tensor (``raw``: its bytes, ``shape``: ``(N, K)``).

    Raises ``ValueError`` for another type, a K not divisible by 32 or a byte count that does
    not match ``shape``.
    """
    if qtype not in _GGUF_BLOCK_BYTES:
        raise ValueError(f"qtype must be one of {sorted(_GGUF_BLOCK_BYTES)}, got {qtype!r}")
    n, k = shape
    if k % GROUP:
        raise ValueError(f"K must be a multiple of {GROUP}, got shape {shape}")
    nbytes = n * (k // GROUP) * _GGUF_BLOCK_BYTES[qtype]
    flat = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    if flat.size != nbytes:
        raise ValueError(f"{qtype} tensor of shape {shape} needs {nbytes} bytes, got {flat.size}")
    blocks = flat.reshape(n, k // GROUP, _GGUF_BLOCK_BYTES[qtype])
    d = torch.from_numpy(blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32))
    if qtype == "Q8_0":
        return _int8_planes(torch.from_numpy(blocks[..., 2:].copy().view(np.int8)), d)
    qs = torch.from_numpy(blocks[..., -16:].copy())  # byte j: element j (low nibble), j + 16 (high)
    codes = torch.cat([qs & 15, qs >> 4], -1).reshape(n, k)
    if qtype == "Q4_0":
        return Int4Planes(codes, d, torch.zeros_like(d), 1)
    m = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
    return Int4Planes(codes, d, (m.double() + 8 * d.double()).float(), 1)


def _int8_planes(q: torch.Tensor, d: torch.Tensor) -> Int4Planes:
    """Int8 codes ``q [N, K/32, 32]`` with scales ``d [N, K/32]`` as two planes: ``q = 16 hi + lo``."""
    n = q.shape[0]
    q = q.to(torch.int16).reshape(n, -1)
    lo, hi = (q & 15).to(torch.uint8), ((q >> 4) + 8).to(torch.uint8)
    return Int4Planes(torch.cat([lo, hi], 1), torch.cat([d, 16 * d], 1), torch.cat([8 * d, torch.zeros_like(d)], 1), 2)


def _zero_rows(n: int, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """codes, scales, zeros of ``n`` rows that decode to 0 (code 8, scale 0, zero 0)."""
    groups = width // GROUP
    return torch.full((n, width), 8, dtype=torch.uint8), torch.zeros(n, groups), torch.zeros(n, groups)


def _check_float_weight(w: torch.Tensor) -> tuple[int, int]:
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or not w.is_floating_point():
        raise TypeError(f"weight must be a 2-D float tensor, got {getattr(w, 'shape', type(w))}")
    n, k = w.shape
    if k % GROUP:
        raise ValueError(f"weight K (columns) must be a multiple of {GROUP}, got {k}")
    return n, k


def quantize_int4(w: torch.Tensor) -> Int4Planes:
    """Asymmetric group-32 int4 (the Q4_1 form): ``scale = (max - min) / 15``, ``zero = min + 8 scale``."""
    n, k = _check_float_weight(w)
    g = w.detach().float().cpu().reshape(n, k // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = (hi - lo) / 15
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = ((g - lo[..., None]) / safe[..., None]).round().clamp(0, 15).to(torch.uint8).reshape(n, k)
    return Int4Planes(codes, scale, lo + 8 * scale, 1)


def quantize_int8(w: torch.Tensor) -> Int4Planes:
    """Symmetric group-32 int8 (the Q8_0 form, ``d = absmax / 127``) as two 4-bit planes."""
    n, k = _check_float_weight(w)
    g = w.detach().float().cpu().reshape(n, k // GROUP, GROUP)
    d = g.abs().amax(-1) / 127
    safe = torch.where(d > 0, d, torch.ones_like(d))
    return _int8_planes((g / safe[..., None]).round().clamp(-127, 127), d)


def _pack(planes: Int4Planes, act_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's packed weight and ``[K'/32, N', 2]`` scales-and-zeros; N is padded to a multiple of
    16 (the kernel's requirement) with rows that decode to 0."""
    pad = -planes.shape[0] % 16
    if pad:
        planes = Int4Planes.cat_rows([planes, Int4Planes(*_zero_rows(pad, planes.codes.shape[1]), planes.planes)])
    packed = torch._convert_weight_to_int4pack_for_cpu(planes.codes.to(torch.int32), 1)
    sz = torch.stack([planes.scales.t(), planes.zeros.t()], -1).to(act_dtype).contiguous()
    return packed, sz


_PLAIN_ROWS: ContextVar[int | None] = ContextVar("treeserve_plain_rows", default=None)


@contextmanager
def plain_rows(rows: int) -> Iterator[None]:
    """Within it, every ``PackedLinear`` (and the fused decode layers) takes the path it would take
    for a step of ``rows`` rows, whatever its input's row count: a verify step's plain rows (its
    pending tokens and prefill chunks), so that its draft nodes ride the path plain decoding takes.
    Below ``packed_max_rows`` that is the int16 GGUF kernel, which sums every row of a call as the
    row alone on every host: a verify step of one request computes each of its rows as a one-row
    decode step does, however long its draft (greedy speculation keeps plain decoding's output),
    instead of crossing to the large-batch path, which computes rows another way.
    ``ValueError`` unless ``rows`` is an int >= 1."""
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise ValueError(f"rows must be an int >= 1, got {rows!r}")
    token = _PLAIN_ROWS.set(rows)
    try:
        yield
    finally:
        _PLAIN_ROWS.reset(token)


def routed_rows(rows: int) -> int:
    """The row count a projection given ``rows`` rows chooses its path by: ``plain_rows``' within
    one, else ``rows``."""
    plain = _PLAIN_ROWS.get()
    return rows if plain is None else plain


class PackedLinear(nn.Module):
    """``x @ W.T (+ bias)`` with ``W`` held as shipped codes (decode) and dense (prefill).

    ``codes`` is either a ``GGUFWeight`` (the file's blocks, multiplied by the C++ operator
    ``treeserve::gguf_linear``: activations rounded to int16 per 32-block,
    error about 2^-16 of each block's largest activation, see ``gguf_op``; float32 accumulation) or ``Int4Planes`` (torch's int4 kernel, activations and
    scales in ``act_dtype``: bfloat16 is its fast path, float32 exact but slow on AVX2). Batches of
    at most ``packed_max_rows`` rows (within ``plain_rows``, a verify step's plain rows, drafts
    aside) take the packed path, larger ones ``large_forward``: the int8
    GEMM where ``use_int8`` gave the layer an ``Int8Weight``, the same GGUF codes with activations
    rounded to int8 per 32-block (``treeserve::gguf_linear_q8``, no other copy of the weight) where
    ``large_q8`` is set (``use_q8_large``), else ``F.linear`` on ``weight`` (the codes dequantized
    once into the model dtype; the caller passes it). The output has ``x``'s dtype. CPU only.

    Memory: when nothing in eager use needs the dense weight (GGUF codes multiplied by the C++
    operator up to ``packed_max_rows``, the int8 GEMM above), ``drop_dense`` frees it and
    ``weight`` is absent; ``dense_weight()`` gives it back, rebuilt from the codes (and kept), for
    whoever needs it (a traced step: ``restore_dense`` before compiling).
    """

    def __init__(
        self,
        codes: Int4Planes | GGUFWeight,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        act_dtype: torch.dtype = torch.bfloat16,
        packed_max_rows: int = 0,
        weight_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        n, k = codes.shape
        if weight is None:  # built from the codes alone: ``dense_weight()`` makes it when asked
            if not isinstance(codes, GGUFWeight) or weight_dtype is None:
                raise ValueError("weight may be None only for GGUFWeight codes with a weight_dtype")
        elif tuple(weight.shape) != (n, k):
            raise ValueError(f"weight must have the codes' shape {(n, k)}, got {tuple(weight.shape)}")
        self.in_features, self.out_features = k, n
        self.act_dtype = act_dtype
        self.weight_dtype = weight.dtype if weight is not None else weight_dtype
        self.packed_max_rows = packed_max_rows
        if weight is not None:
            self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        self.bias = bias
        self.int8: Int8Weight | None = None  # set by ``use_int8`` where the int8 GEMM pays
        self.large_q8 = False  # set by ``use_q8_large``: large batches on the codes with int8 activations
        self._large: _LargeWeights | None = None  # deferred large-batch weights (``prepare_large``)
        self.int8_source: tuple[str | None, str] = (None, "")  # (source file id, name): ``int8_cache``'s key
        self.qtype = codes.qtype if isinstance(codes, GGUFWeight) else None
        if self.qtype is not None:
            self.planes = 0
            self.use_op = gguf_op_available()  # else the dense weight serves every batch
            self.register_buffer("raw", codes.raw, persistent=False)
        else:
            self.planes = codes.planes
            packed, sz = _pack(codes, act_dtype)
            self.register_buffer("packed", packed, persistent=False)
            self.register_buffer("scales_zeros", sz, persistent=False)

    def packed_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The packed product whatever the row count (``x [M, K]``)."""
        if self.qtype is not None:
            if not self.use_op:
                return F.linear(x, self.weight, self.bias)
            y = torch.ops.treeserve.gguf_linear(x.float(), self.raw, self.qtype, self.in_features).to(x.dtype)
            return y if self.bias is None else y + self.bias
        a = x.to(self.act_dtype)
        if self.planes > 1:
            a = a.repeat(1, self.planes)
        y = torch._weight_int4pack_mm_for_cpu(a, self.packed, GROUP, self.scales_zeros)
        y = y[:, : self.out_features].to(x.dtype)
        return y if self.bias is None else y + self.bias

    def large_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The product for batches above ``packed_max_rows`` (``x [M, K]``): the codes with int8
        activations when ``large_q8`` is set, the int8 GEMM when ``int8`` is set (and Dynamo is not
        tracing), else ``F.linear`` on the dense weight
        (``RuntimeError`` when it is not held: see ``dense_weight``). Deferred large-batch
        weights are built first (``prepare_large``)."""
        if self.large_q8:
            y = torch.ops.treeserve.gguf_linear_q8(x.float(), self.raw, self.qtype, self.in_features).to(x.dtype)
            return y if self.bias is None else y + self.bias
        self.prepare_large()
        if self.int8 is None or _tracing():
            if not self.has_dense:
                raise RuntimeError(f"PackedLinear {self.out_features}x{self.in_features} holds no dense weight "
                                   "(built from its codes alone); call dense_weight() or restore_dense() first")
            return F.linear(x, self.weight, self.bias)
        y = int8_linear(x.float(), self.int8).to(x.dtype)
        return y if self.bias is None else y + self.bias

    def swiglu_forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        """This layer applied to ``silu(gate) * up`` for ``gate_up = [gate | up]`` ``[M, 2 K]``: in one
        operator (``int8_swiglu_linear``) where ``large_forward`` would take the int8 GEMM, else
        ``F.silu`` and a multiply before ``forward``."""
        large = gate_up.dim() == 2 and routed_rows(gate_up.shape[0]) > self.packed_max_rows
        if large:
            self.prepare_large()
        if large and self.int8 is not None and not _tracing():
            y = int8_swiglu_linear(gate_up.float(), self.int8).to(gate_up.dtype)
            return y if self.bias is None else y + self.bias
        gate, up = gate_up.split(self.in_features, dim=-1)
        return self(F.silu(gate) * up)

    def prepare_large(self) -> None:
        """Build the large-batch weights now if ``pack_model`` deferred them (its whole group's, at
        once: the int8 copies or the dense weights); nothing otherwise. Memory until a batch above
        ``packed_max_rows`` comes is the codes' alone."""
        if self._large is not None:
            self._large.build()

    @property
    def large_pending(self) -> bool:
        """Whether the large-batch weights are deferred (``prepare_large`` builds them)."""
        return self._large is not None

    @property
    def large_int8(self) -> bool:
        """Whether batches above ``packed_max_rows`` take the int8 GEMM (its copy built or deferred)."""
        return self.int8 is not None or (self._large is not None and self._large.int8)

    @property
    def derived_tensors(self) -> tuple[str, ...]:
        """Tensors rebuilt from the codes (``kvcache.module_fingerprint`` leaves them out): GGUF
        codes' dense ``weight``, built and freed on demand (``dense_weight``, ``drop_dense``,
        ``prepare_large``)."""
        return ("weight",) if self.qtype is not None else ()

    @property
    def has_dense(self) -> bool:
        """Whether the dense weight is held (see ``drop_dense``)."""
        return "weight" in self._parameters

    def drop_dense(self) -> bool:
        """Free the dense weight if eager calls never read it (GGUF codes through the C++ operator
        for small batches, ``int8`` for large ones); return whether it was dropped."""
        if self.qtype is None or not self.use_op or self.int8 is None or not self.has_dense:
            return False
        del self._parameters["weight"]
        return True

    def dense_weight(self) -> torch.Tensor:
        """The dense weight ``[N, K]`` in the model dtype, rebuilt from the codes (and kept as
        ``weight`` again) when it was dropped or never built."""
        if not self.has_dense:
            self.weight = nn.Parameter(self.dequantized(), requires_grad=False)
        return self.weight

    def dequantized(self) -> torch.Tensor:
        """The dense weight ``[N, K]`` in the model dtype: ``weight`` when held, else made from the
        codes for the caller alone (not kept)."""
        if self.has_dense:
            return self.weight
        return GGUFWeight(self.qtype, self.raw, self.in_features).dequantize(self.weight_dtype)  # type: ignore[arg-type]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., K] -> [..., N]``, routed by its number of rows (leading dimensions flattened)."""
        if x.dim() != 2:
            return self.forward(x.reshape(-1, self.in_features)).reshape(*x.shape[:-1], self.out_features)
        if routed_rows(x.shape[0]) <= self.packed_max_rows:
            return self.packed_forward(x)
        return self.large_forward(x)


def prepare_large_weights(model: nn.Module) -> int:
    """Build now every large-batch weight ``pack_model`` deferred in ``model`` (``PackedLinear.prepare_large``:
    int8 copies, read back from their disk cache where kept, or dense weights) instead of at each group's
    first batch above ``packed_max_rows``; returns how many projections had theirs pending (0: nothing to
    do). Resident memory grows by what those batches would hold anyway."""
    pending = [m for m in model.modules() if isinstance(m, PackedLinear) and m.large_pending]
    for m in pending:
        m.prepare_large()
    return len(pending)


def restore_dense(model: nn.Module) -> None:
    """Give every ``PackedLinear`` of ``model`` its dense weight back, and an ``ExactHead`` with a bf16
    pass its plain bf16 weight (before tracing: a traced step multiplies by those)."""
    for m in model.modules():
        if isinstance(m, PackedLinear):
            m.dense_weight()
        elif isinstance(m, ExactHead) and m.bf16_max_rows:
            m.bf16_weight()


def _prepack_bf16(w16: torch.Tensor) -> torch.Tensor | None:
    """``w16`` (bf16 ``[N, K]``) reordered once into oneDNN's matmul layout
    (``mkldnn._reorder_linear_weight``, what inductor's weight freezing uses), or None where torch
    lacks those ops or the reordered product differs from ``F.linear`` on a probe."""
    ops = torch.ops.mkldnn
    if not (torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")
            and hasattr(ops, "_linear_pointwise")):  # fmt: skip
        return None
    probe = torch.randn(3, w16.shape[1], generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    try:
        packed = ops._reorder_linear_weight(w16)
        same = torch.equal(ops._linear_pointwise(probe, packed, None, "none", [], ""), F.linear(probe, w16))
    except RuntimeError:
        return None
    return packed if same else None


_tracing = torch.compiler.is_compiling
"""True while Dynamo traces (``ExactHead`` then re-scores with static shapes); tests patch it."""

_CROSSOVER_ROWS = (1, 2, 4, 8, 16, 32, 64, 128)
_ALL_ROWS = 1 << 62  # a path that wins at the last measured row count serves every larger one


def _best_seconds(fn: Callable[[], object], reps: int = 5) -> float:
    fn()
    best = math.inf
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _env_rows(name: str) -> int | None:
    env = os.environ.get(name)
    if env is None:
        return None
    if env == "all":
        return _ALL_ROWS
    if not env.isdigit():
        raise ValueError(f"{name} must be an int >= 0 or 'all', got {env!r}")
    return int(env)


def _crossover(kind: str, key: tuple[object, ...], k: int, dtype: torch.dtype, packed: Callable[[torch.Tensor], object],
               dense: Callable[[torch.Tensor], object], counts: Sequence[int] = _CROSSOVER_ROWS) -> int:
    """The largest row count of ``counts`` up to which ``packed(x)`` is at least as fast as
    ``dense(x)`` (``x [rows, k]``), 0 when never; measured once per host and ``key``
    (``treeserve._tuning.measured``: kept on disk)."""

    def measure() -> int:
        best = 0
        with torch.inference_mode():
            for rows in counts:
                x = torch.randn(rows, k, dtype=dtype)
                if _best_seconds(lambda: packed(x)) > _best_seconds(lambda: dense(x)):
                    break
                best = rows
        return best

    return measured(kind, (*key, k, dtype), int, measure)


_MEASURE_BYTES = 1 << 30


def _measured_part(group: list[PackedLinear]) -> list[PackedLinear]:
    """The first layers of ``group`` whose dense float32 weights total at most 1 GiB (at least one):
    what a measurement times. More than a last-level cache, so the weights are read from memory as
    in a step, and a measurement of a large model needs neither all its dense weights at once nor
    minutes."""
    total = 0
    for i, m in enumerate(group):
        total += 4 * m.in_features * m.out_features
        if total > _MEASURE_BYTES:
            return group[: max(i, 1)]
    return group


def measure_crossover(layers: PackedLinear | Sequence[PackedLinear]) -> int:
    """The largest row count (of 1, 2, 4 ... 128) up to which the packed path of ``layers`` (run one
    after another, all of one K, as a decode step reads them: the weights do not stay in cache)
    is at least as fast as the large-batch one (``large_forward``) on this machine, 0 when never;
    measured once per host per set of shapes, dtypes and thread count (kept on disk: ``treeserve._tuning``).
    ``TREESERVE_PACKED_MAX_ROWS`` (an int >= 0, or ``all``: every batch, see ``pack_model``)
    overrides the measurement."""
    env = _env_rows("TREESERVE_PACKED_MAX_ROWS")
    if env is not None:
        return env
    group = [layers] if isinstance(layers, PackedLinear) else list(layers)
    if not group or len({m.in_features for m in group}) != 1:
        raise ValueError(f"layers must be a non-empty set of one in_features, got {[m.in_features for m in group]}")
    group = _measured_part(group)
    key = tuple((m.out_features, m.in_features, m.planes, m.qtype, m.weight_dtype, m.act_dtype, m.large_int8)
                for m in group)
    return _crossover("packed-rows", key, group[0].in_features, group[0].weight_dtype,
                      _in_turn(group, lambda m, x: m.packed_forward(x)), _in_turn(group, lambda m, x: m.large_forward(x)))


def _in_turn(layers: Sequence[PackedLinear], fn: Callable[[PackedLinear, torch.Tensor], object]
             ) -> Callable[[torch.Tensor], None]:
    """``x -> fn(m, x)`` for every layer one after another, as a step reads them (a crossover's timed call)."""
    return lambda x: [fn(m, x) for m in layers] and None


def _int16_rows(kind: str, key: tuple[object, ...], k: int, int16: Callable[[torch.Tensor], object],
                q8: Callable[[torch.Tensor], object]) -> int:
    """The row count up to which the int16-activation call ``int16`` stays, against the int8 one
    ``q8`` (``_crossover``, float32 ``x``): at least 1, a single stream keeps the finer activations;
    ``_ALL_ROWS`` when ``q8`` is never faster over the measured counts."""
    rows = _crossover(kind, key, k, torch.float32, int16, q8)
    return _ALL_ROWS if rows >= _CROSSOVER_ROWS[-1] else max(rows, 1)


def _codes_on_op(group: Sequence[PackedLinear]) -> bool:
    """Whether ``group`` is non-empty and every layer's GGUF codes run on the operator."""
    return bool(group) and all(m.qtype is not None and m.use_op for m in group)


def use_q8_large(layers: Sequence[PackedLinear]) -> int:
    """For a group of GGUF-code layers (one input width) whose codes serve every batch (no room for
    other large-batch weights): give them the int8-activation path of their codes
    (``treeserve::gguf_linear_q8``: activations rounded to int8 per 32-block, about 2^-8 of each
    block's largest activation, vs 2^-16 for ``gguf_linear``'s int16) for the batches where it is
    faster on this machine, and return the row count up to which the int16 path stays
    (``packed_max_rows``: at least 1, a single stream keeps the finer activations; ``_ALL_ROWS``
    when the int8 path is never faster or not built). Measured once per host per set of shapes and
    thread count (``treeserve._tuning``), on hosts where it runs as a vector kernel
    (``gguf_op.q8_lanes``: AVX2, with VNNI where the host has it; elsewhere its scalar loop is not
    measured, nor taken); ``TREESERVE_PACKED_MAX_ROWS`` (an int) overrides both."""
    group = list(layers)
    env = _env_rows("TREESERVE_PACKED_MAX_ROWS")
    if not _codes_on_op(group) or (env is None and not q8_lanes()):
        return _ALL_ROWS
    if env is None:
        timed = _measured_part(group)
        key = tuple((m.out_features, m.in_features, m.qtype) for m in timed)

        def q8(m: PackedLinear, x: torch.Tensor) -> object:
            return torch.ops.treeserve.gguf_linear_q8(x, m.raw, m.qtype, m.in_features)

        rows = _int16_rows("q8-rows", key, group[0].in_features, _in_turn(timed, lambda m, x: m.packed_forward(x)),
                           _in_turn(timed, q8))
    else:
        rows = env
    for m in group:
        m.large_q8 = rows < _ALL_ROWS
    return rows


def use_q8_head(head: CodesHead) -> None:
    """Give a head kept as Q4_0 / Q8_0 codes (``CodesHead``) the int8-activation first pass
    (``gguf_linear_q8``) for the batches where, re-scoring included, it beats the int16 one on this
    machine (``head.q8_min_rows``; random activations, whose flat logits re-score the most).
    Measured once per host per shape and thread count, where the operator runs its vector kernel
    (``q8_lanes``); ``TREESERVE_HEAD_INT16_MAX_ROWS`` (an int, or ``all``) sets the rows up to which
    the int16 pass stays."""
    env = _env_rows("TREESERVE_HEAD_INT16_MAX_ROWS")
    if not head.int16 or (env is None and not q8_lanes()):
        return
    if env is None:
        env = _int16_rows("head-q8-rows", (head.out_features, head.qtype), head.in_features,
                          lambda x: head.logits(x, False), lambda x: head.logits(x, True))
    head.q8_min_rows = None if env >= _ALL_ROWS else env + 1


_INT8_WINS, _CODES_WIN = 1, 2  # ``_large_paths``'s verdict bits


def _codes_candidate(group: Sequence[PackedLinear]) -> bool:
    """Whether the codes of ``group`` with int8 activations are timed as its large-batch path: GGUF
    codes on the operator, its vector kernel built (``q8_lanes``), ``TREESERVE_INT8`` unset."""
    return _codes_on_op(group) and os.environ.get("TREESERVE_INT8") is None and q8_lanes()


def _large_paths(group: Sequence[PackedLinear], rows: int, built: list[Int8Weight]) -> int:
    """The large-batch verdict of ``group`` (one input width, run one after another as a step reads
    them) at ``rows`` rows, as bits: ``_INT8_WINS`` when the int8 GEMM on ``Int8Weight`` copies
    (where its operator and the width allow) beats ``F.linear`` on the dense weights; ``_CODES_WIN``
    when the codes read with int8 activations (``gguf_linear_q8``, where ``_codes_candidate``) are
    at least as fast as both. One measurement of all candidates, once per host per set of shapes
    and thread count (kept on disk: ``treeserve._tuning``), over the group's ``_measured_part``;
    the int8 copies it builds are appended to ``built`` (none when the verdict was cached)."""
    timed = _measured_part(group)
    k = group[0].in_features
    with_int8 = k % INT8_BLOCK == 0 and int8_available()
    codes = _codes_candidate(group)

    def measure() -> int:
        dense = [m.dequantized() for m in timed]
        if with_int8:
            built.extend(_int8_of(m, lambda w=w: w) for m, w in zip(timed, dense))
        with torch.inference_mode():
            x = torch.randn(rows, k, dtype=group[0].weight_dtype)
            xf = x.float()
            dense_s = _best_seconds(lambda: [F.linear(x, w) for w in dense])
            int8_s = _best_seconds(lambda: [int8_linear(xf, w) for w in built]) if built else math.inf
            codes_s = (_best_seconds(lambda: [torch.ops.treeserve.gguf_linear_q8(xf, m.raw, m.qtype, k) for m in timed])
                       if codes else math.inf)
        return (_INT8_WINS if int8_s < dense_s else 0) | (_CODES_WIN if codes_s <= min(dense_s, int8_s) else 0)

    key = (tuple((m.out_features, m.in_features, m.qtype, m.weight_dtype) for m in timed), rows, with_int8, codes)
    return measured("large-paths", key, int, measure)


def use_codes_large(layers: Sequence[PackedLinear], rows: int = 64) -> bool:
    """Whether the GGUF codes of ``layers`` (one input width, run one after another as a step reads
    them), read with int8 activations (``gguf_linear_q8``), serve ``rows``-row batches at least as
    fast as the large-batch weights ``pack_model`` would otherwise build: the int8 copies
    (``use_int8``'s GEMM, where its operator and the width allow) and the dense float32 weights
    (``F.linear``). Then no such weights are made: the codes serve every batch, their exact weights
    and no extra memory, with ``use_q8_large`` choosing int16 or int8 activations per row count.
    Measured with ``use_int8``'s choice in one measurement (``_large_paths``), where the operator
    runs its vector kernel (``gguf_op.q8_lanes``); ``TREESERVE_INT8`` set (``1``: the int8 copies,
    ``0``: the dense weights) keeps its choice without timing."""
    group = list(layers)
    return _codes_candidate(group) and bool(_large_paths(group, rows, []) & _CODES_WIN)


def use_int8(layers: Sequence[PackedLinear], rows: int = 64, defer: bool = False) -> bool:
    """Give every layer of ``layers`` (one input width, run one after another as a step reads
    them) an int8 copy of its weight (``Int8Weight``: rotated, per-channel 8-bit codes, row-wise
    7-bit activations, ``int8_op``; K a multiple of 64) for its batches above ``packed_max_rows``,
    when the int8 GEMM is available and, at ``rows`` rows, faster than ``F.linear`` on the dense
    weights on this machine (measured once per host per set of shapes and thread count, kept on
    disk, in the same measurement as ``use_codes_large``'s: ``_large_paths``). ``TREESERVE_INT8``
    = ``0`` / ``1`` overrides the measurement (``1`` still needs the operator). Returns whether it
    did. ``defer``: when the choice was known without timing (the cache, the override), the copies
    are built at the layers' first large batch (``PackedLinear.prepare_large``) instead of now."""
    group = list(layers)
    env = os.environ.get("TREESERVE_INT8")
    if env not in (None, "0", "1"):
        raise ValueError(f"TREESERVE_INT8 must be '0' or '1', got {env!r}")
    if not group or env == "0" or group[0].in_features % INT8_BLOCK or not int8_available():
        return False
    if len({m.in_features for m in group}) != 1:
        raise ValueError(f"layers must share one in_features, got {[m.in_features for m in group]}")
    built: list[Int8Weight] = []  # the measurement's weights, kept for their layers
    if env is None and not _large_paths(group, rows, built) & _INT8_WINS:
        return False
    if defer and not built:
        _LargeWeights(group, int8=True)
        return True
    _attach_int8(group, built)
    return True


def _attach_int8(group: Sequence[PackedLinear], built: Sequence[Int8Weight] = ()) -> None:
    """Give ``group`` its int8 copies (``built``: those of its first layers, made already)."""
    # The rest in threads: oneDNN's prepack (most of a warm start's int8 work) runs on one thread per
    # call (90 prepacks of SmolLM2-135M: 0.73 s one after another, 0.20 s on 2 threads, AVX2 EPYC).
    with ThreadPoolExecutor(max(1, torch.get_num_threads())) as pool:
        weights = list(built) + list(pool.map(lambda m: _int8_of(m, m.dequantized), group[len(built):]))
    for m, w in zip(group, weights):
        m.int8 = w


class _LargeWeights:
    """The deferred large-batch weights of one group of ``PackedLinear`` (one input width, as
    ``pack_model`` measured them): the int8 copies (``int8``: ``use_int8``'s choice, read from the
    disk cache) or the dense weights, built for the whole group at the first batch above
    ``packed_max_rows`` that any of them sees. Until then a model holds its codes alone (SmolLM2:
    the dense down_proj weights and the int8 copies, ~177 MiB, benches/RESULTS.md issue 33)."""

    __slots__ = ("layers", "int8")

    def __init__(self, layers: Sequence[PackedLinear], int8: bool) -> None:
        self.layers, self.int8 = list(layers), int8
        for m in self.layers:
            m._large = self

    def build(self) -> None:
        """Build them (once: each layer forgets this object first) and drop what eager calls no
        longer read (the dense weights beside int8 copies)."""
        layers, self.layers = self.layers, []
        for m in layers:
            m._large = None
        if self.int8:
            _attach_int8(layers)
            for m in layers:
                m.drop_dense()  # eager calls no longer read it
            return
        for m in layers:
            m.dense_weight()


def _int8_of(m: PackedLinear, dense: Callable[[], torch.Tensor]) -> Int8Weight:
    """``m``'s int8 copy: from the disk cache of its source file where ``pack_model`` named one
    (``int8_cache``), else rounded from ``dense()``."""
    source, name = m.int8_source
    return int8_weight(source, name, (m.out_features, m.in_features), dense)


def _rescore_fake(approx, out, x, weight, row_norms, factor, max_candidates):  # type: ignore[no-untyped-def]
    return x.new_empty((x.shape[0],), dtype=torch.bool)


@cpp_op_loader
def _rescore_op_available() -> bool:
    """Whether ``treeserve::exact_head_rescore`` (``csrc/exact_head.cpp``: ``ExactHead``'s
    re-scoring in two passes per row) is built; otherwise the torch ops below serve."""
    source = Path(__file__).with_name("csrc") / "exact_head.cpp"
    return load_cpp_op(source, "exact_head_rescore", "C++ exact-head re-scoring", _rescore_fake) is None


def _rows_fake(x, weight):  # type: ignore[no-untyped-def]
    return x.new_empty((x.shape[0], weight.shape[0]))


@cpp_op_loader
def _rows_op_available() -> bool:
    """Whether ``treeserve::head_rows`` (``csrc/exact_head.cpp``: the float32 head for a few rows,
    the weight read once) is built."""
    source = Path(__file__).with_name("csrc") / "exact_head.cpp"
    return load_cpp_op(source, "head_rows", "C++ few-row head", _rows_fake) is None


_NORM_ROWS = 8192


class ExactHead(nn.Module):
    """LM head whose greedy pick equals the float32 head's, at the cost of a cheaper first pass.

    ``forward(x [M, H])`` returns float32 logits ``[M, V]``. The first pass is one of:

    - ``packed`` (a GGUF ``GGUFWeight`` whose dequantization is ``weight``), for ``M <=
      packed_max_rows`` and when the GGUF operator is built: Q4_0 / Q8_0 through
      ``treeserve::gguf_linear`` (x rounded to int16 codes per 32-block, exact integer products:
      ~2x faster than float32 activations at 1-5 rows of SmolLM2's head on a Zen 4 EPYC), bound
      ``(c + (1 + c) 3 sqrt(K / 32) / 32767) |x| |W_j|`` with ``c = 2 (K + 2) 2^-24``: the rounding
      moves x by at most ``e = sqrt(9 sum_b s_b^2)``, ``s_b = max|x_b| / 32767`` (``CodesHead.row_bound``),
      and ``e <= 3 sqrt(K / 32) max|x| / 32767 <= 3 sqrt(K / 32) |x| / 32767``: one factor of ``|x|``,
      nothing to compute per step (4.6e-4 for SmolLM2's K = 576); Q4_1 (whose offset term that bound
      does not cover) through ``gguf_linear_exact``: the same float32 products in another summation
      order, bound ``2 (K + 2) 2^-24 |x| |W_j|``;
    - bfloat16 (``W`` rounded once), for the larger ``M`` up to ``bf16_max_rows`` (the rows up
      to which it measured faster than float32 on this machine; on an AVX-512 BF16 EPYC, batch 64:
      8.6 ms against 31 ms float32 and 21 ms packed): bound ``c |x| |W_j|`` (rounding of x and W to
      bf16, relative 2^-8 each (bf16's unit roundoff: 8 significant bits), float32 accumulation,
      and the product rounded to bf16, relative 2^-8: oneDNN's bf16 GEMM returns bf16, widened by
      the re-scoring while it reads the row; ``c = 3 2^-8 + 2^-14 + 2 (K + 2) 2^-24`` covers the
      three roundings, their cross terms and the accumulation);
    - else the float32 head itself (``F.linear`` or ``head_rows``; in an eager step with the C++
      re-scoring, a first pass too, with the packed bound, which covers any summation order).

    After an approximate pass every entry ``j`` the bound cannot exclude from the argmax is
    recomputed in float32 and written back (``treeserve::exact_head_rescore``, two passes per row,
    where built; torch ops otherwise), so the argmax row is the float32 head's (up to float32
    rounding between two float32 evaluations of one dot product); a row with more than
    ``max_candidates`` such entries is computed in float32 entirely (``head_rows`` where built).
    Where both operators are built, every logit that can be a row's greedy pick is the same
    float32 dot product (``exact_head.cpp``'s order) whichever pass its step's row count takes, so a
    row's greedy token does not depend on the other rows of its step (speculative verify steps
    against the decode steps they stand for).
    """

    def __init__(self, weight: nn.Parameter, max_candidates: int = 64, packed: GGUFWeight | None = None) -> None:
        super().__init__()
        if weight.dtype != torch.float32:
            raise TypeError(f"weight must be float32, got {weight.dtype}")
        if packed is not None and packed.shape != tuple(weight.shape):
            raise ValueError(f"packed must have weight's shape {tuple(weight.shape)}, got {packed.shape}")
        self.weight = weight  # shared with a tied embedding
        self.max_candidates = max_candidates
        norms = [rows.double().norm(dim=1) for rows in weight.detach().split(_NORM_ROWS)]  # float64 a chunk at a time
        self.register_buffer("row_norms", torch.cat(norms).float(), persistent=False)
        k = weight.shape[1]
        self.bound_factor = 3 * 2.0**-8 + 2.0**-14 + 2 * (k + 2) * 2.0**-24
        self.packed_bound_factor = 2 * (k + 2) * 2.0**-24
        self.packed_max_rows = 0
        self.qtype = None if packed is None or not gguf_op_available() else packed.qtype
        self.int16 = self.qtype in INT16_HEAD_QTYPES  # the packed pass rounds x to int16 codes
        rounding = 3 * math.sqrt(k / 32) / 32767 if self.int16 else 0.0
        self.packed_pass_factor = self.packed_bound_factor + (1 + self.packed_bound_factor) * rounding
        """The packed pass's bound per ``|x| |W_j|`` (class docstring)."""
        if self.qtype is not None:
            self.register_buffer("raw", packed.raw, persistent=False)
        w16 = weight.detach().to(torch.bfloat16)  # measured with, then kept where it is used
        self.register_buffer("weight_bf16", w16, persistent=False)
        self._w16_packed = _prepack_bf16(w16)  # oneDNN's layout of it, or None
        self.rows_min_rows, self.rows_max_rows = self._rows_range()  # the float32 head the passes are measured against
        self.bf16_max_rows = self._bf16_rows()
        if self.qtype is not None:
            self.packed_max_rows = self._packed_rows()
            if 0 < self.bf16_max_rows <= self.packed_max_rows:  # the packed pass serves every row bf16 would
                self.bf16_max_rows = 0
        if not self.bf16_max_rows:
            self._w16_packed = None
        if not self.bf16_max_rows or self._w16_packed is not None:  # eager reads the reordered copy only
            del self.weight_bf16

    def _packed(self, x: torch.Tensor) -> torch.Tensor:
        op = torch.ops.treeserve.gguf_linear if self.int16 else torch.ops.treeserve.gguf_linear_exact
        return op(x, self.raw, self.qtype, self.weight.shape[1])

    def _bf16(self, x: torch.Tensor) -> torch.Tensor:
        """The bf16 first pass, in bf16 (the re-scoring widens it): oneDNN's matmul on the weight
        reordered once at load (``_prepack_bf16``) where torch offers it, else ``F.linear``, which
        reorders the weight on every call (1.6x slower at 64 rows, 3x at 1 row on an AVX-512 EPYC;
        the same products either way)."""
        xb = x.to(torch.bfloat16)
        if self._w16_packed is not None and not _tracing():
            return torch.ops.mkldnn._linear_pointwise(xb, self._w16_packed, None, "none", [], "")
        return F.linear(xb, self.bf16_weight())

    def bf16_weight(self) -> torch.Tensor:
        """``weight`` in bf16 ``[V, K]``, made again (and kept) where only the reordered copy was kept:
        what a traced step multiplies by (``restore_dense`` calls this before compiling)."""
        if "weight_bf16" not in self._buffers:
            self.register_buffer("weight_bf16", self.weight.detach().to(torch.bfloat16), persistent=False)
        return self.weight_bf16

    def _rows_range(self) -> tuple[int, int]:
        """``(lo, hi)``: the row counts ``lo .. hi`` that ``treeserve::head_rows`` serves (every
        weight row read once for all rows; each logit the same float32 dot product whatever the
        row count), measured once per host against ``F.linear``, whose few-row GEMM re-reads or
        repacks the weight (3.6x its one-row time at 4-8 rows on an AVX2 EPYC). ``lo`` is 1 where
        it also beats the one-row GEMV (2 threads on that EPYC: 8 ms against 18), else 2;
        ``hi`` 0 when it never wins or is not built. ``TREESERVE_HEAD_ROWS_MAX_ROWS`` sets ``hi``
        (``lo`` 1)."""
        if not _rows_op_available():
            return 2, 0
        env = _env_rows("TREESERVE_HEAD_ROWS_MAX_ROWS")
        if env is not None:
            return 1, env
        shape, k = tuple(self.weight.shape), self.weight.shape[1]

        def rows(x: torch.Tensor) -> torch.Tensor:
            return torch.ops.treeserve.head_rows(x, self.weight)

        def blas(x: torch.Tensor) -> torch.Tensor:
            return F.linear(x, self.weight)

        hi = _crossover("head-rows", shape, k, torch.float32, rows, blas)
        if hi:
            return 1, hi
        return 2, _crossover("head-rows-multi", shape, k, torch.float32, rows, blas, counts=_CROSSOVER_ROWS[1:])

    def _float32(self, x: torch.Tensor) -> torch.Tensor:
        """The float32 head ``x @ W^T``: ``head_rows`` for ``rows_min_rows .. rows_max_rows`` rows
        (eager), else ``F.linear``."""
        if self.rows_min_rows <= x.shape[0] <= self.rows_max_rows and not _tracing():
            return torch.ops.treeserve.head_rows(x.contiguous(), self.weight)
        return F.linear(x, self.weight)

    def _packed_rows(self) -> int:
        """Rows up to which the packed first pass beats the head that serves the rows above it
        (the bf16 pass or the float32 head, ``bf16_max_rows``); ``TREESERVE_HEAD_PACKED_MAX_ROWS`` overrides."""
        env = _env_rows("TREESERVE_HEAD_PACKED_MAX_ROWS")
        if env is not None:
            return env
        key = (*self.weight.shape, self.qtype, self.int16, self.bf16_max_rows, self.rows_min_rows, self.rows_max_rows)
        return _crossover("head-packed-rows", key, self.weight.shape[1], torch.float32, self._packed,
                          lambda x: self._bf16(x) if x.shape[0] <= self.bf16_max_rows else self._float32(x))

    def _bf16_rows(self) -> int:
        """Rows up to which the bf16 first pass (``_bf16``) beats the float32 head (``_float32``:
        ``head_rows`` where it serves) on this machine (measured once per host per shape and thread
        count over 1 ... 128 rows, kept on disk; winning at 128
        counts for every size). Native bf16 dot products (AVX-512 BF16, AMX) win at every size, an
        AVX2 CPU at a few rows at most, and CPU contention moves it.
        ``TREESERVE_EXACT_HEAD=bf16|f32`` overrides."""
        env = os.environ.get("TREESERVE_EXACT_HEAD")
        if env is not None:
            if env not in ("bf16", "f32"):
                raise ValueError(f"TREESERVE_EXACT_HEAD must be 'bf16' or 'f32', got {env!r}")
            return _ALL_ROWS if env == "bf16" else 0
        key = (*self.weight.shape, self._w16_packed is not None, self.rows_min_rows, self.rows_max_rows)
        rows = _crossover("head-bf16-rows", key, self.weight.shape[1], torch.float32, lambda x: self._bf16(x).float(),
                          self._float32)
        return _ALL_ROWS if rows == _CROSSOVER_ROWS[-1] else rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        eager_op = not _tracing() and _rescore_op_available()
        if x.shape[0] <= self.packed_max_rows:
            approx, factor = self._packed(x), self.packed_pass_factor
        elif x.shape[0] <= self.bf16_max_rows:
            approx, factor = self._bf16(x), self.bound_factor
        elif eager_op:
            # The float32 head as a first pass too (its summation order is BLAS's; the packed bound
            # covers any order): its contenders re-scored like the other passes', so a row's greedy
            # pick comes from the same float32 dot products whatever path its step's row count takes.
            approx, factor = self._float32(x), self.packed_bound_factor
        else:
            return self._float32(x)
        if eager_op:
            out = approx if approx.dtype == torch.float32 else torch.empty(approx.shape, dtype=torch.float32)
            full = torch.ops.treeserve.exact_head_rescore(approx, out, x.contiguous(), self.weight, self.row_norms,
                                                          factor, self.max_candidates)
            self._recompute_rows(out, x, full)
            return out
        approx = approx.float()
        bound = (factor * x.norm(dim=1, keepdim=True)) * self.row_norms  # [M, V]
        if _tracing():
            return self._rescore_static(x, approx, bound)
        threshold = (approx - bound).amax(dim=1, keepdim=True)
        candidate = approx + bound >= threshold
        counts = candidate.sum(1)
        rows = self._recompute_rows(approx, x, counts > self.max_candidates)
        if rows is not None:
            candidate[rows] = False
        r, c = candidate.nonzero(as_tuple=True)
        approx[r, c] = (x[r] * self.weight[c]).sum(-1)
        return approx

    def _recompute_rows(self, approx: torch.Tensor, x: torch.Tensor, full: torch.Tensor) -> torch.Tensor | None:
        """Overwrite the rows of ``approx`` flagged in ``full`` (too many candidates) with the
        float32 head (``head_rows`` where built, whatever the number of such rows: its logits are
        the re-scoring's dot products); their indices, or None when none is flagged."""
        if not bool(full.any()):
            return None
        rows = full.nonzero()[:, 0]
        if _rows_op_available() and not _tracing():
            approx[rows] = torch.ops.treeserve.head_rows(x[rows].contiguous(), self.weight)
        else:
            approx[rows] = self._float32(x[rows])
        return rows

    def _rescore_static(self, x: torch.Tensor, approx: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
        """The re-scoring of ``forward`` with static shapes (what a whole-graph compile can trace):
        the ``max_candidates`` entries of highest upper bound per row are recomputed in float32
        (every entry the bound cannot rule out is among them unless the row has more such entries,
        which then takes the float32 head entirely, through ``torch.cond``)."""
        upper = approx + bound
        threshold = (approx - bound).amax(dim=1, keepdim=True)
        idx = upper.topk(min(self.max_candidates, upper.shape[1]), dim=1).indices  # [M, C]
        exact = torch.einsum("mk,mck->mc", x, self.weight[idx])
        out = approx.scatter(1, idx, exact)
        full = (upper >= threshold).sum(1) > idx.shape[1]
        return torch.cond(
            full.any(),
            lambda x, out, full: torch.where(full[:, None], F.linear(x, self.weight), out),
            lambda x, out, full: out.clone(),
            (x, out, full),
        )


QUANTIZATIONS = ("auto", "int4", "int8", None)
PACKABLE = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
"""The decoder projections ``pack_model`` packs (names inside a layer)."""


def check_quantization(quantization: object) -> None:
    """``ValueError`` unless ``quantization`` is one of ``QUANTIZATIONS``."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")


LARGE_TIER_MEMORY_FRACTION = 4
"""``large_tier_budget``'s default: physical memory divided by this."""


def large_tier_budget() -> int:
    """Bytes the large batches' weights of one model (``pack_model``: int8 copies at a byte per weight,
    or dense ones) may take: ``TREESERVE_LARGE_TIER_BYTES`` when set (an int >= 0; anything else is a
    ``ValueError``), else a quarter of physical memory. A model whose projections hold more weights
    than this runs its codes for every batch, as ``TREESERVE_PACKED_MAX_ROWS=all`` does (Llama-3-8B on
    a 24 GB host: the int8 tier's 7 GB bought no speed there and cost minutes at the first large
    batch, benches/RESULTS.md issue 33)."""
    env = os.environ.get("TREESERVE_LARGE_TIER_BYTES")
    if env is not None:
        if not env.isdigit():
            raise ValueError(f"TREESERVE_LARGE_TIER_BYTES must be an int >= 0, got {env!r}")
        return int(env)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // LARGE_TIER_MEMORY_FRACTION


def pack_model(
    model: nn.Module,
    planes_for: Callable[[str], Int4Planes | GGUFWeight | None],
    quantization: str | None,
    act_dtype: torch.dtype = torch.bfloat16,
    head_codes: GGUFWeight | None = None,
    unloaded: Collection[str] = (),
    source: str | None = None,
) -> nn.Module:
    """Swap ``model``'s decoder projections for ``PackedLinear`` and its head for ``ExactHead``, in place.

    ``planes_for(name)`` gives a projection's codes as shipped (e.g. ``"layers.0.mlp.down_proj"``
    of a GGUF file; the model's dense weight must be their dequantization) or None; with
    ``quantization`` ``"int4"`` / ``"int8"`` a projection without shipped codes is quantized
    from its dense weight, with ``"auto"`` it stays dense; ``None`` leaves the model as it is.
    ``head_codes``: the head's shipped blocks (its dense weight their dequantization), the
    ``ExactHead`` first pass for small batches. The packed/dense crossover is measured once per
    input width over all packed projections of that width (``measure_crossover``). CPU models
    only: others are returned as is.

    ``unloaded``: projections (names as for ``planes_for``) whose dense weight the loader never
    filled (uninitialised, untouched): their codes must be ``GGUFWeight``; they get a dense weight,
    dequantized from the codes one projection at a time, only where their large batches need one
    (no int8 copy), so a model loads without a dense copy of all its projections. Where the int8
    choice and the crossover come without timing (the measurement cache, overrides), the large
    batches' weights (int8 copies, dense weights) are built at the group's first large batch
    (``PackedLinear.prepare_large``), not here.
    ``TREESERVE_PACKED_MAX_ROWS=all``: the packed path serves every batch size, so no int8 copy is
    made and ``unloaded`` projections never hold a dense weight (the codes alone stay resident).
    A model whose projections have more weights than ``large_tier_budget()`` bytes (unless
    ``TREESERVE_INT8=1``), and a group whose dense large-batch weights (int8 not chosen) would not
    fit what is left of it, keep the codes alone too; their large batches read the same codes with
    int8 activations where that is measured faster (``use_q8_large``). So does a group whose codes,
    read with int8 activations, are measured as fast as its large-batch weights would be
    (``use_codes_large``: no copy is made).
    ``source``: the shipped codes' file (``int8_cache.source_id``): the int8 copies are kept on disk
    for it and read back at the next load (``int8_cache.int8_weight``); None: built every time.
    """
    check_quantization(quantization)
    if quantization is None or model.device.type != "cpu":
        return model
    quantizer = {"int4": quantize_int4, "int8": quantize_int8}.get(quantization)
    packed: dict[int, list[PackedLinear]] = {}
    for i, layer in enumerate(model.layers):
        for sub in PACKABLE:
            name = f"layers.{i}.{sub}"
            dense = layer.get_submodule(sub)
            codes, weight = planes_for(name), dense.weight  # shipped codes: the loader dequantized them
            shipped = codes is not None
            if codes is None and quantizer is not None:
                codes = quantizer(dense.weight)
                weight = codes.dequantize().to(dense.weight.dtype)
            if codes is None:
                continue
            new = PackedLinear(codes, None if name in unloaded else weight, dense.bias, act_dtype,
                               weight_dtype=weight.dtype)
            if shipped:  # the file's codes: the file is the int8 cache's key
                new.int8_source = (source, name)
            parent, _, attr = sub.rpartition(".")
            setattr(layer.get_submodule(parent), attr, new)
            packed.setdefault(new.in_features, []).append(new)
    budget = large_tier_budget()
    weights = sum(m.in_features * m.out_features for group in packed.values() for m in group)
    codes_only = _env_rows("TREESERVE_PACKED_MAX_ROWS") == _ALL_ROWS  # no large-batch path at all
    over_budget = weights > budget and os.environ.get("TREESERVE_INT8") != "1"  # none with weights of its own
    for group in packed.values():
        rows = _ALL_ROWS if codes_only or over_budget else None
        if rows is None:
            # The large batches' weights: none where the codes with int8 activations are as fast; else
            # the int8 copies where they pay, else the dense ones (F.linear reads them) while they fit
            # the budget; built at the group's first large batch (``prepare_large``: the crossover's
            # measurement, when it runs, is one), not now.
            if use_codes_large(group):
                rows = _ALL_ROWS
            elif use_int8(group, defer=True):
                budget -= sum(m.in_features * m.out_features for m in group)
            else:
                dense = [m for m in group if not m.has_dense]
                dense_bytes = sum(m.in_features * m.out_features * m.weight_dtype.itemsize for m in dense)
                if dense_bytes <= budget or not all(m.use_op for m in group):  # without the operator: the only path
                    _LargeWeights(dense, int8=False)
                    budget -= dense_bytes
                else:
                    rows = _ALL_ROWS  # the codes serve every batch of this group
            if rows is None:
                rows = measure_crossover(group)
        if rows == _ALL_ROWS and not codes_only:  # large batches on the codes, with int8 activations where faster
            rows = use_q8_large(group)
        for m in group:
            m.packed_max_rows = rows
            m.drop_dense()  # eager calls no longer read it
    head_weight = getattr(model.lm_head, "weight", None)  # absent: a head kept as codes (``vocab_codes``)
    if head_weight is not None and head_weight.dtype == torch.float32:
        model.lm_head = ExactHead(head_weight, packed=head_codes)
    if isinstance(model.lm_head, CodesHead) and not codes_only:
        use_q8_head(model.lm_head)
    return model
