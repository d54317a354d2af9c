"""Continuous batching with chunked prefill, prefix-cache-aware admission and preemption.

The scheduler owns the request queues and every page a request holds. One engine step is::

    batch = scheduler.schedule()          # which tokens of which requests to compute
    sampled = runner.run(batch)           # model forward + sampling (knows nothing of queues)
    finished = scheduler.update(batch, sampled)

KV accounting (checked by :meth:`Scheduler.check_invariants`)::

    allocator.num_free + radix evictable pages + radix protected pages
        + pages owned by running requests == allocator.capacity

A running request's slots are ``table[row, :capacity]`` where the first ``num_cached`` belong to
the radix tree (locked by the request's lock handle) and the rest are ``num_pages`` pages it
allocated itself. Only KV that has been computed is ever published to the radix tree.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from treeserve.kvcache import PageAllocator, RadixCache, ReqToTokenTable, pages_to_slots
from treeserve.sampling import SamplingParams
from treeserve.scheduler.batch import SampledToken, ScheduledBatch, ScheduledItem, SpecStats
from treeserve.scheduler.drafter import DraftTree, Drafter
from treeserve.scheduler.request import FinishReason, Request, RequestState
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


@dataclass(slots=True)
class SchedulerConfig:
    """Batching limits.

    ``max_batched_tokens``: token budget of one step (decode rows count 1 each).
    ``max_running``: most requests holding KV at once. ``max_model_len``: prompt + output cap.
    ``lpm_window``: waiting requests ordered by longest cached prefix when the queue is at most
    this long (FCFS beyond, where matching every request each step would cost too much).
    ``num_speculative_tokens``: most draft nodes per request and step (0 = no speculation; needs
    a drafter). ``min_shared_prefix``: a waiting request whose first this-many tokens equal those of a prompt
    being prefilled (and not yet cached) waits for that prefill instead of duplicating it.
    """

    max_batched_tokens: int = 512
    max_running: int = 64
    max_model_len: int = 2048
    num_speculative_tokens: int = 0
    lpm_window: int = 128
    min_shared_prefix: int = 32

    def __post_init__(self) -> None:
        for name in ("max_batched_tokens", "max_running", "max_model_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        for name in ("lpm_window", "min_shared_prefix", "num_speculative_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


@dataclass(slots=True, eq=False)
class SampleGroup:
    """The ``n`` samples of one prompt: siblings wait until the leader's prompt KV is cached."""

    size: int
    prompt_cached: bool = False


class Scheduler:
    """Builds each step's batch under a token budget and a running-requests limit.

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
        drafter: Drafter | None = None,
    ) -> None:
        self.config = config
        self.drafter = drafter
        self.allocator = allocator
        self.radix = radix
        self.table = table
        self.page_size = allocator.page_size
        self.stop_checker = stop_checker
        if table.max_context_len < self._round_up(config.max_model_len):
            raise ValueError(
                f"table.max_context_len ({table.max_context_len}) must be >= max_model_len rounded "
                f"up to the page size ({self._round_up(config.max_model_len)})"
            )
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.spec = SpecStats()
        self._rids = itertools.count()

    # ------------------------------------------------------------------ public API
    def new_request(
        self, prompt_ids: Sequence[int], params: SamplingParams, seed: int, vocab_size: int
    ) -> list[Request]:
        """Validate (:meth:`validate_request`) and enqueue a prompt; returns its ``params.n``
        requests."""
        prompt = self.validate_request(prompt_ids, params, vocab_size)
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
        need_pages = shared + params.n * (self._pages_for(total) - shared)
        if need_pages > self.allocator.capacity:
            raise ValueError(
                f"n={params.n} samples of {total} tokens need ~{need_pages} KV pages; the pool has "
                f"{self.allocator.capacity}: lower n or max_new_tokens, or grow the KV pool"
            )
        return prompt

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        """Pick this step's work: running requests first (oldest first), then admissions."""
        batch = ScheduledBatch()
        budget = self.config.max_batched_tokens
        running = list(self.running)
        self._reserve_decode_slots([r for r in running if r.num_tokens - r.num_computed == 1])
        for i, req in enumerate(running):
            if budget <= 0:
                break
            if req.state is not RequestState.RUNNING:
                continue  # paused earlier in this loop to make room
            draft = self._draft_for(req, budget, headroom=len(running) - i - 1)
            if draft is not None:
                n = 1 + len(draft)
            else:
                n = min(req.num_tokens - req.num_computed, budget)
                if not self._reserve(req, req.num_computed + n, preempt=True):
                    continue  # req itself was paused
            batch.items.append(
                ScheduledItem(req, req.num_computed, n, req.num_computed + n >= req.num_tokens, draft)
            )
            budget -= n
        if budget > 0:
            self._admit(batch, budget)
        return batch

    def update(self, batch: ScheduledBatch, sampled: Sequence[SampledToken | None]) -> list[Request]:
        """Commit one step: advance computed counts, append sampled tokens, finish requests.

        ``sampled[i]`` belongs to ``batch.items[i]`` (``None`` where the item did not sample; a
        negative token marks a row the sampler found invalid: that request finishes with
        ``FinishReason.ERROR``). Returns the requests that finished in this step.
        """
        if len(sampled) != len(batch.items):
            raise ValueError(f"sampled has {len(sampled)} rows for a batch of {len(batch.items)}")
        finished: list[Request] = []
        for item, out in zip(batch.items, sampled):
            req = item.req
            if req.state is not RequestState.RUNNING:
                continue  # aborted while the step ran
            if item.draft is None:
                req.num_computed = item.start + item.num_tokens
            else:  # the pending token and the accepted draft nodes now have KV
                req.num_computed = item.start + 1 + (len(out.accepted) if out is not None else 0)
            if not item.sample or out is None:
                continue
            if out.token < 0:  # the sampler flags rows whose logits were NaN/inf
                self._finish(req, FinishReason.ERROR)
                req.error = "the model produced invalid logits (NaN or inf) for this request"
                finished.append(req)
                continue
            if item.draft is not None:
                self.spec.record(len(item.draft), len(out.accepted))
            reason = self._commit_tokens(req, out)
            if reason is not None:
                self._finish(req, reason)
                finished.append(req)
            elif item.draft is not None:
                self._trim_pages(req)
        return finished

    def _commit_tokens(self, req: Request, out: SampledToken) -> FinishReason | None:
        """Append ``out``'s tokens one by one, stopping at the first stop condition."""
        missing = len(out.accepted) - len(out.accepted_logprobs)
        logprobs = (*out.accepted_logprobs, *[float("nan")] * missing, out.logprob)
        for j, token in enumerate((*out.accepted, out.token)):
            last = j == len(out.accepted)
            req.output_ids.append(token)
            req.output_logprobs.append(logprobs[j])
            if last and out.top is not None:
                req.output_top_logprobs.append(out.top)
            if len(req.output_ids) == 1:
                self._publish_prompt(req)
            reason = self.stop_checker.check(req)
            if reason is None and req.num_tokens >= self.config.max_model_len:
                reason = FinishReason.LENGTH
            if reason is not None:
                return reason
        return None

    def abort(self, req: Request, reason: FinishReason = FinishReason.ABORT, error: str | None = None) -> None:
        """Finish ``req`` now, from any state, releasing everything it holds."""
        if req.is_finished:
            return
        if req.state is RequestState.RUNNING:
            self._finish(req, reason)
        else:
            self.waiting.remove(req)
            req.state = RequestState.FINISHED
            req.finish_reason = reason
            self._release_group(req)
        req.error = error

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` naming the mismatch when page accounting is off."""
        self.allocator.check_invariants()
        self.radix.check_invariants()
        owned = sum(r.num_pages for r in self.running)
        ps = self.page_size
        evictable = self.radix.evictable_tokens // ps
        protected = self.radix.protected_tokens // ps
        total = self.allocator.num_free + evictable + protected + owned
        if total != self.allocator.capacity:
            raise AssertionError(
                f"page accounting: free {self.allocator.num_free} + evictable {evictable} + protected "
                f"{protected} + owned by running {owned} = {total} != capacity {self.allocator.capacity}"
            )
        for r in self.running:
            if r.state is not RequestState.RUNNING or r.row == 0:
                raise AssertionError(f"request {r.rid} in running list has state {r.state} row {r.row}")
            if r.num_cached + r.num_pages * ps < r.num_computed:
                raise AssertionError(f"request {r.rid} computed {r.num_computed} tokens beyond its slots")
        for r in self.waiting:
            if r.row != 0 or r.num_pages or r.lock is not None:
                raise AssertionError(f"waiting request {r.rid} still holds KV")

    # ------------------------------------------------------------------ speculation
    def _draft_for(self, req: Request, budget: int, headroom: int) -> DraftTree | None:
        """A draft for a decoding ``req`` whose pages can be had without preempting anyone.

        Drafts shrink first: with no pages to spare (``headroom`` pages stay obtainable for the
        requests after this one) the request decodes plainly this step.
        """
        k = self.config.num_speculative_tokens
        if self.drafter is None or k == 0 or req.num_tokens - req.num_computed != 1:
            return None
        if req.params.logprobs:
            return None  # verification reports no top logprobs: such requests decode plainly
        room = min(
            k,
            budget - 1,
            req.params.max_new_tokens - len(req.output_ids) - 1,
            self.config.max_model_len - req.num_tokens - 1,
        )
        if room <= 0:
            return None
        draft = self.drafter.propose(req.rid, req.all_ids, room)
        if not draft:
            return None
        if not self._reserve(req, req.num_computed + 1 + len(draft), preempt=False, headroom=headroom):
            return None
        return draft

    def _trim_pages(self, req: Request) -> None:
        """Free the pages of rejected draft slots: keep just enough for ``req``'s tokens."""
        self._free_own_pages(req, keep=self._pages_for(req.num_tokens - req.num_cached))

    # ------------------------------------------------------------------ admission
    def _admit(self, batch: ScheduledBatch, budget: int) -> None:
        candidates = self._admission_order()
        # Prompts whose KV is being computed and not yet in the radix tree.
        in_flight = [r.prompt_ids for r in self.running if r.num_computed < len(r.prompt_ids)]
        for req in candidates:
            if budget <= 0 or len(self.running) >= self.config.max_running:
                return
            if req.group is not None and req.sample_index > 0 and not req.group.prompt_cached:
                continue  # wait for the leader's prompt KV, then share it via the radix tree
            if self.table.num_free == 0:
                return
            if self._shares_in_flight_prefix(req, in_flight):
                continue  # admitted once that prefix is cached, instead of computing it twice
            self._attach(req)
            n = min(req.num_tokens - req.num_computed, budget)
            if not self._reserve(req, req.num_computed + n, preempt=False, headroom=len(self.running)):
                self._detach(req)
                return
            self.waiting.remove(req)
            if req.state is RequestState.PAUSED:
                req.metrics.num_preemptions += 1
            elif req.metrics.first_scheduled is None:
                req.metrics.cached_prompt_tokens = req.num_cached
            req.state = RequestState.RUNNING
            if req.metrics.first_scheduled is None:
                req.metrics.first_scheduled = time.perf_counter()
            self.running.append(req)
            if req.num_computed < len(req.prompt_ids):
                in_flight.append(req.prompt_ids)
            batch.items.append(ScheduledItem(req, req.num_computed, n, req.num_computed + n == req.num_tokens))
            budget -= n

    def _shares_in_flight_prefix(self, req: Request, in_flight: list[list[int]]) -> bool:
        """True when ``req`` shares at least ``min_shared_prefix`` uncached leading tokens with a
        prompt being prefilled now (in-batch prefix sharing, as SGLang does it)."""
        if self.radix.disable or not in_flight:
            return False
        need = self.config.min_shared_prefix
        ids = req.prompt_ids
        if len(ids) <= need:
            return False
        head = ids[:need]
        return any(len(p) > need and p[:need] == head for p in in_flight) and self.radix.prefix_len(ids) < need

    def _admission_order(self) -> list[Request]:
        waiting = list(self.waiting)
        if self.radix.disable or len(waiting) > self.config.lpm_window:
            return waiting
        # Longest cached prefix first; paused requests keep priority (they were running).
        lengths = {id(r): self.radix.prefix_len(r.all_ids) for r in waiting}
        return sorted(waiting, key=lambda r: (r.state is not RequestState.PAUSED, -lengths[id(r)]))

    def _attach(self, req: Request) -> None:
        """Give ``req`` a table row and lock its longest cached prefix."""
        req.row = self.table.alloc()
        match = self.radix.match_prefix(req.all_ids)
        req.lock = self.radix.lock(match.node)
        req.num_cached = req.num_computed = match.length
        req.num_pages = 0
        if match.length:
            self.table.write(req.row, 0, match.slots)

    def _detach(self, req: Request) -> None:
        """Undo :meth:`_attach` for a request that could not be admitted."""
        self._free_own_pages(req)
        self.radix.unlock(req.lock)
        self.table.free(req.row)
        req.row, req.lock, req.num_cached, req.num_computed = 0, None, 0, 0

    # ------------------------------------------------------------------ memory
    def _round_up(self, n: int) -> int:
        return -(-n // self.page_size) * self.page_size

    def _pages_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.page_size)

    def _reserve(self, req: Request, kv_len: int, *, preempt: bool, headroom: int = 0) -> bool:
        """Make ``req`` own slots for positions ``< kv_len``.

        Evicts unlocked radix leaves first; then, with ``preempt``, pauses the newest running
        requests (possibly ``req`` itself: returns False then). ``headroom`` pages must stay
        obtainable (free or evictable) afterwards, so admission never starves running decodes.
        """
        capacity = req.num_cached + req.num_pages * self.page_size
        need = self._pages_for(kv_len - capacity) if kv_len > capacity else 0
        while True:
            if self._obtain(need, headroom):
                break
            if not preempt:
                return False
            victim = self.running[-1]
            self._pause(victim)
            if victim is req:
                return False
        if need:
            pages = self.allocator.alloc(need)
            self.table.write(req.row, capacity, pages_to_slots(pages, self.page_size))
            req.num_pages += need
        return True

    def _reserve_decode_slots(self, decoding: list[Request]) -> None:
        """Give every decoding request a slot for its pending token, allocating in one call.

        Pauses the newest running requests while the pages cannot be had (a paused request's
        own need goes with it). One vectorized allocation and table write for the whole batch
        (the one write that bypasses ``ReqToTokenTable.write``: rows come from ``table.alloc``
        and columns from the requests' own page accounting, and a per-row call would cost the
        hot path a Python call per request).
        """
        ps = self.page_size
        needy = [r for r in decoding if r.num_computed + 1 > r.num_cached + r.num_pages * ps]
        while needy and not self._obtain(len(needy), 0):
            self._pause(self.running[-1])
            needy = [r for r in needy if r.state is RequestState.RUNNING]
        if not needy:
            return
        pages = self.allocator.alloc(len(needy))
        rows = torch.tensor([r.row for r in needy], dtype=torch.long)
        starts = torch.tensor([r.num_cached + r.num_pages * ps for r in needy], dtype=torch.long)
        cols = starts[:, None] + torch.arange(ps)
        self.table.table[rows[:, None], cols] = pages_to_slots(pages, ps).view(-1, ps)
        for r in needy:
            r.num_pages += 1

    def _obtain(self, need: int, headroom: int) -> bool:
        """True when ``need`` pages are free (evicting as needed) with ``headroom`` obtainable."""
        free = self.allocator.num_free
        evictable = self.radix.evictable_tokens // self.page_size
        if free + evictable < need + headroom:
            return False
        if free < need:
            self.radix.evict((need - free) * self.page_size)
        return self.allocator.num_free >= need

    def _free_own_pages(self, req: Request, keep: int = 0) -> None:
        """Free the pages ``req`` allocated itself, all but its first ``keep``."""
        if req.num_pages > keep:
            ps = self.page_size
            start = req.num_cached + keep * ps
            slots = self.table.table[req.row, start : req.num_cached + req.num_pages * ps : ps]
            self.allocator.free(slots // ps)
            req.num_pages = keep

    def _cache_computed(self, req: Request) -> None:
        """Publish ``req``'s computed, page-aligned KV to the radix tree and re-lock it.

        Pages the tree already had (another request computed them meanwhile) are freed and the
        request's table row is remapped to the tree's copies.
        """
        if self.radix.disable:
            return
        ps = self.page_size
        # Keep one token out so that tokens[:aligned + 1] exists for the re-lock below.
        aligned = min(req.num_computed, req.num_tokens - 1) // ps * ps
        if aligned <= req.num_cached:
            return
        slots = self.table.table[req.row, :aligned].clone()
        already = self.radix.insert(req.all_ids[:aligned], slots)
        if already > req.num_cached:  # our copies of [num_cached, already) are duplicates
            self.allocator.free(slots[req.num_cached : already : ps] // ps)
        # The match is capped at len - 1, so it covers exactly the aligned part just inserted.
        match = self.radix.match_prefix(req.all_ids[: aligned + 1])
        assert match.length == aligned, (match.length, aligned)
        new_lock = self.radix.lock(match.node)
        self.radix.unlock(req.lock)
        req.lock = new_lock
        self.table.write(req.row, 0, match.slots)
        req.num_pages -= (aligned - req.num_cached) // ps
        req.num_cached = aligned

    def _publish_prompt(self, req: Request) -> None:
        self._cache_computed(req)
        if req.group is not None and req.sample_index == 0:
            req.group.prompt_cached = True

    def _release(self, req: Request, cache: bool = True) -> None:
        """Cache what ``req`` computed (unless ``cache`` is False), then give back its row, pages
        and lock."""
        if cache:
            self._cache_computed(req)
        if self.drafter is not None:
            self.drafter.release(req.rid)
        self._free_own_pages(req)
        self.radix.unlock(req.lock)
        self.table.free(req.row)
        req.row, req.lock, req.num_cached, req.num_computed = 0, None, 0, 0
        self.running.remove(req)

    def _pause(self, req: Request) -> None:
        """Preempt ``req``: its KV stays in the radix tree (evictable); it resumes by prefix match."""
        self._release(req)
        req.state = RequestState.PAUSED
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def _finish(self, req: Request, reason: FinishReason) -> None:
        self._release(req, cache=reason is not FinishReason.ERROR)  # never publish suspect KV
        req.state = RequestState.FINISHED
        req.finish_reason = reason
        req.metrics.finished = time.perf_counter()
        self._release_group(req)

    @staticmethod
    def _release_group(req: Request) -> None:
        # A leader that ends before its prompt is cached must not block its siblings forever.
        if req.group is not None and req.sample_index == 0:
            req.group.prompt_cached = True


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
