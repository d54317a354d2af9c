"""The KV ledger: which pages and slot-table columns each running request holds.

A running request's slots are ``table[row, :capacity]`` with ``capacity = num_cached_tokens +
num_owned_pages * page_size``: the first ``num_cached_tokens`` belong to the radix tree (locked
by ``req.lock``), the rest are pages the request allocated itself. The ledger is the only code
that changes those fields; it writes the table through ``ReqToTokenTable.write`` (checked) and
hands KV back through ``RadixCache.release_request``. Only computed KV reaches the radix tree.

Accounting (:meth:`KVLedger.check`)::

    allocator.num_free + radix evictable pages + radix protected pages
        + pages owned by running requests == allocator.capacity
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from treeserve.kvcache import PageAllocator, RadixCache, ReqToTokenTable, pages_to_slots
from treeserve.scheduler.request import Request, RequestState

__all__ = ["DECODE_RUN", "KVLedger"]

DECODE_RUN = 16
"""Longest run of consecutive slots a decoding request is given at once (page size 1)."""


class KVLedger:
    """Page accounting of running requests over one allocator, radix tree and slot table."""

    def __init__(self, allocator: PageAllocator, radix: RadixCache, table: ReqToTokenTable) -> None:
        self.allocator = allocator
        self.radix = radix
        self.table = table
        self.page_size = allocator.page_size

    # ------------------------------------------------------------------ sizes
    def pages_for(self, num_tokens: int) -> int:
        """Pages that hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.page_size)

    def capacity(self, req: Request) -> int:
        """Tokens ``req`` has slots for: its cached prefix plus its own pages."""
        return req.num_cached_tokens + req.num_owned_pages * self.page_size

    def obtain(self, need: int, headroom: int) -> bool:
        """True when ``need`` pages are free (evicting radix leaves as needed) while ``headroom``
        more stay obtainable (free or evictable)."""
        free = self.allocator.num_free
        if free >= need + headroom:
            return True
        evictable = self.radix.evictable_tokens // self.page_size
        if free + evictable < need + headroom:
            return False
        if free < need:
            self.radix.evict((need - free) * self.page_size)
        return self.allocator.num_free >= need

    def prefix_ready(self, req: Request, headroom: int) -> bool:
        """Promote ``req``'s prefix from the radix tree's lower tiers (``RadixCache.prefetch``,
        keeping ``headroom`` pages obtainable); False while that copy is still in flight."""
        return self.radix.prefetch(req.all_ids, headroom)

    # ------------------------------------------------------------------ attach / grow / shrink
    def attach(self, req: Request) -> None:
        """Give ``req`` a table row and lock its longest cached prefix (its computed part)."""
        req.row = self.table.alloc()
        match = self.radix.match_prefix(req.all_ids)
        req.lock = self.radix.lock(match.node)
        req.num_cached_tokens = req.num_computed_tokens = match.length
        req.num_owned_pages = 0
        if match.length:
            self.table.write(req.row, 0, match.slots)

    def try_reserve(self, req: Request, kv_len: int, headroom: int = 0, run: bool = False) -> bool:
        """Make ``req`` own slots for positions ``< kv_len`` if the pages can be had (evicting
        unlocked radix leaves) with ``headroom`` pages still obtainable; False changes nothing.
        With ``run`` (a decoding request's draft slots), at least :meth:`decode_run`'s run of
        pages, so that its next steps find their slots reserved (:meth:`trim` keeps them)."""
        capacity = self.capacity(req)
        if kv_len <= capacity:
            return True
        need = self.pages_for(kv_len - capacity)
        if not self.obtain(need, headroom):
            return False
        if run:
            need = max(need, self.decode_run([req]))
        self.table.write(req.row, capacity, pages_to_slots(self.allocator.alloc(need), self.page_size))
        req.num_owned_pages += need
        return True

    def decode_run(self, reqs: Sequence[Request]) -> int:
        """Pages to give each of the decoding ``reqs`` whose slots ran out: with page size 1, a run
        of up to ``DECODE_RUN`` so that a request's next tokens sit in consecutive slots (decode
        attention then reads its K/V rows as one stream instead of rows ``len(reqs)`` slots apart:
        8.3 -> 5.9 ms per batch-64 step of the uniform set, benches/RESULTS.md), capped by the
        tokens each can still take and its table row, and only while a quarter of the pool stays
        free after it without evicting; else 1. Unused pages go back when the request is released."""
        if self.page_size != 1 or not reqs:
            return 1
        width = self.table.max_context_len
        run = min(DECODE_RUN, min(min(r.params.max_new_tokens - len(r.output_ids), width - self.capacity(r))
                                  for r in reqs))
        if run <= 1 or self._pool_short(taking=len(reqs) * run):
            return 1
        return run

    def _pool_short(self, taking: int = 0) -> bool:
        """Whether under a quarter of the pool would stay free after ``taking`` more pages: the one
        bar for decode runs (:meth:`decode_run`) and for keeping a drafting request's (:meth:`trim`)."""
        return self.allocator.num_free - taking < self.allocator.capacity // 4

    def grow(self, reqs: Sequence[Request], pages_each: int = 1) -> None:
        """Give each of ``reqs`` ``pages_each`` more pages, in one allocation and one table write
        (the caller has :meth:`obtain`-ed them); the pages are handed out in ascending order, so
        each request's run is as contiguous as the free list allows.

        The one write that bypasses ``ReqToTokenTable.write`` (it uses the unchecked ``scatter``): the rows are attached rows and the
        columns come from this ledger's own accounting, and a checked call per row would cost
        the decode hot path a Python call per request.
        """
        ps = self.page_size
        width = self.table.max_context_len
        pages = self.allocator.alloc(len(reqs) * pages_each)
        if pages_each > 1:
            pages = pages.sort().values
        # Each request's first column past its capacity (cached + owned pages), then its new columns.
        capacity_ends = (r.row * width + r.num_cached_tokens + r.num_owned_pages * ps for r in reqs)
        index = np.fromiter(capacity_ends, np.int64, len(reqs))
        if ps == 1 and pages_each == 1:
            slots = pages
        else:  # each request's pages' slots, in order
            index = (index[:, None] + np.arange(pages_each * ps)).reshape(-1)
            slots = pages_to_slots(pages, ps)
        self.table.scatter(index, slots)
        for r in reqs:
            r.num_owned_pages += pages_each

    def trim(self, req: Request) -> None:
        """After a drafting step: free the pages past ``req``'s committed tokens (rejected draft
        slots, the rest of its run) while under a quarter of the pool is free; above that they stay
        its run for its next steps (a reservation and a free per verify step cost ~0.2 ms of host
        work on the Zen 3 EPYC; :meth:`release` frees them in any case)."""
        if self._pool_short():
            self._free_owned(req, keep=self.pages_for(req.seq_len - req.num_cached_tokens))

    # ------------------------------------------------------------------ radix tree
    def publish(self, req: Request) -> None:
        """Publish ``req``'s computed, page-aligned KV to the radix tree and re-lock it there.

        Pages the tree already had (another request computed them meanwhile) are freed and the
        request's table row is remapped to the tree's copies.
        """
        if self.radix.disable:
            return
        ps = self.page_size
        # Keep one token out so that tokens[:aligned + 1] exists for the re-lock below.
        aligned = min(req.num_computed_tokens, req.seq_len - 1) // ps * ps
        cached = req.num_cached_tokens
        if aligned <= cached:
            return
        tokens = req.all_ids
        slots = self.table.table[req.row, :aligned].clone()
        already = self.radix.insert(tokens[:aligned], slots)
        if already > cached:  # our copies of [cached, already) are duplicates
            self.allocator.free(slots[cached:already:ps] // ps)
        # The match is capped at len - 1, so it covers exactly the aligned part just inserted.
        match = self.radix.match_prefix(tokens[: aligned + 1])
        assert match.length == aligned, (match.length, aligned)
        new_lock = self.radix.lock(match.node)
        self.radix.unlock(req.lock)
        req.lock = new_lock
        self.table.write(req.row, 0, match.slots)
        req.num_owned_pages -= (aligned - cached) // ps
        req.num_cached_tokens = aligned

    def release(self, req: Request, cache: bool = True) -> None:
        """Give back everything ``req`` holds: its computed KV goes to the radix tree through
        ``RadixCache.release_request`` (with ``cache`` False, e.g. suspect KV, it is freed
        instead), then its row; the request's KV fields are zeroed."""
        computed = req.num_computed_tokens
        if cache and computed:
            self._free_owned(req, keep=self.pages_for(computed - req.num_cached_tokens))
            slots = self.table.table[req.row, :computed].clone()
            self.radix.release_request(req.all_ids[:computed], slots, req.lock)
        else:
            self._free_owned(req)
            self.radix.unlock(req.lock)
        self.table.free(req.row)
        req.row, req.lock, req.num_cached_tokens, req.num_computed_tokens, req.num_owned_pages = 0, None, 0, 0, 0

    def _free_owned(self, req: Request, keep: int = 0) -> None:
        """Free the pages ``req`` allocated itself, all but its first ``keep``."""
        if req.num_owned_pages > keep:
            ps = self.page_size
            start = req.num_cached_tokens + keep * ps
            slots = self.table.table[req.row, start : self.capacity(req) : ps]
            self.allocator.free(slots // ps)
            req.num_owned_pages = keep

    # ------------------------------------------------------------------ checks
    def check(self, running: Sequence[Request], waiting: Iterable[Request]) -> None:
        """Raise ``AssertionError`` naming the mismatch when page accounting is off."""
        self.allocator.check_invariants()
        self.radix.check_invariants()
        owned = sum(r.num_owned_pages for r in running)
        ps = self.page_size
        evictable = self.radix.evictable_tokens // ps
        protected = self.radix.protected_tokens // ps
        total = self.allocator.num_free + evictable + protected + owned
        if total != self.allocator.capacity:
            raise AssertionError(
                f"page accounting: free {self.allocator.num_free} + evictable {evictable} + protected "
                f"{protected} + owned by running {owned} = {total} != capacity {self.allocator.capacity}"
            )
        for r in running:
            if r.state is not RequestState.RUNNING or r.row == 0:
                raise AssertionError(f"request {r.rid} in running list has state {r.state} row {r.row}")
            if self.capacity(r) < r.num_computed_tokens:
                raise AssertionError(f"request {r.rid} computed {r.num_computed_tokens} tokens beyond its slots")
        for r in waiting:
            if r.row != 0 or r.num_owned_pages or r.lock is not None:
                raise AssertionError(f"waiting request {r.rid} still holds KV")
