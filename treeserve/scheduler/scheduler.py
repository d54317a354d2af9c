"""Continuous batching with chunked prefill, prefix-cache-aware admission and preemption.

The scheduler owns the request queues and every page a request holds. One engine step is::

    batch = scheduler.schedule()          # which tokens of which requests to compute
    sampled = runner.run(batch)           # model forward + sampling (knows nothing of queues)
    finished = scheduler.update(batch, sampled)

:class:`Scheduler` is the facade; each concern is its own module:

- ``queues``: waiting/running and the transitions between them (start, pause, finish, abort).
- ``ledger``: the KV ledger -- pages and slot-table columns of running requests, the radix tree
  (``RadixCache.release_request``), checked table writes, the page accounting invariant.
- ``admission``: prefix-aware admission and the first prefill chunk under the token budget.
- ``preemption``: pausing the newest running requests when pages run out.
- ``commit``: appending sampled tokens, stop conditions, finishing.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from treeserve.kvcache import PageAllocator, RadixCache, ReqToTokenTable
from treeserve.sampling import SamplingParams
from treeserve.scheduler.admission import admit
from treeserve.scheduler.batch import SampledToken, ScheduledBatch, ScheduledItem
from treeserve.scheduler.commit import commit_step
from treeserve.scheduler.draft_plan import RETRY_DECAY, acceptance, check_step_costs, plan_draft_lengths
from treeserve.scheduler.ledger import KVLedger
from treeserve.scheduler.preemption import reserve_decode_slots, reserve_or_preempt
from treeserve.scheduler.queues import RequestQueues
from treeserve.scheduler.request import FinishReason, Request, RequestState, SpecStats
from treeserve.scheduler.stop import StopChecker

_MIX = 0x9E3779B97F4A7C15
_MASK63 = (1 << 63) - 1


def derive_seed(seed: int, index: int) -> int:
    """Seed of the ``index``-th sample of a request seeded with ``seed`` (index 0 keeps it)."""
    if index == 0:
        return seed
    x = (seed * _MIX + index * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    x ^= x >> 31
    return x & _MASK63


_RUNNING = RequestState.RUNNING


@dataclass(slots=True)
class SchedulerConfig:
    """Batching limits.

    ``max_batched_tokens``: token budget of one step (decode rows count 1 each).
    ``max_running``: most requests holding KV at once. ``max_model_len``: prompt + output cap.
    ``lpm_window``: waiting requests ordered by longest cached prefix when the queue is at most
    this long (FCFS beyond, where matching every request each step would cost too much).
    ``num_speculative_tokens``: most draft nodes per request and step (0 = no speculation); the
    scheduler asks for drafts through ``ScheduledItem.draft_budget``, the engine drafts;
    ``speculative_max_batch``: a step with more decoding requests than this asks for no drafts
    (0 = no limit): on a compute-bound batch, scoring rejected draft nodes costs more than the
    decode steps that accepted ones save. ``speculative_row_cost``: one more query row's cost
    relative to a step's fixed part, measured (``treeserve.runner.step_cost``); with it, each
    step's draft lengths follow the goodput rule of :mod:`treeserve.scheduler.draft_plan` and each
    request's acceptance so far (0 = rows are free: every asking request gets its whole room).
    ``speculative_draft_cost``: one draft node's drafter forward relative to the same fixed part
    (measured for a drafter that runs a model, ``runner.measure_draft_cost``; 0 for n-gram drafts).
    ``speculative_step_costs``: a lone request's step time at ``r`` query rows over a one-row
    step's, for ``r = 1, 2, ...`` (measured, ``runner.measure_step_costs``; the planner's cost
    within its range, ``speculative_row_cost`` a row beyond; empty: the line alone).
    ``min_shared_prefix``: a waiting request whose first this-many tokens equal those of a prompt
    being prefilled (and not yet cached) waits for that prefill instead of duplicating it.
    ``jump_forward_tokens``: a decoding grammar-constrained request (``Request.grammar``) whose
    grammar forces its next tokens asks for a draft of up to this many of them, with or without
    speculation (0 = off; ``GrammarState.jump_forward``).
    """

    max_batched_tokens: int = 512
    max_running: int = 64
    max_model_len: int = 2048
    num_speculative_tokens: int = 0
    speculative_max_batch: int = 0
    speculative_row_cost: float = 0.0
    speculative_draft_cost: float = 0.0
    speculative_step_costs: tuple[float, ...] = ()
    lpm_window: int = 128
    min_shared_prefix: int = 32
    jump_forward_tokens: int = 0

    def __post_init__(self) -> None:
        for name in ("max_batched_tokens", "max_running", "max_model_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        for name in ("lpm_window", "min_shared_prefix", "num_speculative_tokens", "speculative_max_batch",
                     "jump_forward_tokens", "speculative_row_cost", "speculative_draft_cost"):  # fmt: skip
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        check_step_costs(self.speculative_step_costs, "speculative_step_costs")


@dataclass(slots=True, eq=False)
class SampleGroup:
    """The ``n`` samples of one prompt: siblings wait until the leader's prompt KV is cached."""

    size: int
    prompt_cached: bool = False


class Scheduler:
    """Builds each step's batch under a token budget and a running-requests limit.

    ``on_release(req)`` is called whenever a request stops running (finished, paused or aborted),
    e.g. for a drafter to drop its state. The scheduler never runs a model or a drafter: with
    ``num_speculative_tokens`` it only sets the decoding items' ``draft_budget``.

    Guarantees: a request is admitted only when the pages for its first chunk can be allocated
    now while keeping one page of headroom per running request; when pages run out mid-decode
    the newest running request is paused (its computed KV goes into the radix tree, evictable)
    and later resumes by prefix match; nothing is leaked on finish, pause or abort.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        allocator: PageAllocator,
        radix: RadixCache,
        table: ReqToTokenTable,
        stop_checker: StopChecker,
        on_release: Callable[[Request], None] | None = None,
    ) -> None:
        self.config = config
        self.allocator = allocator
        self.radix = radix
        self.table = table
        self.page_size = allocator.page_size
        self.stop_checker = stop_checker
        width = -(-config.max_model_len // self.page_size) * self.page_size
        if table.max_context_len < width:
            raise ValueError(
                f"table.max_context_len ({table.max_context_len}) must be >= max_model_len rounded "
                f"up to the page size ({width})"
            )
        self.ledger = KVLedger(allocator, radix, table)
        self.queues = RequestQueues(self.ledger, on_release)
        self.waiting: deque[Request] = self.queues.waiting
        self.running: list[Request] = self.queues.running
        self.spec = SpecStats()
        self._rids = itertools.count()
        self._saw_structured = False  # jump-forward looks for grammars only once one came

    @property
    def num_preemptions(self) -> int:
        """Requests paused so far to free pages."""
        return self.queues.num_preemptions

    # ------------------------------------------------------------------ public API
    def new_request(
        self, prompt_ids: Sequence[int], params: SamplingParams, seed: int, vocab_size: int
    ) -> list[Request]:
        """Validate (:meth:`validate_request`) and enqueue a prompt; returns its ``params.n``
        requests."""
        prompt = self.validate_request(prompt_ids, params, vocab_size)
        self._saw_structured |= params.structured is not None
        group = SampleGroup(params.n) if params.n > 1 else None
        reqs = [
            Request(
                rid=next(self._rids),
                prompt_ids=prompt,
                params=params,
                seed=derive_seed(seed, i),
                group=group,
                sample_index=i,
            )
            for i in range(params.n)
        ]
        self.waiting.extend(reqs)
        return reqs

    def validate_request(self, prompt_ids: Sequence[int], params: SamplingParams, vocab_size: int) -> list[int]:
        """The prompt as ints, or ``ValueError`` (nothing enqueued) for an empty prompt, token ids
        outside ``[0, vocab_size)``, a prompt that leaves no room to generate within
        ``max_model_len``, or ``n`` samples whose KV could never fit in the pool at once."""
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("prompt must contain at least 1 token, got an empty prompt")
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {vocab_size}), got {bad[:5]}")
        max_len = self.config.max_model_len
        if len(prompt) >= max_len:
            raise ValueError(
                f"prompt has {len(prompt)} tokens; max_model_len is {max_len}, so a prompt may have "
                f"at most {max_len - 1}"
            )
        params.validate_for_vocab(vocab_size)
        total = min(len(prompt) + params.max_new_tokens, max_len)
        shared = len(prompt) // self.page_size  # whole prompt pages the samples share via the tree
        need_pages = shared + params.n * (self.ledger.pages_for(total) - shared)
        if need_pages > self.allocator.capacity:
            raise ValueError(
                f"n={params.n} samples of {total} tokens need ~{need_pages} KV pages; the pool has "
                f"{self.allocator.capacity}: lower n or max_new_tokens, or grow the KV pool"
            )
        return prompt

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        """Pick this step's work: running requests first (oldest first), then admissions, then
        draft budgets for decoding requests from the token budget left."""
        batch = ScheduledBatch()
        items = batch.items
        budget = self.config.max_batched_tokens
        running = list(self.running)
        ps = self.page_size
        decoding = [r for r in running if r.num_computed_tokens + 1 == len(r.prompt_ids) + len(r.output_ids)]
        # Decoding requests whose slots are all used need one more page for the pending token.
        full = [r for r in decoding if r.num_computed_tokens >= r.num_cached_tokens + r.num_owned_pages * ps]
        if full:
            reserve_decode_slots(self.queues, full)
        if len(decoding) == len(running) == len(self.running) and len(running) <= budget:
            # Only decodes, all within the budget, none paused: one token each, slots reserved.
            # (tuple.__new__ builds a ScheduledItem without its Python-level __new__: 3x cheaper.)
            new_item = tuple.__new__
            items += [new_item(ScheduledItem, (r, r.num_computed_tokens, 1, True, None, 0)) for r in running]
            budget -= len(running)
        else:
            budget = self._schedule_running(items, running, budget)
        cfg = self.config
        if budget > 0 and self.waiting:
            budget = admit(self.queues, batch, budget, cfg.max_running, cfg.lpm_window, cfg.min_shared_prefix)
        if budget > 0 and (cfg.num_speculative_tokens or (cfg.jump_forward_tokens and self._saw_structured)):
            self._ask_for_drafts(batch, budget)
        return batch

    def schedule_follow_up(self, in_flight: ScheduledBatch) -> ScheduledBatch | None:
        """The decode step after ``in_flight`` (scheduled and launched, its tokens not committed
        yet), to be launched before they are: each of its requests decodes the token it samples
        there (item ``start`` = that token's position, ``seq_len`` until it is committed).

        Only when the next step is that and nothing else: nothing waits (admissions take the
        synchronous path), no speculation, ``in_flight`` was one sampled token per running
        request (no draft, no grammar), and each one's next slot can be had without pausing
        anyone (evicting unlocked radix leaves as usual). A request that ``in_flight``'s token
        brings to ``max_new_tokens`` or ``max_model_len`` is left out; one that it stops another
        way (EOS, a stop string) is in, and its token is discarded when committed (the commit
        path skips finished requests). ``None`` changes nothing.
        """
        running = self.running
        if self.waiting or self.config.num_speculative_tokens or len(in_flight.items) != len(running):
            return None
        max_len = self.config.max_model_len
        follow: list[Request] = []
        for it in in_flight.items:
            req = it.req
            if (req.state is not _RUNNING or not it.sample or it.num_scheduled_tokens != 1 or it.draft is not None
                    or req.grammar is not None or it.start != req.seq_len - 1):  # fmt: skip
                return None
            if len(req.output_ids) + 1 < req.params.max_new_tokens and req.seq_len + 1 < max_len:
                follow.append(req)
        if not follow:
            return None
        ledger, ps = self.ledger, self.page_size
        full = [r for r in follow if r.seq_len >= r.num_cached_tokens + r.num_owned_pages * ps]
        if full:
            if not ledger.obtain(len(full), 0):
                return None
            ledger.grow(full, 1)
        new_item = tuple.__new__
        return ScheduledBatch([new_item(ScheduledItem, (r, r.seq_len, 1, True, None, 0)) for r in follow])

    def _schedule_running(self, items: list[ScheduledItem], running: list[Request], budget: int) -> int:
        """Append the items of ``running`` (oldest first) while ``budget`` tokens remain, reserving
        their slots (pausing the newest requests when pages run out); return the budget left."""
        queues, ps = self.queues, self.page_size
        new_item = tuple.__new__
        for req in running:  # the hot loop: properties inlined
            if budget <= 0:
                break
            if req.state is not _RUNNING:
                continue  # paused earlier in this loop to make room
            computed = req.num_computed_tokens
            seq_len = len(req.prompt_ids) + len(req.output_ids)
            n = seq_len - computed
            if n > budget:
                n = budget
            end = computed + n
            if end > req.num_cached_tokens + req.num_owned_pages * ps and not reserve_or_preempt(queues, req, end):
                continue  # req itself was paused
            items.append(new_item(ScheduledItem, (req, computed, n, end >= seq_len, None, 0)))
            budget -= n
        return budget

    def update(self, batch: ScheduledBatch, sampled: Sequence[SampledToken | None]) -> list[Request]:
        """Commit one step: advance computed counts, append sampled tokens, finish requests.

        ``sampled[i]`` belongs to ``batch.items[i]`` (``None`` where the item did not sample; a
        negative token marks a row the sampler found invalid: that request finishes with
        ``FinishReason.ERROR``). Returns the requests that finished in this step.
        """
        if len(sampled) != len(batch.items):
            raise ValueError(f"sampled has {len(sampled)} rows for a batch of {len(batch.items)}")
        return commit_step(self.queues, self.stop_checker, self.spec, self.config.max_model_len, batch, sampled)

    def abort(self, req: Request, reason: FinishReason = FinishReason.ABORT, error: str | None = None) -> None:
        """Finish ``req`` now, from any state, releasing everything it holds."""
        if req.is_finished:
            return
        self.queues.abort(req, reason)
        req.error = error

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` naming the mismatch when page accounting is off."""
        self.ledger.check(self.running, self.waiting)

    # ------------------------------------------------------------------ speculation
    def _ask_for_drafts(self, batch: ScheduledBatch, budget: int) -> None:
        """Give decoding items a ``draft_budget`` from the ``budget`` tokens left, reserving their
        draft slots without preempting or evicting for anyone else's need: a grammar-constrained
        item first the jump-forward tokens its grammar forces (oldest first), then draft nodes,
        at most ``num_speculative_tokens`` per item in all (none on a step over
        ``speculative_max_batch``), as many as :func:`plan_draft_lengths` finds worth their rows
        (the runner computes draft rows on the path of the step's plain rows, ``quant.plain_rows``:
        any draft length keeps plain decoding's arithmetic)."""
        cfg = self.config
        k, jump = cfg.num_speculative_tokens, cfg.jump_forward_tokens
        max_len = cfg.max_model_len
        items = batch.items
        decoding = [j for j, it in enumerate(items) if it.start == it.req.seq_len - 1]
        if cfg.speculative_max_batch and len(decoding) > cfg.speculative_max_batch:
            k = 0  # a batch-heavy step: plain decoding is faster (forced tokens are still drafted)
        asking, forced, rooms, alphas = [], [], [], []
        for j in decoding:
            req = items[j].req
            if req.params.logprobs:
                continue  # top logprobs: verification reports none, decode plainly
            n_forced = 0
            if req.params.structured is not None:
                if req.grammar is None:
                    continue  # no matcher to check a draft against
                if jump:
                    n_forced = len(req.grammar.jump_forward(jump))
            room = min(max(k, n_forced), req.params.max_new_tokens - len(req.output_ids) - 1, max_len - req.seq_len - 1)
            if room <= 0:
                continue
            f = min(n_forced, room, budget)
            budget -= f
            req.draft_hits *= RETRY_DECAY
            req.draft_misses *= RETRY_DECAY
            asking.append(j)
            forced.append(f)
            rooms.append(room - f if k else 0)
            alphas.append(acceptance(req.draft_hits, req.draft_misses))
        if not asking:
            return
        n_forced = sum(forced)  # accepted with probability 1 but at a tokenization boundary
        rows = sum(it.num_scheduled_tokens for it in items) + n_forced
        tokens = sum(it.sample for it in items) + n_forced
        lengths = plan_draft_lengths(alphas, rooms, rows, tokens, cfg.speculative_row_cost, budget,
                                     cfg.speculative_draft_cost, cfg.speculative_step_costs)
        for j, f, n in zip(asking, forced, lengths):
            it = items[j]
            if f + n > 0 and self.ledger.try_reserve(it.req, it.req.seq_len + f + n, run=True):
                items[j] = it._replace(draft_budget=f + n)


__all__ = [
    "SampleGroup",
    "SampledToken",
    "SpecStats",
    "ScheduledBatch",
    "ScheduledItem",
    "Scheduler",
    "SchedulerConfig",
    "derive_seed",
]
