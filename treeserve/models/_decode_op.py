"""All decoder layers of a decode step in one C++ call (``torch.ops.treeserve.decode_layers``).

The operator (``csrc/decode_layer.cpp``) runs, per layer, the same operators as the Python path
of ``LlamaForCausalLM`` (``add_rms_norm``, ``gguf_linear``, ``paged_decode_attention``, torch's
silu and mul, called through the dispatcher) plus RoPE and the KV store as plain loops computed
the way torch's kernels round, so its hidden states equal the Python path's bit for bit; what it
removes is ~25 small torch calls and the Python between them, per layer.

:func:`decode_plan` decides once per model whether the fast path exists (float32 CPU model whose
every projection is a bias-free GGUF ``PackedLinear`` served by the C++ operator, all operators
built); :func:`run_decode_layers` then applies it to a step when the step is a pure decode step
(one query per request), small enough for the packed path, served by the ``cpu`` attention
backend, and Dynamo is not tracing (the operator has a fake implementation and passes
``opcheck``, but compiled steps keep the layer modules). Otherwise it returns ``None`` and the
caller runs its layers in Python. Slots and positions are range-checked in C++ on every call;
with ``TREESERVE_DEBUG_CHECKS=1`` the page indices are too, once per step (as ``paged_attention``).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

from treeserve._cpp import load_cpp_op
from treeserve.kvcache import AttentionMetadata, KVPool
from treeserve.kvcache.backends import select_backend
from treeserve.kvcache._checks import check_range, debug_checks_enabled
from treeserve.kvcache._cpu_op import load_cpu_decode_op
from treeserve.models._norm_op import load_norm_op
from treeserve.models.gguf_op import load_gguf_linear_op

__all__ = ["DecodePlan", "SOURCE", "decode_plan", "load_decode_op", "run_decode_layers"]

SOURCE = Path(__file__).with_name("csrc") / "decode_layer.cpp"
_PROJS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def _fake(h, rope_table, positions, norms, projs, qtypes, k_caches, v_caches, out_slots, kv_indptr,  # type: ignore[no-untyped-def]
          kv_page_indices, kv_last_page_len, num_heads, num_kv_heads, eps, scale):
    """Output shape and dtype for tracing: ``h``'s (the caches are mutated in place)."""
    return torch.empty_like(h)


@lru_cache(maxsize=1)
def load_decode_op() -> str | None:
    """Build (first time on this host) and load the operator and the three it calls; ``None``
    when all are usable, else the first reason one is not (the Python path then serves)."""
    for load in (load_gguf_linear_op, load_norm_op, load_cpu_decode_op):
        reason = load()
        if reason is not None:
            return reason
    return load_cpp_op(SOURCE, "decode_layers", "C++ fused decode layers", _fake)


class DecodePlan(NamedTuple):
    """A model's per-layer operands for ``decode_layers``, gathered once."""

    norms: list[torch.Tensor]
    projs: list[torch.Tensor]
    qtypes: list[str]
    max_rows: int
    num_heads: int
    num_kv_heads: int
    eps: float
    scale: float


def decode_plan(layers: Sequence[nn.Module], num_heads: int, num_kv_heads: int) -> DecodePlan | None:
    """The plan for ``layers`` (``DecoderLayer`` modules), or ``None`` when the fused operator
    cannot serve them: not float32 on CPU, a projection that is not a bias-free GGUF
    ``PackedLinear`` using the C++ operator, or an operator that does not build."""
    norms: list[torch.Tensor] = []
    projs: list[torch.Tensor] = []
    qtypes: list[str] = []
    max_rows = None
    for layer in layers:
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            if norm.weight.dtype != torch.float32 or norm.weight.device.type != "cpu" or norm.eps != layers[0].input_layernorm.eps:
                return None
            norms.append(norm.weight)
        for name in _PROJS:
            proj = layer.get_submodule(name)
            if getattr(proj, "qtype", None) is None or not proj.use_op or proj.bias is not None:
                return None
            projs.append(proj.raw)
            qtypes.append(proj.qtype)
            max_rows = proj.packed_max_rows if max_rows is None else min(max_rows, proj.packed_max_rows)
    if not layers or not max_rows or load_decode_op() is not None:
        return None
    attn = layers[0].self_attn
    return DecodePlan(norms, projs, qtypes, max_rows, num_heads, num_kv_heads, layers[0].input_layernorm.eps, attn.scale)


def run_decode_layers(
    plan: DecodePlan,
    h: torch.Tensor,
    rope_table: torch.Tensor,
    positions: torch.Tensor,
    kv: KVPool,
    out_slots: torch.Tensor,
    meta: AttentionMetadata,
) -> torch.Tensor | None:
    """Every layer of the step through the operator, or ``None`` when the step is not one it
    serves (see module): then nothing was written."""
    n = h.shape[0]
    if (
        n > plan.max_rows
        or n != meta.num_qo_tokens
        or meta.num_qo_tokens != meta.batch_size
        or torch.compiler.is_compiling()
        or h.dtype != torch.float32
        or kv.k_caches[0].dtype != torch.float32
        or kv.k_caches[0].shape[1] != meta.page_size
    ):
        return None
    kernel = meta.attention_backend or select_backend("paged_attention", "auto", h.device, h.dtype)
    if kernel.name != "cpu":
        return None
    key = ("pages_checked", kv.k_caches[0].shape[0])
    if debug_checks_enabled() and key not in meta.derived:  # as paged_attention: once per step
        check_range("kv_page_indices", meta.kv_page_indices, 0, kv.k_caches[0].shape[0])
        meta.derived[key] = True
    indices = meta.derived.get("decode_layers_int32")
    if indices is None:  # once per step, shared with nothing else
        indices = meta.derived["decode_layers_int32"] = tuple(
            t.int() for t in (meta.kv_indptr, meta.kv_page_indices, meta.kv_last_page_len)
        )
    return torch.ops.treeserve.decode_layers(
        h, rope_table, positions, plan.norms, plan.projs, plan.qtypes, kv.k_caches, kv.v_caches, out_slots,
        *indices, plan.num_heads, plan.num_kv_heads, plan.eps, plan.scale,
    )
