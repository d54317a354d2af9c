"""How many draft nodes each decoding request gets in a step: the goodput rule.

A step's time is modelled as ``T = T_fixed + R * T_row`` for ``R`` query rows (every weight read
once, then per-row arithmetic); ``row_cost = T_row / T_fixed`` is measured per machine and model
(``treeserve.runner.step_cost``). A chain draft's node ``j`` (1-based) is accepted with
probability ``alpha ** j`` when each node, its parent accepted, is accepted with probability
``alpha`` (a request's running estimate, :func:`acceptance`). The step emits ``E`` tokens in
expectation (one per sampled row, plus the expected accepted nodes). Adding a node of expected
gain ``g`` raises tokens per unit time exactly when ``g * (1 + R * row_cost) > E * row_cost``;
:func:`plan_draft_lengths` adds nodes greedily, best gain first, while that holds. So drafting
stops by itself where rows are expensive (a CPU batch: ``E`` and ``R`` grow together, the bar
tends to 1) or acceptance is low (chat that does not quote its input), and where rows are free
(``row_cost == 0``: a memory-bound GPU step) every request gets its whole room.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

__all__ = ["ACCEPT_DECAY", "acceptance", "plan_draft_lengths"]

ACCEPT_DECAY = 0.95
"""Per step a request is considered for drafting, its accepted / rejected counts are multiplied
by this: about the last 20 verify steps count, and a request that stopped drafting (low estimate)
drifts back to the prior and is tried again."""


def acceptance(hits: float, misses: float) -> float:
    """The per-node acceptance estimate from decayed counts: ``hits`` nodes accepted with their
    parent accepted, ``misses`` nodes rejected there (a chain stopping short of its end), under a
    uniform prior (one of each): in ``(0, 1)``, 0.5 with no history."""
    if hits < 0 or misses < 0:
        raise ValueError(f"hits and misses must be >= 0, got {hits} and {misses}")
    return (1.0 + hits) / (2.0 + hits + misses)


def plan_draft_lengths(
    alphas: Sequence[float], rooms: Sequence[int], rows: int, tokens: float, row_cost: float, budget: int
) -> list[int]:
    """Draft lengths ``n[i] <= rooms[i]`` (sum at most ``budget``) for requests whose nodes are
    accepted with per-node probability ``alphas[i]``, in a step of ``rows`` query rows already
    expected to emit ``tokens`` tokens, rows costing ``row_cost`` times the step's fixed part.

    ``row_cost == 0``: every request its whole room, in order, while ``budget`` lasts. Otherwise
    nodes are added best expected gain first (``alpha ** depth``; ties to the earlier request)
    while the gain beats the step's current tokens per unit time (module docstring).
    """
    if len(alphas) != len(rooms):
        raise ValueError(f"alphas ({len(alphas)}) and rooms ({len(rooms)}) differ in length")
    if row_cost < 0 or rows < 0 or tokens < 0 or budget < 0:
        raise ValueError(f"row_cost, rows, tokens and budget must be >= 0, got {row_cost}, {rows}, {tokens}, {budget}")
    if any(not 0.0 <= a <= 1.0 for a in alphas):
        raise ValueError(f"alphas must lie in [0, 1], got {list(alphas)}")
    lengths = [0] * len(rooms)
    if row_cost == 0:
        for i, room in enumerate(rooms):
            lengths[i] = max(0, min(room, budget))
            budget -= lengths[i]
        return lengths
    heap = [(-a, i, a) for i, (a, room) in enumerate(zip(alphas, rooms)) if room > 0 and a > 0]
    heapq.heapify(heap)
    while heap and budget > 0:
        neg_gain, i, a = heap[0]
        gain = -neg_gain
        if gain * (1.0 + rows * row_cost) <= tokens * row_cost:
            break  # the best remaining node does not pay, so none does
        lengths[i] += 1
        rows += 1
        tokens += gain
        budget -= 1
        if lengths[i] < rooms[i]:
            heapq.heapreplace(heap, (-gain * a, i, a))
        else:
            heapq.heappop(heap)
    return lengths
