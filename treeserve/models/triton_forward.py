"""The forward of ``LlamaForCausalLM`` on CUDA: hand-fused Triton kernels per layer, a bf16 exact head.

The torch path of a decoder layer launches 14 small kernels besides its four GEMMs and its
attention (two norms, two residual adds, five for RoPE, two contiguous copies and the KV store,
SiLU, the multiply). Here a layer is::

    add_rms_norm (the previous layer's residual add folded in) -> qkv GEMM -> rope_store (RoPE on
    q and k, k and v stored at their slots) -> attention -> o GEMM -> add_rms_norm -> gate|up GEMM
    -> silu_mul -> down GEMM

8 kernels plus the attention backend's (``tests/models/test_kernel_counts.py`` counts them). The
residual stream is carried between layers as ``(h, residual)`` and added inside the next norm, so
each addition rounds where the torch path's does; bf16 outputs equal the torch path's bit for bit
(under the interpreter with the GPU's rounding), float32 ones to a few ulps (sums in another order).

The head (``TritonHead``), used when the model's ``lm_head`` is the plain float32 ``Linear``:
``x`` and ``W`` rounded to bf16, products accumulated in float32 (``_triton_layers``), then every
vocabulary entry ``j`` whose upper bound ``approx_j + F |x| |W_j|`` reaches the row's largest lower
bound ``max_i (approx_i - F |x| |W_i|)`` is recomputed in float32 from the float32 weight
(``F = head_bound_factor(K)``, a rigorous bound), so the argmax is the float32 head's (up to the
float32 rounding between two float32 evaluations of one dot product), with no host sync and any
number of candidates. Other logits are within the bound of the float32 head's. It reads the bf16
copy (half the float32 bytes) plus the float32 rows of the few candidates; the float32 weight stays
resident for them (the bf16 copy adds ``2 V K`` bytes of memory). Where the float32 head itself is
faster (few rows; a small head), it serves instead: the row counts from which the bf16 pass pays are
timed once on the GPU when the head is made (``TritonHead.of``); with no such count the bf16 copy is
not kept.

:func:`uses_triton_layers` decides per call: ``model.layer_kernels`` ``"auto"`` (the default)
picks this path on CUDA when Triton is usable, the model is not batch-invariant and Dynamo is
not tracing (a compiled forward keeps the torch path for inductor to fuse); ``"triton"`` forces
it (on CPU under ``TRITON_INTERPRET=1``, how the tests run it), ``"torch"`` turns it off. Qwen3's
per-head query / key norms run inside the RoPE-and-store kernel, before the rotation.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

from treeserve._utils import triton_usable
from treeserve.kvcache import AttentionMetadata, KVPool, debug_checks_enabled, paged_attention

__all__ = ["HEAD_MEASURED_ROWS", "LAYER_KERNELS", "TritonHead", "bf16_min_rows", "triton_forward", "uses_triton_layers"]

LAYER_KERNELS = ("auto", "torch", "triton")
_NORM_ROWS = 8192


def _kernels():  # type: ignore[no-untyped-def]
    """``models._triton_layers``, imported on first use: importing triton costs ~0.4 s, which a
    CPU engine's start never pays."""
    import treeserve.models._triton_layers as kernels

    return kernels


def uses_triton_layers(model: torch.nn.Module) -> bool:
    """Whether ``model``'s forward takes this module's path now (see the module docstring);
    ``TREESERVE_LAYER_KERNELS`` (``torch`` / ``triton``) overrides a model left at ``"auto"``.

    ``ValueError`` for a ``layer_kernels`` outside ``LAYER_KERNELS``, or ``"triton"`` where Triton
    cannot run (a CPU model without ``TRITON_INTERPRET=1``).
    """
    choice = model.layer_kernels
    if choice == "auto":
        choice = os.environ.get("TREESERVE_LAYER_KERNELS", "auto")
    if choice not in LAYER_KERNELS:
        raise ValueError(f"layer_kernels (or TREESERVE_LAYER_KERNELS) must be one of {LAYER_KERNELS}, got {choice!r}")
    if choice == "torch" or torch.compiler.is_compiling():
        return False
    device = model.device
    if choice == "triton":
        if not triton_usable(device):
            raise ValueError(f"layer_kernels='triton' needs a CUDA model or TRITON_INTERPRET=1 (device {device})")
        return True
    return device.type == "cuda" and triton_usable(device) and getattr(model, "batch_invariant_tile", None) is None


HEAD_MEASURED_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
"""Row counts at which a CUDA ``TritonHead`` times its two passes when it is made."""


def bf16_min_rows(rows: Sequence[int], float32_seconds: Sequence[float], bf16_seconds: Sequence[float]) -> int | None:
    """The smallest of the (increasing) measured ``rows`` from which the bf16 exact head was no
    slower than the float32 head at every larger measured count; None when it was slower at the
    largest (the float32 head then serves every row count). ``ValueError`` for lists of unequal
    length or rows that do not increase."""
    if not len(rows) == len(float32_seconds) == len(bf16_seconds) or list(rows) != sorted(set(rows)):
        raise ValueError(f"rows must increase and match the timings, got {list(rows)}, "
                         f"{len(float32_seconds)} and {len(bf16_seconds)} timings")
    start = None
    for m, f32, b16 in reversed(list(zip(rows, float32_seconds, bf16_seconds))):
        if b16 > f32:
            break
        start = m
    return start


def _event_seconds(fn: Callable[[], object], reps: int = 3) -> float:
    """Best GPU time of ``fn`` over ``reps`` calls after one warm-up (CUDA events)."""
    fn()
    best = float("inf")
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return best


@dataclass(frozen=True, slots=True)
class TritonHead:
    """The exact head of a float32 ``weight [V, K]`` (see the module docstring): the weight, its
    bf16 copy and its row norms (float32, computed in float64), made by :meth:`of`.

    A call with fewer than ``bf16_min_rows`` rows (every call when it is None) is the float32
    head itself (``F.linear``); the others take the bf16 pass and the re-scoring. On CUDA
    :meth:`of` times both at ``HEAD_MEASURED_ROWS`` (H100, 2026-12-06: at Llama-3-8B's head the
    bf16 pass was 0.83x the float32 head at 1 row and 1.72x at 64; at SmolLM2's it lost at both).
    Either way the row's argmax is the float32 head's (up to float32 rounding between two float32
    evaluations of one dot product)."""

    weight: torch.Tensor
    weight_bf16: torch.Tensor | None
    row_norms: torch.Tensor
    factor: float
    key: tuple[int, int, torch.device]
    bf16_min_rows: int | None = 1

    @staticmethod
    def key_of(weight: torch.Tensor) -> tuple[int, int, torch.device]:
        """What the derived copies depend on: the weight's storage, version and device."""
        return weight.data_ptr(), weight._version, weight.device

    @classmethod
    def of(cls, weight: torch.Tensor, bf16_min_rows: int | None | str = "measure") -> TritonHead:
        """The head of ``weight`` (float32 ``[V, K]``, contiguous; ``TypeError`` / ``ValueError``).

        ``bf16_min_rows``: ``"measure"`` (the default) times both passes on CUDA (outside a graph
        capture; elsewhere, or while capturing, it is 1: the bf16 pass for every row count, as the
        interpreter tests run it); an int >= 1 or None sets it."""
        if weight.dtype != torch.float32:
            raise TypeError(f"weight must be float32, got {weight.dtype}")
        if weight.dim() != 2 or not weight.is_contiguous():
            raise ValueError(f"weight must be a contiguous [V, K], got {tuple(weight.shape)}")
        if bf16_min_rows != "measure" and bf16_min_rows is not None and (
                isinstance(bf16_min_rows, bool) or not isinstance(bf16_min_rows, int) or bf16_min_rows < 1):
            raise ValueError(f"bf16_min_rows must be 'measure', None or an int >= 1, got {bf16_min_rows!r}")
        w = weight.detach()
        norms = torch.cat([rows.double().norm(dim=1) for rows in w.split(_NORM_ROWS)]).float()
        # With no row count for the bf16 pass its copy would never be read: not made when None is given,
        # dropped when the measurement finds none.
        bf16 = None if bf16_min_rows is None else w.to(torch.bfloat16)
        head = cls(w, bf16, norms, _kernels().head_bound_factor(w.shape[1]), cls.key_of(weight))
        if bf16_min_rows == "measure":
            measurable = w.is_cuda and not torch.cuda.is_current_stream_capturing()
            bf16_min_rows = head._measure() if measurable else 1
        return replace(head, weight_bf16=None if bf16_min_rows is None else head.weight_bf16,
                       bf16_min_rows=bf16_min_rows)

    def _measure(self) -> int | None:
        """:func:`bf16_min_rows` of both passes timed on this GPU. The rows are vocabulary rows of
        the weight, scaled: peaked logits, as a trained model's, whose re-scoring has few
        candidates (random rows would re-score most of the vocabulary)."""
        gen = torch.Generator(device=self.weight.device).manual_seed(0)
        picked = self.weight[torch.randint(0, self.weight.shape[0], (HEAD_MEASURED_ROWS[-1],), generator=gen,
                                           device=self.weight.device)]
        x = 8 * picked / picked.norm(dim=1, keepdim=True).clamp_min(1e-6)
        f32 = [_event_seconds(lambda m=m: F.linear(x[:m], self.weight)) for m in HEAD_MEASURED_ROWS]
        b16 = [_event_seconds(lambda m=m: self._bf16_exact(x[:m])) for m in HEAD_MEASURED_ROWS]
        return bf16_min_rows(HEAD_MEASURED_ROWS, f32, b16)

    def _bf16_exact(self, x: torch.Tensor) -> torch.Tensor:
        ops = _kernels()
        approx, partial, xnorm = ops.head_bf16_triton(x, self.weight_bf16, self.row_norms, self.factor)
        return ops.head_rescore_triton(x, self.weight, self.row_norms, approx, partial, xnorm, self.factor)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """float32 logits ``[M, V]`` of ``x [M, K]`` (float32 or bfloat16)."""
        k = self.weight.shape[1]
        if x.dim() != 2 or x.shape[1] != k:
            raise ValueError(f"x must be [N, {k}], got shape {tuple(x.shape)}")
        if self.bf16_min_rows is None or x.shape[0] < self.bf16_min_rows:
            return F.linear(x.float(), self.weight)
        return self._bf16_exact(x.contiguous())


def _head(model: torch.nn.Module) -> TritonHead | None:
    """``model``'s ``TritonHead`` (made on first use, remade when the head's weight changes), or
    None when its head is not a plain float32 linear map (it then runs as it is)."""
    weight = model.plain_head_weight
    if weight is None:
        return None
    cached = _HEADS.get(weight)
    if cached is None or cached.key != TritonHead.key_of(weight):
        cached = _HEADS[weight] = TritonHead.of(weight)
    return cached


_HEADS: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""``TritonHead`` per head weight: shared by models sharing the weight (``truncated_copy``), freed with it."""


def _check_values(positions: torch.Tensor, out_slots: torch.Tensor, positions_bound: int, slots_bound: int) -> None:
    """Positions and slots in range (a host read: only with debug checks on, never while capturing)."""
    if not debug_checks_enabled() or not positions.numel():
        return
    if positions.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    for name, t, hi in (("positions", positions, positions_bound), ("out_slots", out_slots, slots_bound)):
        lo_v, hi_v = (int(v) for v in torch.aminmax(t))
        if lo_v < 0 or hi_v >= hi:
            raise ValueError(f"{name} must lie in [0, {hi}), got values in [{lo_v}, {hi_v}]")


def triton_forward(model: torch.nn.Module, input_ids: torch.Tensor, positions: torch.Tensor, kv: KVPool,
                   out_slots: torch.Tensor, meta: AttentionMetadata, logits_indices: torch.Tensor) -> torch.Tensor:
    """``model.forward`` (same contract) through the fused kernels; inputs' shapes already checked."""
    k0, ops = kv.k_caches[0], _kernels()
    _check_values(positions, out_slots, model.rope_cache.shape[0], k0.shape[0] * k0.shape[1])
    h = model.embed_tokens(input_ids).to(model.dtype)
    residual = None
    for layer, k_cache, v_cache in zip(model.layers, kv.k_caches, kv.v_caches):
        attn, mlp = layer.self_attn, layer.mlp
        residual, x = ops.add_rms_norm_triton(h, residual, layer.input_layernorm.weight, layer.input_layernorm.eps)
        qn, kn = attn.q_norm, attn.k_norm  # Qwen3's per-head norms, or None
        q = ops.rope_store_triton(attn.qkv_proj(x), model.rope_cache, positions, out_slots, k_cache, v_cache,
                                  attn.num_heads, attn.num_kv_heads, None if qn is None else qn.weight,
                                  None if kn is None else kn.weight, 1e-6 if qn is None else qn.eps)
        o = paged_attention(q, k_cache, v_cache, meta, scale=attn.scale).to(x.dtype)
        norm = layer.post_attention_layernorm
        attn_out = attn.o_proj(o.reshape(o.shape[0], attn.q_size))
        residual, x = ops.add_rms_norm_triton(attn_out, residual, norm.weight, norm.eps)
        h = mlp.down_proj(ops.silu_mul_triton(mlp.gate_up_proj(x)))
    _, x = ops.add_rms_norm_triton(h, residual, model.norm.weight, model.norm.eps, rows=logits_indices)
    head = _head(model)
    return head(x) if head is not None else model.lm_head(x.float())
