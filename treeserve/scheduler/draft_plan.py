"""How many draft nodes each decoding request gets in a step: the goodput rule.

**Cost per step.** A step's time is modelled as ``T = T_fixed + R * T_row`` for ``R`` query rows
(every weight read once, then per-row arithmetic); ``row_cost = T_row / T_fixed`` is measured per
machine and model (``treeserve.runner.step_cost``). Where the measured table ``step_costs``
(``T(r) / T(1)`` for a lone request's verify steps of ``r`` rows) is given, it replaces the line
within its range (:func:`step_time`): on CPU the cost rises in steps, not in a line. The int16 GGUF
kernel multiplies rows in register blocks (4 with AVX2), each block one pass over the weights, so
SmolLM2 on the Zen 3 EPYC costs 1.2 / 1.5 / 1.7 / 2.5 one-row steps at 2 / 3 / 4 / 5 rows: a line
fitted at 5 rows over-charges 4 rows and a line fitted at 4 under-charges 5.

**Tokens per step.** A chain draft's node ``j`` (1-based) is accepted with probability
``alpha ** j`` when each node, its parent accepted, is accepted with probability ``alpha`` (the
request's estimate, below). The step emits ``E`` tokens in expectation (one per sampled row, plus
the expected accepted nodes).

**The rule.** Adding a node of expected gain ``g`` raises tokens per unit time exactly when
``g * (1 + R * row_cost) > E * row_cost``; :func:`plan_draft_lengths` ranks nodes best gain first
and takes as many as maximize tokens per unit time (with the line: while that holds). A lone
request (``R = E = 1``) drafts its first node only when ``alpha > row_cost / (1 + row_cost)``:
0.29 at the row cost 0.40 measured on Zen 4. So drafting stops by itself where rows are expensive
(a CPU batch: ``E`` and ``R`` grow together, the bar tends to 1) or acceptance is low (chat that
does not quote its input), and where rows are free (``row_cost == 0``: a memory-bound GPU step)
every request gets its whole room.

**The drafter's cost.** A drafter that runs a model (``draft:<model>``, ``draft:self:N``) spends
one of its forwards per draft node of a chain; ``node_cost`` is that forward's time over the
target step's fixed part (measured, ``runner.measure_draft_cost``; 0 for n-gram drafts, whose
host lookup is not counted). A node then costs ``row_cost + node_cost`` and the bar becomes
``g * (1 + R * row_cost + D * node_cost) > E * (row_cost + node_cost)`` for ``D`` nodes planned:
a drafter nearly as slow as the target drafts nothing, since a node then costs more than the
one-row step it could save (SmolLM2's 29 of 30 layers on the Zen 3 EPYC: a node 1.65 of the
fixed part at row cost 0.68; drafting whatever the rows allowed halved the speed, issue 32).
The batch's draft forwards are charged per node, not per depth: an over-estimate for batches,
which draft little on CPU anyway.

**The acceptance estimate** (:func:`acceptance`) is the posterior mean of a uniform prior (0.5)
updated with the request's verified drafts: ``hits`` nodes accepted with their parent accepted,
``misses`` chains cut short (``Request.draft_hits`` / ``draft_misses``). The counts age twice:

- per verified draft, by :data:`ACCEPT_DECAY` before its counts are added
  (:func:`verified_counts`): the estimate follows the last ~20 drafts, as a request moves
  between quoting its input and writing freely;
- per step the request is considered, by :data:`RETRY_DECAY`: a request below the bar drifts
  back toward the prior and probes again with one node after ~30-50 steps (two misses in a row
  need ~30 steps, each further miss ~50 more), so probing costs a request that never gains at
  most one losing verify step in ~30-50 steps.

The evidence must not fade with steps that verified nothing: an n-gram drafter proposes on only
some steps (a chat turn: about one in fifteen), and counts that faded by 0.95 a step between its
proposals judged each proposal near the prior, above the bar. Chat at batch 1 then drafted at
12% acceptance on Zen 4 and ran at 0.92x of no speculation (issue 32).

Known gap: the costs are the step's inputs and forward (``runner.measure_step_costs``). The rest of
a verify step's host work (draft planning, verification, commit, the drafter) is not in them: in
all, on the Zen 3 EPYC about 0.7 ms more than a plain step's, 0.08 of SmolLM2's one-row step (1.2 ms before chains were built as
causal steps and drafting requests kept their slot runs, 2026-12-07), and a 2-row step of SmolLM2's
chat cost 1.35 one-row steps where the table said 1.19 (on Zen 4 before the host walk, a one-node
verify step cost 1.6-1.8 decode steps where the model predicted 1.3). So the rule is optimistic
for short drafts, which pay that work for fewer tokens (benches/RESULTS.md, issue 32). Calibrating
that cost online from the engine's own steps was tried (2026-12-07) and not kept: no gain beyond
noise on chat, and a cost estimate raised by another process's load stopped drafting, which then
gave it no step to correct itself with.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

__all__ = ["ACCEPT_DECAY", "RETRY_DECAY", "acceptance", "check_step_costs", "plan_draft_lengths", "step_time",
           "verified_counts"]

ACCEPT_DECAY = 0.95
"""Per verified draft, a request's accepted / rejected counts are multiplied by this before the
draft's own are added (:func:`verified_counts`): about the last 20 drafts count."""

RETRY_DECAY = 0.99
"""Per step a request is considered for drafting (drafting or not), its counts are multiplied by
this: a request whose estimate fell below the bar drifts back toward the prior (half-life ~70
steps) and is probed again (module docstring)."""


def acceptance(hits: float, misses: float) -> float:
    """The per-node acceptance estimate from aged counts: ``hits`` nodes accepted with their
    parent accepted, ``misses`` nodes rejected there (a chain stopping short of its end), under a
    uniform prior (one of each): in ``(0, 1)``, 0.5 with no history."""
    if hits < 0 or misses < 0:
        raise ValueError(f"hits and misses must be >= 0, got {hits} and {misses}")
    return (1.0 + hits) / (2.0 + hits + misses)


def verified_counts(hits: float, misses: float, accepted: int, cut: bool) -> tuple[float, float]:
    """A request's counts after a verified draft of which ``accepted`` drafter nodes were accepted
    and whose walk stopped short of its deepest node (``cut``): the old counts aged by
    :data:`ACCEPT_DECAY`, plus the draft's own."""
    if hits < 0 or misses < 0 or accepted < 0:
        raise ValueError(f"hits, misses and accepted must be >= 0, got {hits}, {misses} and {accepted}")
    return hits * ACCEPT_DECAY + accepted, misses * ACCEPT_DECAY + cut


def check_step_costs(step_costs: object, name: str = "step_costs") -> None:
    """``ValueError`` (naming ``name``) unless ``step_costs`` is a tuple or list of finite numbers,
    the first 1 (a one-row step), none below the one before (more rows never cost less)."""
    ok = isinstance(step_costs, (tuple, list)) and all(
        isinstance(c, (int, float)) and not isinstance(c, bool) and math.isfinite(c) for c in step_costs)
    if ok and step_costs:
        ok = step_costs[0] == 1 and all(b >= a for a, b in zip(step_costs, step_costs[1:]))
    if not ok:
        raise ValueError(f"{name} must be finite numbers starting at 1, non-decreasing, got {step_costs!r}")


def step_time(rows: int, row_cost: float, step_costs: Sequence[float] = ()) -> float:
    """A step's time in units of its fixed part for ``rows`` query rows: ``step_costs[rows - 1]``
    (measured ``T(r) / T(1)``) times ``1 + row_cost`` within the table, ``1 + rows * row_cost``
    (the linear model) without one, and past its end the last entry plus ``row_cost`` a row
    (``row_cost`` being the slope fitted to that entry, the two agree there)."""
    if rows < 1 or not step_costs:
        return 1.0 + rows * row_cost
    if rows <= len(step_costs):
        return (1.0 + row_cost) * step_costs[rows - 1]
    return (1.0 + row_cost) * step_costs[-1] + (rows - len(step_costs)) * row_cost


def plan_draft_lengths(
    alphas: Sequence[float], rooms: Sequence[int], rows: int, tokens: float, row_cost: float, budget: int,
    node_cost: float = 0.0, step_costs: Sequence[float] = (),
) -> list[int]:
    """Draft lengths ``n[i] <= rooms[i]`` (sum at most ``budget``) for requests whose nodes are
    accepted with per-node probability ``alphas[i]``, in a step of ``rows`` query rows already
    expected to emit ``tokens`` tokens, the step's time :func:`step_time` (``row_cost`` a row,
    or the measured ``step_costs`` table) and each drafted node ``node_cost`` more (the drafter's
    forward), all in units of the step's fixed part.

    ``row_cost == node_cost == 0`` without a table: every request its whole room, in order, while
    ``budget`` lasts. Otherwise the candidate nodes are ranked by expected gain (``alpha ** depth``;
    ties to the earlier request) and the step takes the best ``d`` of them for the ``d`` that
    maximizes expected tokens per unit time (the smallest such ``d``): with the linear model that is
    where the next node's gain stops beating the step's rate (module docstring); a measured table
    may rise in steps (a kernel's register block of rows), where a longer draft can pay again.
    """
    if len(alphas) != len(rooms):
        raise ValueError(f"alphas ({len(alphas)}) and rooms ({len(rooms)}) differ in length")
    if row_cost < 0 or node_cost < 0 or rows < 0 or tokens < 0 or budget < 0:
        raise ValueError("row_cost, node_cost, rows, tokens and budget must be >= 0, got "
                         f"{row_cost}, {node_cost}, {rows}, {tokens}, {budget}")
    if any(not 0.0 <= a <= 1.0 for a in alphas):
        raise ValueError(f"alphas must lie in [0, 1], got {list(alphas)}")
    check_step_costs(step_costs)
    lengths = [0] * len(rooms)
    if row_cost == 0 and node_cost == 0 and not step_costs:
        for i, room in enumerate(rooms):
            lengths[i] = max(0, min(room, budget))
            budget -= lengths[i]
        return lengths
    heap = [(-a, i, a) for i, (a, room) in enumerate(zip(alphas, rooms)) if room > 0 and a > 0]
    heapq.heapify(heap)
    ranked: list[int] = []  # request of each candidate node, best gain first
    depth = [0] * len(rooms)  # candidate nodes ranked so far per request
    best_rate, best, gained = tokens / step_time(rows, row_cost, step_costs), 0, tokens
    while heap and len(ranked) < budget:
        neg_gain, i, a = heap[0]
        ranked.append(i)
        gained -= neg_gain
        d = len(ranked)
        rate = gained / (step_time(rows + d, row_cost, step_costs) + d * node_cost)
        if rate > best_rate:
            best_rate, best = rate, d
        depth[i] += 1
        if depth[i] < rooms[i]:
            heapq.heapreplace(heap, (neg_gain * a, i, a))
        else:
            heapq.heappop(heap)
    for i in ranked[:best]:
        lengths[i] += 1
    return lengths
