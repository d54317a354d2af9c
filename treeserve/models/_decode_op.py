"""All decoder layers of a decode step in one C++ call (``torch.ops.treeserve.decode_layers``).

The operator (``csrc/decode_layer.cpp``) runs, per layer, the same operators as the Python path
of ``LlamaForCausalLM`` (``add_rms_norm``, ``gguf_linear`` / ``gguf_linear_q8``, ``paged_decode_attention``, torch's
silu and mul, called through the dispatcher) plus RoPE and the KV store as plain loops computed
the way torch's kernels round, so its hidden states equal the Python path's bit for bit; what it
removes is ~25 small torch calls and the Python between them, per layer.

:func:`decode_plan` decides once per model whether the fast path exists (float32 CPU model whose
every projection is bias-free and either the model's ``Linear`` or a ``PackedLinear``, all
operators built); :func:`run_decode_layers` then applies it to a step when every query row of
the step is a decode query over a page list -- a decode step (one query per request), or a
verify step whose draft trees ``kvcache.query_view`` lists per query row (the pending token and
draft nodes at positions prefix_len + depth, each seeing the prefix, its ancestors and itself:
the same page lists the ``cpu`` attention backend gives the Python path) -- served by the
``cpu`` attention backend, each projection
taking the path ``PackedLinear.forward`` would (GGUF blocks up to ``packed_max_rows`` rows, counted
as ``quant.routed_rows`` counts them: a verify step's plain rows within ``quant.plain_rows``; above,
the same blocks with int8 activations where ``large_q8`` is set, else the int8 GEMM or ``F.linear``
on the dense weight; int4-plane codes only above), and Dynamo is not tracing
(the operator has a fake implementation and passes ``opcheck``, but compiled steps keep the layer
modules). Otherwise it returns ``None`` and the
caller runs its layers in Python. Slots, positions and the page table (indices in range,
``kv_indptr`` non-decreasing, last-page lengths in ``[1, page_size]``) are checked in C++ on every
call, once for all layers (host ints already: no sync).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

from treeserve._cpp import cpp_op_loader, load_cpp_op
from treeserve.kvcache import AttentionMetadata, KVPool, query_view
from treeserve.kvcache.backends import select_backend
from treeserve.models._norm_op import load_norm_op
from treeserve.models.gguf_op import load_gguf_linear_op
from treeserve.models.int8_op import Int8Weight
from treeserve.models.quant import PackedLinear, routed_rows

__all__ = ["DecodePlan", "SOURCE", "decode_plan", "load_decode_op", "run_decode_layers"]

SOURCE = Path(__file__).with_name("csrc") / "decode_layer.cpp"
_PROJS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def _fake(h, rope_table, positions, norms, projs, qtypes, k_caches, v_caches, out_slots, kv_indptr,  # type: ignore[no-untyped-def]
          kv_page_indices, kv_last_page_len, num_heads, num_kv_heads, eps, scale):
    """Output shape and dtype for tracing: ``h``'s (the caches are mutated in place)."""
    return torch.empty_like(h)


@cpp_op_loader
def load_decode_op() -> str | None:
    """Build (first time on this host) and load the operator and the three it calls; ``None``
    when all are usable, else the first reason one is not (the Python path then serves)."""
    for load in (load_gguf_linear_op, load_norm_op):
        reason = load()
        if reason is not None:
            return reason
    try:  # the C++ decode attention operator, built and loaded by its backend
        select_backend("paged_attention", "cpu", torch.device("cpu"), torch.float32)
    except ValueError as exc:
        return str(exc)
    return load_cpp_op(SOURCE, "decode_layers", "C++ fused decode layers", _fake)


class _Proj(NamedTuple):
    """One projection as ``PackedLinear.forward`` would run it: packed (``raw`` GGUF blocks, when
    not None) for up to ``max_rows`` rows, else its large-batch operands (``_large``): the int8 GEMM
    or ``F.linear`` on the dense float32 weight of ``packed`` (a ``PackedLinear``, which builds
    them at its first large batch), or on ``weight`` (the model's plain linear)."""

    raw: torch.Tensor | None
    qtype: str | None
    max_rows: int
    packed: PackedLinear | None = None
    weight: torch.Tensor | None = None


class DecodePlan(NamedTuple):
    """A model's per-layer operands for ``decode_layers``, gathered once; ``variants`` memoizes
    the operand lists per pattern of packed/dense choices (row count vs each ``max_rows``)."""

    norms: list[torch.Tensor]
    projs: list[_Proj]
    thresholds: tuple[int, ...]
    num_heads: int
    num_kv_heads: int
    eps: float
    scale: float
    variants: dict[tuple[bool, ...], tuple[list[torch.Tensor], list[str]] | None]


def _proj(module: nn.Module, dense_type: type[nn.Module]) -> _Proj | None:
    """How ``module`` multiplies (see ``_Proj``), or None when the operator cannot (bias, other
    module types, a weight that is not float32 on CPU)."""
    if getattr(module, "bias", True) is not None or "forward" in vars(module):  # e.g. batch-invariant row tiles
        return None
    if type(module) is dense_type:
        weight = module.weight
        return _Proj(None, None, 0, weight=weight) if _float32_cpu(weight) else None
    if not isinstance(module, PackedLinear) or module.weight_dtype != torch.float32:
        return None
    if module.has_dense and not _float32_cpu(module.weight):
        return None
    if module.qtype is None:  # Int4Planes: torch's int4 kernel, not in the operator
        return _Proj(None, None, module.packed_max_rows, module)
    if not module.use_op:  # packed_forward is large_forward's dense path
        return _Proj(None, None, 0, module)
    return _Proj(module.raw, module.qtype, module.packed_max_rows, module)


def _float32_cpu(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.device.type == "cpu"


def decode_plan(layers: Sequence[nn.Module], dense_type: type[nn.Module]) -> DecodePlan | None:
    """The plan for ``layers`` (``DecoderLayer`` modules), or ``None`` when the fused operator
    cannot serve them: not float32 on CPU, a projection with a bias or that is neither a
    ``dense_type`` (the model's ``x @ weight.T`` module) nor a ``PackedLinear``, or an operator that
    does not build. Qwen3's per-head query / key norms follow the layer norms in ``norms``."""
    if not layers:
        return None
    eps = layers[0].input_layernorm.eps
    attn = layers[0].self_attn
    heads = (attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scale)
    norms: list[torch.Tensor] = []
    projs: list[_Proj] = []
    for layer in layers:
        a = layer.self_attn
        if (a.num_heads, a.num_kv_heads, a.head_dim, a.scale) != heads:
            return None
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            if norm.weight.dtype != torch.float32 or norm.weight.device.type != "cpu" or norm.eps != eps:
                return None
            norms.append(norm.weight)
        for name in _PROJS:
            proj = _proj(layer.get_submodule(name), dense_type)
            if proj is None:
                return None
            projs.append(proj)
    # Qwen3's per-head query / key norms: after the 2L layer norms, each layer's q_norm and k_norm
    qk = [n for layer in layers for n in (layer.self_attn.q_norm, layer.self_attn.k_norm) if n is not None]
    if qk and (len(qk) != 2 * len(layers) or any(
            n.weight.dtype != torch.float32 or n.weight.device.type != "cpu" or n.eps != eps for n in qk)):
        return None
    norms += [n.weight for n in qk]
    if load_decode_op() is not None:
        return None
    thresholds = tuple(sorted({p.max_rows for p in projs}))
    return DecodePlan(norms, projs, thresholds, attn.num_heads, attn.num_kv_heads, eps, attn.scale, {})


def _operands(plan: DecodePlan, rows: int) -> tuple[list[torch.Tensor], list[str]] | None:
    """The projection operands for a step of ``rows`` rows (None: a projection would take a
    packed path the operator lacks)."""
    key = tuple(rows <= t for t in plan.thresholds)
    if key not in plan.variants:
        tensors: list[torch.Tensor] = []
        qtypes: list[str] = []
        for p in plan.projs:
            packed = rows <= p.max_rows
            if packed and p.raw is None:
                plan.variants[key] = None
                break
            if packed:
                tensors.append(p.raw)
                qtypes.append(p.qtype)
                continue
            if p.packed is not None and p.packed.large_q8:  # the codes with int8 activations
                tensors.append(p.packed.raw)
                qtypes.append(f"q8:{p.qtype}")
                continue
            int8, weight = _large(p)
            if int8 is not None:
                tensors.extend(int8.operands)
                qtypes.append("int8")
            else:
                assert weight is not None  # only an int8 projection drops its dense weight
                tensors.append(weight)
                qtypes.append("dense")
        else:
            plan.variants[key] = (tensors, qtypes)
    return plan.variants[key]


def _large(p: _Proj) -> tuple[Int8Weight | None, torch.Tensor | None]:
    """A projection's large-batch operands: its int8 copy, else its dense weight (a
    ``PackedLinear``'s built now if it defers them: ``prepare_large``)."""
    if p.packed is None:
        return None, p.weight
    p.packed.prepare_large()
    return p.packed.int8, p.packed.weight if p.packed.has_dense else None


def _needs_grad(plan: DecodePlan, h: torch.Tensor, projs: list[torch.Tensor]) -> bool:
    return h.requires_grad or any(t.requires_grad for t in plan.norms) or any(t.requires_grad for t in projs)


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
        n != meta.num_qo_tokens
        or torch.compiler.is_compiling()
        or h.dtype != torch.float32
        or kv.k_caches[0].dtype not in (torch.float32, torch.bfloat16, torch.float16)
        or kv.k_caches[0].shape[1] != meta.page_size
    ):
        return None
    operands = _operands(plan, routed_rows(n))
    if operands is None or (torch.is_grad_enabled() and _needs_grad(plan, h, operands[0])):
        return None  # the operator has no autograd formula: differentiable calls stay in Python
    kernel = meta.attention_backend or select_backend("paged_attention", "auto", h.device, kv.k_caches[0].dtype)
    if kernel.name != "cpu":
        return None
    if n == meta.batch_size:  # a decode step: one query per request
        indices = (meta.kv_indptr.int(), meta.kv_page_indices.int(), meta.kv_last_page_len.int())  # int32: no copy
    else:  # a verify step (or short chunks): each query row over its own page list
        view = query_view(meta)
        if view is None or not view.covers_all:
            return None
        indices = (view.kv_indptr, view.kv_page_indices, view.kv_last_page_len)
    return torch.ops.treeserve.decode_layers(
        h, rope_table, positions, plan.norms, *operands, kv.k_caches, kv.v_caches, out_slots,
        *indices, plan.num_heads, plan.num_kv_heads, plan.eps, plan.scale,
    )
