"""``torch.compile`` of the model forward, with compile time and compile count reported.

The forward is compiled with static shapes (``dynamic=False``): the decode graph runner pads every
step to a batch-size bucket, so each bucket compiles once and later steps of any batch size
inside it reuse that code. The recompile limit is raised to cover one entry per bucket.
"""

from __future__ import annotations

import time

import torch
import torch._dynamo
from torch._dynamo.utils import counters

from treeserve.kvcache import AttentionMetadata, KVPool

__all__ = ["CompiledForward", "compile_model"]

_RECOMPILE_LIMIT = 64
"""Compiled entries allowed per frame: >= the number of decode buckets (35 up to batch 256)."""


class CompiledForward:
    """Callable with the model forward's signature, running ``torch.compile(model)``.

    ``compile_seconds`` sums the wall time of calls during which Dynamo compiled a new graph (the
    first call of each bucket); ``num_compiles`` counts those graphs. ``config`` is the model's.
    """

    def __init__(self, model: torch.nn.Module, backend: str = "inductor", mode: str | None = None) -> None:
        self.model = model
        self.config = getattr(model, "config", None)
        self.backend = backend
        self._compiled = torch.compile(model, backend=backend, mode=mode, dynamic=False)
        self.compile_seconds = 0.0
        self.num_compiles = 0

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv: KVPool,
        out_slots: torch.Tensor,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        before = counters["stats"]["unique_graphs"]
        t0 = time.perf_counter()
        with torch._dynamo.config.patch(recompile_limit=_RECOMPILE_LIMIT):
            out = self._compiled(input_ids, positions, kv, out_slots, meta, logits_indices)
        new_graphs = counters["stats"]["unique_graphs"] - before
        if new_graphs:
            self.compile_seconds += time.perf_counter() - t0
            self.num_compiles += new_graphs
        return out


def compile_model(model: torch.nn.Module, backend: str = "inductor", mode: str | None = None) -> CompiledForward:
    """``model``'s forward compiled by ``torch.compile(backend=backend, mode=mode)`` (lazily, per shape)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    return CompiledForward(model, backend, mode)
