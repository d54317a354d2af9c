"""Batch-invariant projections: every GEMM a row sees has the same shape whatever the batch.

A CPU or GPU GEMM library picks its blocking (and, for ``M = 1``, a GEMV instead of a GEMM) by
the problem's shape, so one row of ``x @ W.T`` can differ in its last bits between a batch of 1
and a batch of 2 (seen: float32 on an AVX2 EPYC, where ``M = 1`` and ``M >= 2`` differ by up to
2e-5; bf16 on AVX-512 machines). Over a few dozen tokens those bits flip a sampled token.

:func:`row_tiled` runs a row-wise function on fixed tiles of ``tile`` rows (the last tile padded
with zeros), so each call has the same ``M`` and a row's result depends only on its own values
(``tests/models/test_invariant.py`` checks that the position inside a tile does not matter
either, on the machine running the tests). :func:`make_batch_invariant` applies it to every
projection of a :class:`~treeserve.models.llama.LlamaForCausalLM` (including quantized
``PackedLinear`` ones, which then take one path, packed or dense, for every tile) and replaces an
``ExactHead`` by the plain float32 head, whose fallback rows would otherwise form a GEMM of
data-dependent height. The rest of a layer is row-wise already (RMSNorm, RoPE, SiLU-mul,
embedding); attention needs a per-request kernel (``paged_attention`` backend
``"torch_per_request"``) and sampling is per row with counter-based seeds.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from treeserve.models.quant import ExactHead

__all__ = ["DEFAULT_ROW_TILE", "make_batch_invariant", "row_tiled"]

DEFAULT_ROW_TILE = 8
_PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def row_tiled(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, tile: int) -> torch.Tensor:
    """``fn(x)`` for a row-wise ``fn`` (``[M, K] -> [M, N]``), computed on tiles of exactly ``tile`` rows.

    Pads ``x`` with zero rows up to a multiple of ``tile``, calls ``fn`` once per tile and drops
    the padding. ``ValueError`` unless ``x`` is 2-D and ``tile >= 1``.
    """
    if not isinstance(tile, int) or tile < 1:
        raise ValueError(f"tile must be an int >= 1, got {tile!r}")
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [rows, features], got shape {tuple(x.shape)}")
    m = x.shape[0]
    pad = -m % tile
    if pad:
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
    out = torch.cat([fn(part) for part in x.split(tile)]) if x.shape[0] else fn(x)
    return out[:m]


def _float32_head(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    def head(x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), weight)

    return head


def make_batch_invariant(model: nn.Module, tile: int = DEFAULT_ROW_TILE) -> nn.Module:
    """Make ``model``'s projections and LM head batch invariant (see the module doc), in place.

    ``model`` is a ``LlamaForCausalLM`` (or a model with the same ``layers[i].self_attn`` /
    ``.mlp`` projection names and ``lm_head``). Each projection's ``forward`` is wrapped by
    :func:`row_tiled` without renaming its parameters, so loaders, sharding and ``state_dict``
    see the same model. Idempotent. Returns ``model``.
    """
    if getattr(model, "batch_invariant_tile", None) is not None:
        return model
    for layer in model.layers:
        for name in _PROJECTIONS:
            owner_name, attr = name.split(".")
            owner = getattr(layer, owner_name)
            proj = getattr(owner, attr)
            proj.forward = partial(row_tiled, proj.forward, tile=tile)
    head = model.lm_head
    # An ExactHead (bf16 + float32 re-score) computes fallback rows in a GEMM whose height depends
    # on the data; the plain float32 head over the same float32 weight is exact and invariant.
    inner = _float32_head(head.weight) if isinstance(head, ExactHead) else head.forward
    head.forward = partial(row_tiled, inner, tile=tile)
    model.batch_invariant_tile = tile
    return model
