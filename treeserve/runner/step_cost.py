"""What one more query row costs in a step of this model on this machine: the draft planner's input.

:func:`measure_row_cost` times the model's own forward (the path a decode or verify step takes:
fused decode layers, the head's row-count choices) over a short cached context, for one query row
and for ``rows`` rows of one request (a chain draft's tree mask), and fits
``T(r) = T_fixed + r * T_row``: it returns ``T_row / T_fixed`` (``scheduler.draft_plan``). Measured
once per machine, model shape and thread count and kept on disk (``treeserve._tuning``); the
context's KV is written to pages borrowed from the pool and given back.
"""

from __future__ import annotations

import time

import torch

from treeserve._tuning import measured
from treeserve.kvcache import AttentionMetadata, KVPool, pages_to_slots
from treeserve.runner.inputs import CausalLM

__all__ = ["MAX_ROW_COST", "measure_row_cost"]

MAX_ROW_COST = 20.0
"""Cap of the ratio (a step whose fixed part measured under 1/20 of a one-row step: rows are all
that costs, drafting pays only for near-certain nodes)."""

_CONTEXT = 128  # KV tokens in the measured step (a short chat turn)
_BUDGET_S = 1.5  # time spent repeating a measurement beyond its warm-up call
_REPS = 3


def _best_of(fn: object) -> float:
    fn()  # type: ignore[operator]
    best, spent, reps = float("inf"), 0.0, 0
    while reps < _REPS and (reps == 0 or spent < _BUDGET_S):
        t = time.perf_counter()
        fn()  # type: ignore[operator]
        dt = time.perf_counter() - t
        best, spent, reps = min(best, dt), spent + dt, reps + 1
    return best


def _model_key(model: CausalLM, kv: KVPool) -> tuple[object, ...]:
    c = model.config
    kinds = sorted({(type(m).__name__, str(getattr(m, "qtype", ""))) for m in model.modules()})
    return (type(model).__name__, c.hidden_size, c.intermediate_size, c.num_layers, c.num_heads, c.num_kv_heads,
            c.vocab_size, next(model.parameters()).dtype, kv.dtype, kv.page_size, tuple(kinds))  # fmt: skip


@torch.inference_mode()
def _seconds(model: CausalLM, kv: KVPool, rows: int) -> float:
    """Best time of one forward of ``rows`` new tokens of one request after ``_CONTEXT`` cached ones."""
    ps = kv.page_size
    total = _CONTEXT + rows
    pages = kv.allocator.alloc(-(-total // ps))
    try:
        slots = pages_to_slots(pages, ps)[:total]
        dev = kv.device
        ids = torch.zeros(rows, dtype=torch.int64, device=dev)
        positions = torch.arange(_CONTEXT, total, device=dev)
        out_slots = slots[_CONTEXT:].to(dev)
        parents = None if rows == 1 else [list(range(-1, rows - 1))]
        meta = AttentionMetadata.build([rows], [total], [pages.tolist()], ps, tree_parents=parents, device=dev)
        logits_rows = torch.arange(rows, device=dev)
        return _best_of(lambda: model(ids, positions, kv, out_slots, meta, logits_rows))
    finally:
        kv.allocator.free(pages)


def measure_row_cost(model: CausalLM, kv: KVPool, rows: int) -> float:
    """``T_row / T_fixed`` of ``model``'s steps on this machine, from one-row and ``rows``-row
    forwards (``rows >= 2``: a decode plus ``rows - 1`` draft nodes), in ``[0, MAX_ROW_COST]``;
    measured once per host and key (``treeserve._tuning.measured``, kept as thousandths).
    ``ValueError`` when the pool has too few free pages for the measured context."""
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 2:
        raise ValueError(f"rows must be an int >= 2, got {rows!r}")
    need = -(-(_CONTEXT + rows) // kv.page_size)
    if kv.allocator.num_free < need:
        raise ValueError(f"measuring the row cost needs {need} free KV pages, the pool has {kv.allocator.num_free}")

    def measure() -> int:
        one, many = _seconds(model, kv, 1), _seconds(model, kv, rows)
        per_row = max(0.0, (many - one) / (rows - 1))
        fixed = max(one - per_row, one / MAX_ROW_COST)
        return round(1000 * min(MAX_ROW_COST, per_row / fixed))

    return measured("row-cost", (*_model_key(model, kv), rows, _CONTEXT), int, measure) / 1000
