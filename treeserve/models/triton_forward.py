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
resident for them (the bf16 copy adds ``2 V K`` bytes of memory).

:func:`uses_triton_layers` decides per call: ``model.layer_kernels`` ``"auto"`` (the default)
picks this path on CUDA when Triton is usable, the model is not batch-invariant and Dynamo is
not tracing (a compiled forward keeps the torch path for inductor to fuse); ``"triton"`` forces
it (on CPU under ``TRITON_INTERPRET=1``, how the tests run it), ``"torch"`` turns it off.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch.utils.weak import WeakIdKeyDictionary

from treeserve._utils import triton_usable
from treeserve.kvcache import AttentionMetadata, KVPool, debug_checks_enabled, paged_attention

__all__ = ["LAYER_KERNELS", "TritonHead", "triton_forward", "uses_triton_layers"]

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


@dataclass(frozen=True, slots=True)
class TritonHead:
    """The bf16 exact head of a float32 ``weight [V, K]`` (see the module docstring): the weight,
    its bf16 copy and its row norms (float32, computed in float64), made by :meth:`of`."""

    weight: torch.Tensor
    weight_bf16: torch.Tensor
    row_norms: torch.Tensor
    factor: float
    key: tuple[int, int, torch.device]

    @staticmethod
    def key_of(weight: torch.Tensor) -> tuple[int, int, torch.device]:
        """What the derived copies depend on: the weight's storage, version and device."""
        return weight.data_ptr(), weight._version, weight.device

    @classmethod
    def of(cls, weight: torch.Tensor) -> TritonHead:
        """The head of ``weight`` (float32 ``[V, K]``, contiguous; ``TypeError`` / ``ValueError``)."""
        if weight.dtype != torch.float32:
            raise TypeError(f"weight must be float32, got {weight.dtype}")
        if weight.dim() != 2 or not weight.is_contiguous():
            raise ValueError(f"weight must be a contiguous [V, K], got {tuple(weight.shape)}")
        w = weight.detach()
        norms = torch.cat([rows.double().norm(dim=1) for rows in w.split(_NORM_ROWS)]).float()
        return cls(w, w.to(torch.bfloat16), norms, _kernels().head_bound_factor(w.shape[1]), cls.key_of(weight))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """float32 logits ``[M, V]`` of ``x [M, K]`` (float32 or bfloat16)."""
        x, ops = x.contiguous(), _kernels()
        approx, partial, xnorm = ops.head_bf16_triton(x, self.weight_bf16, self.row_norms, self.factor)
        return ops.head_rescore_triton(x, self.weight, self.row_norms, approx, partial, xnorm, self.factor)


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
        q = ops.rope_store_triton(attn.qkv_proj(x), model.rope_cache, positions, out_slots, k_cache, v_cache,
                                  attn.num_heads, attn.num_kv_heads)
        o = paged_attention(q, k_cache, v_cache, meta, scale=attn.scale).to(x.dtype)
        norm = layer.post_attention_layernorm
        attn_out = attn.o_proj(o.reshape(o.shape[0], attn.q_size))
        residual, x = ops.add_rms_norm_triton(attn_out, residual, norm.weight, norm.eps)
        h = mlp.down_proj(ops.silu_mul_triton(mlp.gate_up_proj(x)))
    _, x = ops.add_rms_norm_triton(h, residual, model.norm.weight, model.norm.eps, rows=logits_indices)
    head = _head(model)
    return head(x) if head is not None else model.lm_head(x.float())
