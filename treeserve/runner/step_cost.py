"""What more query rows cost a step of this model on this machine: the draft planner's input.

:func:`measure_step_costs` times the model's step (its inputs built, then the forward on the path a
decode or verify step takes: fused decode layers, the head's row-count choices) over a short cached
context, for one query row and for ``r = 2 .. rows`` rows of one request (a chain draft, built as
the eager runner builds it, its draft rows on the one plain row's path as in a verify step:
``quant.plain_rows``), and returns the table
``T(r) / T(1)``; :func:`row_cost_of` fits ``T(r) = T_fixed + r * T_row`` to its last entry and
returns ``T_row / T_fixed`` (``scheduler.draft_plan`` takes both: the table where it reaches, the
line beyond). Measured once per machine, model shape and thread count and kept on disk
(``treeserve._tuning``); the context's KV is written to pages borrowed from the pool and given
back. :func:`measure_draft_cost` times a drafter's one-token forward against the target's the
same way: what a draft node costs a drafter that runs a model.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from treeserve._tuning import measured
from treeserve.kvcache import KVPool, pages_to_slots
from treeserve.models.quant import plain_rows
from treeserve.runner.inputs import CausalLM, build_step_inputs

__all__ = ["MAX_ROW_COST", "MAX_TABLE_ROWS", "ROW_COST_CONTEXT", "measure_draft_cost", "measure_step_costs",
           "row_cost_of"]

MAX_ROW_COST = 20.0
"""Cap of the ratio (a step whose fixed part measured under 1/20 of a one-row step: rows are all
that costs, drafting pays only for near-certain nodes)."""

MAX_TABLE_ROWS = 9
"""The longest row count ``LLM`` measures the table at (``engine.row_cost_rows``): past two of
the int16 GGUF kernel's 4-row register blocks (AVX2) and one of its 8-row blocks (AVX-512), where
a step's cost jumps; the planner takes the line through the last entry beyond. Each round times
every row count once, so a longer table costs a large model's first start seconds a row."""

ROW_COST_CONTEXT = 128
"""KV tokens before the measured step's new rows (a short chat turn): ``measure_step_costs``' default."""
_BUDGET_S = 2.0  # time spent on rounds beyond the first three (``_median_ratios``)
_PAIRS = 9  # rounds at most


def _timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _model_key(model: CausalLM, kv: KVPool) -> tuple[object, ...]:
    c = model.config
    kinds = sorted({(type(m).__name__, str(getattr(m, "qtype", ""))) for m in model.modules()})
    return (type(model).__name__, c.hidden_size, c.intermediate_size, c.num_layers, c.num_heads, c.num_kv_heads,
            c.vocab_size, next(model.parameters()).dtype, kv.dtype, kv.page_size, tuple(kinds))  # fmt: skip


def _forward(model: CausalLM, kv: KVPool, pages: torch.Tensor, total: int, n: int) -> Callable[[], object]:
    """A step of ``model`` on ``n`` new tokens of one request ending at ``total`` tokens, over
    ``pages`` of ``kv``, as the runner pays it: its inputs built (``build_step_inputs``; a chain
    draft's rows as a causal step, as the eager runner builds them) and the forward, whose per-step
    host work (the query rows' page lists) is then timed too."""
    ps = kv.page_size
    table = pages_to_slots(pages, ps)[None]
    ids = [0] * n

    def call() -> object:
        step = build_step_inputs(table, [0], [total - n], [n], ids, ps, [n])
        with plain_rows(1):  # the path a verify step's rows take (``quant.plain_rows``)
            return model(step.input_ids, step.positions, kv, step.out_slots, step.meta, step.logits_indices)

    return call


def _median_ratios(nums: Sequence[Callable[[], object]], den: Callable[[], object]) -> list[float]:
    """Per ``num`` of ``nums``, the median over interleaved rounds of time(``num``) / time(``den``)
    (after one warm-up call of each): each round times ``den`` then every ``num`` in turn, so a
    ratio's two timings see about the same machine load, steadier than a ratio of two separate
    best times. At least 3 rounds, more while the time spent stays under ``_BUDGET_S``, at most
    ``_PAIRS``."""
    for call in (den, *nums):
        call()
    ratios: list[list[float]] = [[] for _ in nums]
    spent = 0.0
    while len(ratios[0]) < _PAIRS and (len(ratios[0]) < 3 or spent < _BUDGET_S):
        td = _timed(den)
        times = [_timed(num) for num in nums]
        for r, tn in zip(ratios, times):
            r.append(tn / td)
        spent += td + sum(times)
    return [statistics.median(r) for r in ratios]


def _check_free(kv: KVPool, tokens: int, what: str) -> None:
    """``ValueError`` unless ``kv`` has free pages for ``tokens`` tokens (checked before the cache is
    read, so a pool too small fails whether or not the measurement is kept)."""
    need = -(-tokens // kv.page_size)
    if kv.allocator.num_free < need:
        raise ValueError(f"measuring {what} needs {need} free KV pages, the pool has {kv.allocator.num_free}")


def _borrowed(kv: KVPool, tokens: int) -> torch.Tensor:
    """Pages of ``kv`` for ``tokens`` tokens (``_check_free`` first; give them back with
    ``kv.allocator.free``)."""
    return kv.allocator.alloc(-(-tokens // kv.page_size))


@torch.inference_mode()
def _step_ratios(model: CausalLM, kv: KVPool, rows: int, context: int) -> list[float]:
    """``T(r) / T(1)`` for ``r = 2 .. rows``, one request after ``context`` cached tokens
    (``_median_ratios``: every round times one row, then each ``r``)."""
    pages = _borrowed(kv, context + rows)
    try:
        calls = [_forward(model, kv, pages, context + r, r) for r in range(1, rows + 1)]
        return _median_ratios(calls[1:], calls[0])
    finally:
        kv.allocator.free(pages)


def measure_step_costs(model: CausalLM, kv: KVPool, rows: int, context: int = ROW_COST_CONTEXT) -> tuple[float, ...]:
    """``T(r) / T(1)`` of ``model``'s steps on this machine for ``r = 1 .. rows`` query rows of one
    request (``rows >= 2``: a decode plus ``r - 1`` draft nodes, on the plain row's path) after
    ``context`` cached tokens (``>= 1``): the draft planner's table (``scheduler.draft_plan``). The
    first is 1; each at least the one before (a dip is noise: more rows never cost less), at most
    ``MAX_ROW_COST`` times the row count; measured once per host and key (``treeserve._tuning.measured``,
    kept as thousandths). ``ValueError`` when the pool has too few free pages for them."""
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 2:
        raise ValueError(f"rows must be an int >= 2, got {rows!r}")
    _check_context(context)
    _check_free(kv, context + rows, "the row cost")

    def measure() -> tuple[int, ...]:
        ratios = _step_ratios(model, kv, rows, context)
        return (1000, *(round(1000 * min(r * MAX_ROW_COST, max(1.0, c))) for r, c in enumerate(ratios, 2)))

    # "inputs": tables timed with the step's inputs built (2026-12-07); older entries are re-measured
    kept = measured("step-costs", (*_model_key(model, kv), rows, context, "inputs"), tuple, measure)
    return tuple(c / 1000 for c in itertools.accumulate(kept, max))


def row_cost_of(step_costs: Sequence[float]) -> float:
    """``T_row / T_fixed`` of the line through a one-row step and the table's last entry
    (``measure_step_costs``), in ``[0, MAX_ROW_COST]``: ``T(r) / T(1) = (1 + r rho) / (1 + rho)``
    gives ``rho = (c - 1) / (r - c)``."""
    rows, c = len(step_costs), step_costs[-1]
    return MAX_ROW_COST if c >= rows else min(MAX_ROW_COST, (c - 1) / (rows - c))


def measure_draft_cost(model: CausalLM, kv: KVPool, draft: CausalLM, draft_kv: KVPool, row_cost: float,
                       context: int = ROW_COST_CONTEXT) -> float:
    """One draft node's cost for the goodput rule (``scheduler.draft_plan``): the drafter's
    one-token forward over ``T_fixed`` of ``model``'s step, i.e. its time over ``model``'s
    one-token forward times ``1 + row_cost`` (both after ``context`` cached tokens, ``>= 1``),
    in ``[0, MAX_ROW_COST]``; measured once per host and pair of models (kept as thousandths,
    ``treeserve._tuning``). ``ValueError`` when either pool has too few free pages."""
    _check_context(context)
    if not 0 <= row_cost < float("inf"):
        raise ValueError(f"row_cost must be a finite number >= 0, got {row_cost!r}")
    _check_free(kv, context + 1, "the draft cost")
    _check_free(draft_kv, context + 1, "the draft cost")

    @torch.inference_mode()
    def measure() -> int:
        total = context + 1
        pages = _borrowed(kv, total)
        try:
            draft_pages = _borrowed(draft_kv, total)
            try:
                (ratio,) = _median_ratios([_forward(draft, draft_kv, draft_pages, total, 1)],
                                          _forward(model, kv, pages, total, 1))
            finally:
                draft_kv.allocator.free(draft_pages)
        finally:
            kv.allocator.free(pages)
        return round(1000 * ratio)

    ratio = measured("draft-cost", (*_model_key(model, kv), *_model_key(draft, draft_kv), context), int, measure) / 1000
    return min(MAX_ROW_COST, ratio * (1.0 + row_cost))


def _check_context(context: int) -> None:
    if isinstance(context, bool) or not isinstance(context, int) or context < 1:
        raise ValueError(f"context must be an int >= 1, got {context!r}")
