"""``torch.compile`` of the model forward, with compile time and compile count reported.

The decode graph runner pads every step to a batch-size bucket, so the compiled code sees one
set of shapes per bucket. The forward is compiled with ``dynamic=True`` all the same: the torch
attention backend reads KV lengths on the host (a graph break), and with static compilation the
resumed code would be specialized on those integers, recompiling at almost every step. Dynamic
compilation treats them (and the batch dimension) as symbols from the first compile, so steps
reuse the compiled code; the recompile limit is raised so a few special cases (size 1) fit too.
"""

from __future__ import annotations

import importlib
import time

import torch

from treeserve.kvcache import AttentionMetadata, KVPool

__all__ = ["CompiledForward", "compile_model"]

_RECOMPILE_LIMIT = 64
"""Compiled entries allowed per frame (Dynamo's default, 8, is easily reached by the resumed
frames after graph breaks once buckets 1, 2 and larger ones specialize differently)."""


class CompiledForward:
    """Callable with the model forward's signature, running ``torch.compile(model)``.

    ``compile_seconds`` sums the wall time of calls during which Dynamo compiled a new graph;
    ``num_compiles`` counts those graphs. ``config`` is the model's.
    """

    def __init__(self, model: torch.nn.Module, backend: str = "inductor", mode: str | None = None) -> None:
        self.model = model
        self.config = getattr(model, "config", None)
        self.backend = backend
        self._compiled = torch.compile(model, backend=backend, mode=mode, dynamic=True)
        # Dynamo is imported here, not at module level: importing it costs ~3 s of every start.
        self._dynamo = importlib.import_module("torch._dynamo")
        self._counters = importlib.import_module("torch._dynamo.utils").counters
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
        counters = self._counters
        before = counters["stats"]["unique_graphs"]
        t0 = time.perf_counter()
        with self._dynamo.config.patch(recompile_limit=_RECOMPILE_LIMIT):
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
