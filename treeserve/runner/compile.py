"""``torch.compile`` of the model forward, with compile time and compile count reported.

The decode graph runner (``treeserve.runner.graph``) pads every step to a batch-size bucket and
keeps its step inputs in buffers that never change shape (the attention metadata is sized for
every request at full context), so the compiled code sees one set of shapes per bucket. Where
the forward traces without a graph break (the CPU path: the C++ decode-attention operator reads
its lengths from tensors; backends are plain dict lookups), it is compiled **static and whole**
(``fullgraph=True, dynamic=False``): RMSNorm, residual adds, RoPE and SiLU-mul fused into
generated C++ loops, one graph per bucket, no Python between the layers. Inductor *freezing*
(weights as prepacked constants) is not used: it bypasses the AOT-autograd cache, so a warm
start took 16 s instead of 7 s on the 2-core EPYC (bucket 1, SmolLM2-135M). Where it does not (Dynamo raises
``Unsupported`` or a data-dependent ``UserError`` on the first call: e.g. a backend that reads lengths on the host), the forward
falls back, once and logged, to ``dynamic=True`` with graph breaks: the resumed frames treat the
batch size and host-read lengths as symbols rather than recompiling per value.

Compiled artifacts are cached on disk by inductor's FX-graph cache (``TORCHINDUCTOR_CACHE_DIR``,
on by default), so a second start with the same model and buckets skips code generation.
"""

from __future__ import annotations

import importlib
import time

import torch

from treeserve._utils import log_once
from treeserve.kvcache import AttentionMetadata, KVPool
from treeserve.models.quant import restore_dense

__all__ = ["CompiledForward", "compile_model"]

_RECOMPILE_LIMIT = 64
"""Compiled entries allowed per frame (Dynamo's default, 8, is easily reached by the resumed
frames after graph breaks once buckets 1, 2 and larger ones specialize differently; the static
path needs one per bucket)."""


class CompiledForward:
    """Callable with the model forward's signature, running ``torch.compile(model)``.

    ``static`` starts ``True`` (whole-graph, static-shape, frozen compile) and turns ``False`` if
    Dynamo cannot trace the forward without a graph break (then the dynamic compile serves).
    ``compile_seconds`` sums the wall time of calls during which Dynamo compiled a new graph;
    ``num_compiles`` counts those graphs. ``config`` is the model's.
    """

    def __init__(self, model: torch.nn.Module, backend: str = "inductor", mode: str | None = None) -> None:
        self.model = model
        self.config = getattr(model, "config", None)
        self.backend = backend
        self.mode = mode
        # Dynamo is imported here, not at module level: importing it costs ~3 s of every start.
        self._dynamo = importlib.import_module("torch._dynamo")
        self._counters = importlib.import_module("torch._dynamo.utils").counters
        self.static = True
        restore_dense(model)  # a traced step multiplies by the dense weights
        self._compiled = torch.compile(model, backend=backend, mode=mode, dynamic=False, fullgraph=True)
        self.compile_seconds = 0.0
        self.num_compiles = 0

    def _fall_back(self, exc: Exception) -> None:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        log_once(f"treeserve.runner: the forward has a graph break ({reason}); compiling it dynamic, with breaks")
        self.static = False
        self._dynamo.reset()
        self._compiled = torch.compile(self.model, backend=self.backend, mode=self.mode, dynamic=True)

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
        args = (input_ids, positions, kv, out_slots, meta, logits_indices)
        with self._dynamo.config.patch(recompile_limit=_RECOMPILE_LIMIT):
            try:
                out = self._compiled(*args)
            except (self._dynamo.exc.Unsupported, self._dynamo.exc.UserError) as exc:  # a graph break
                if not self.static:
                    raise
                self._fall_back(exc)
                before = counters["stats"]["unique_graphs"]
                out = self._compiled(*args)
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
