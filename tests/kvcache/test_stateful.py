"""Stateful test of the memory layer as the scheduler drives it.

Requests start (match, lock, allocate, "compute" KV), decode, finish or pause (release_request),
or abort; eviction, extra locks and resets interleave. A plain-Python reference (page-aligned
prefix -> page) predicts every match exactly, and every KV slot a match returns must hold the value
written for that token's prefix. ``check_invariants`` runs after every step.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from treeserve.kvcache import (
    KVPool,
    LockHandle,
    OutOfPagesError,
    RadixCache,
    ReqToTokenTable,
    pages_to_slots,
)

_rng = random.Random(1234)
BASES = [[_rng.randrange(1000) for _ in range(96)] for _ in range(2)]


def kv_value(prefix: tuple[int, ...]) -> float:
    """The K value "computed" for the last token of ``prefix`` (exact in float64)."""
    return float(hash(prefix) % (1 << 50))


@dataclass(slots=True)
class Running:
    tokens: list[int]
    row: int
    handle: LockHandle
    matched: int  # leading tokens whose pages belong to the tree
    pages: torch.Tensor  # pages the request owns (covering tokens[matched:])


class MemoryMachine(RuleBasedStateMachine):
    """Drive PageAllocator + KVPool + ReqToTokenTable + RadixCache; subclasses pick the page size."""

    PAGE_SIZE = 1
    NUM_PAGES = 40
    BASE_LEN = 24
    SUFFIX_LEN = 8  # the length of the random tail of a sequence and of one decode step

    def __init__(self) -> None:
        super().__init__()
        ps = self.PAGE_SIZE
        self.pool = KVPool(1, self.NUM_PAGES, ps, num_kv_heads=1, head_dim=1, dtype=torch.float64)
        self.alloc = self.pool.allocator
        self.cache = RadixCache(self.alloc, ps)
        self.table = ReqToTokenTable(max_requests=4, max_context_len=self.BASE_LEN + 3 * self.SUFFIX_LEN)
        self.running: list[Running] = []
        self.extra_locks: list[tuple[LockHandle, tuple[int, ...]]] = []
        self.spent: list[LockHandle] = []
        self.ref: dict[tuple[int, ...], int] = {}  # every cached page-aligned prefix -> its last page
        self.used: dict[tuple[int, ...], int] = {}  # cached prefix -> when last matched or inserted
        self.clock = 0

    # ---------------------------------------------------------------- helpers

    @property
    def k(self) -> torch.Tensor:
        return self.pool.k_caches[0].view(-1)

    def sequence(self, data: tuple[int, int, list[int]]) -> list[int]:
        base, keep, suffix = data
        tokens = BASES[base][: self.BASE_LEN * keep // 4] + suffix
        return tokens or [0]

    def expected_match(self, tokens: list[int]) -> tuple[int, list[int]]:
        ps, length, pages = self.PAGE_SIZE, 0, []
        while length + ps <= len(tokens) - 1 and tuple(tokens[: length + ps]) in self.ref:
            length += ps
            pages.append(self.ref[tuple(tokens[:length])])
        return length, pages

    def checked_match(self, tokens: list[int]):  # noqa: ANN201
        hits, queries = self.cache.hit_tokens, self.cache.query_tokens
        m = self.cache.match_prefix(tokens)
        length, pages = self.expected_match(tokens)
        assert m.length == length
        assert m.slots.tolist() == pages_to_slots(torch.tensor(pages, dtype=torch.int64), self.PAGE_SIZE).tolist()
        expected_kv = [kv_value(tuple(tokens[: i + 1])) for i in range(length)]
        assert self.k[m.slots].tolist() == expected_kv
        self.mark_used(tokens, length)
        assert (self.cache.hit_tokens, self.cache.query_tokens) == (hits + length, queries + len(tokens))
        return m

    def mark_used(self, tokens: list[int], length: int) -> None:
        self.clock += 1
        for end in range(self.PAGE_SIZE, length + 1, self.PAGE_SIZE):
            self.used[tuple(tokens[:end])] = self.clock

    def locked_prefixes(self) -> set[tuple[int, ...]]:
        ps = self.PAGE_SIZE
        locked = {tuple(r.tokens[:end]) for r in self.running for end in range(ps, r.matched + 1, ps)}
        return locked | {p[:end] for _, p in self.extra_locks for end in range(ps, len(p) + 1, ps)}

    def evict(self, num_tokens: int) -> int:
        """Evict through the cache and check that exactly least-recently-used unlocked leaves went."""
        freed = self.cache.evict(num_tokens)
        gone = [p for p, page in self.ref.items() if self.alloc.is_free(torch.tensor([page])).item()]
        for prefix in gone:
            del self.ref[prefix]
        assert freed == len(gone) * self.PAGE_SIZE
        assert freed >= num_tokens or self.cache.evictable_tokens == 0
        assert not set(gone) & self.locked_prefixes()
        parents = {p[: -self.PAGE_SIZE] for p in self.ref}
        leaves = [p for p in self.ref if p not in parents and p not in self.locked_prefixes()]
        if gone and leaves:
            assert max(self.used.pop(p) for p in gone) <= min(self.used[p] for p in leaves)
        return freed

    def alloc_pages(self, n: int) -> torch.Tensor | None:
        """Allocate ``n`` pages, evicting if needed, like a scheduler would; None if impossible."""
        if n > self.alloc.num_free:
            self.evict((n - self.alloc.num_free) * self.PAGE_SIZE)
        try:
            return self.alloc.alloc(n)
        except OutOfPagesError:
            assert n > self.alloc.num_free
            return None

    def compute(self, tokens: list[int], slots: torch.Tensor, start: int) -> None:
        """Write the KV of ``tokens[start:]`` into ``slots[start:]``."""
        values = [kv_value(tuple(tokens[: i + 1])) for i in range(start, len(tokens))]
        self.k[slots[start:]] = torch.tensor(values, dtype=torch.float64)

    def pick(self, i: int) -> Running:
        return self.running.pop(i % len(self.running))

    # ---------------------------------------------------------------- rules

    # (base, quarters of BASE_LEN kept, random tail): requests share prefixes often
    seqs = st.tuples(st.integers(0, 1), st.integers(0, 4), st.lists(st.integers(0, 3), max_size=SUFFIX_LEN))

    @rule(data=seqs, copies=st.integers(1, 2))
    def start_requests(self, data: tuple[int, int, list[int]], copies: int) -> None:
        """Start ``copies`` identical requests (two at once compute the same KV: duplicates)."""
        for _ in range(copies):
            self.start_request(self.sequence(data))

    def start_request(self, tokens: list[int]) -> None:
        if self.table.num_free == 0:
            return
        m = self.checked_match(tokens)
        handle = self.cache.lock(m.node)
        pages = self.alloc_pages(-(-(len(tokens) - m.length) // self.PAGE_SIZE))
        if pages is None:
            self.cache.unlock(handle)
            return
        slots = torch.cat([m.slots, pages_to_slots(pages, self.PAGE_SIZE)[: len(tokens) - m.length]])
        self.compute(tokens, slots, m.length)
        row = self.table.alloc()
        self.table.write(row, 0, slots)
        self.running.append(Running(tokens, row, handle, m.length, pages))

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 100), extra=st.lists(st.integers(0, 3), min_size=1, max_size=SUFFIX_LEN))
    def decode(self, i: int, extra: list[int]) -> None:
        r = self.running[i % len(self.running)]
        if len(r.tokens) + len(extra) > self.table.max_context_len:
            return
        ps, old_len = self.PAGE_SIZE, len(r.tokens)
        have, need = r.pages.numel(), -(-(old_len + len(extra) - r.matched) // ps)
        more = self.alloc_pages(need - have)
        if more is None:
            return
        r.pages = torch.cat([r.pages, more])
        r.tokens += extra
        own_slots = pages_to_slots(r.pages, ps)[: len(r.tokens) - r.matched]
        self.table.write(r.row, r.matched, own_slots)
        self.compute(r.tokens, self.table.table[r.row, : len(r.tokens)], old_len)

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 100))
    def finish_or_pause(self, i: int) -> None:
        r = self.pick(i)
        ps, n = self.PAGE_SIZE, len(r.tokens)
        aligned = n // ps * ps
        slots = self.table.table[r.row, :n].clone()
        own = (slots[::ps] // ps).tolist()
        before, dup = 0, 0
        while before < aligned and tuple(r.tokens[: before + ps]) in self.ref:
            dup += own[before // ps] != self.ref[tuple(r.tokens[: before + ps])]
            before += ps
        result = self.cache.release_request(r.tokens, slots, r.handle)
        self.spent.append(r.handle)
        for end in range(before + ps, aligned + 1, ps):
            self.ref[tuple(r.tokens[:end])] = own[end // ps - 1]
        self.mark_used(r.tokens, aligned)
        assert result.cached_tokens == aligned
        assert result.duplicate_tokens == dup * ps
        assert result.freed_pages == dup + (aligned < n)
        self.table.free(r.row)

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 100))
    def abort(self, i: int) -> None:
        r = self.pick(i)
        self.cache.unlock(r.handle)
        self.spent.append(r.handle)
        self.alloc.free(r.pages)
        self.table.free(r.row)

    @rule(n=st.integers(0, 40))
    def evict_tokens(self, n: int) -> None:
        self.evict(n)

    @rule(data=seqs)
    def peek(self, data: tuple[int, int, list[int]]) -> None:
        """``prefix_len`` is the match length and changes nothing (tree, LRU order, counters)."""
        tokens = self.sequence(data)
        before = (self.cache.hit_tokens, self.cache.query_tokens, self.cache.evictable_tokens, self.nodes())
        assert self.cache.prefix_len(tokens) == self.expected_match(tokens)[0]
        assert (self.cache.hit_tokens, self.cache.query_tokens, self.cache.evictable_tokens, self.nodes()) == before

    def nodes(self) -> list[tuple[int, int, tuple[int, ...]]]:
        """Every node's (serial, access time, edge): what a split or a touch would change."""
        out, stack = [], [self.cache._root]  # noqa: SLF001
        while stack:
            node = stack.pop()
            out.append((node.serial, node.last_access, node.key))
            stack.extend(node.children.values())
        return sorted(out)

    @rule(data=seqs)
    def match_and_lock(self, data: tuple[int, int, list[int]]) -> None:
        tokens = self.sequence(data)
        m = self.checked_match(tokens)
        self.extra_locks.append((self.cache.lock(m.node), tuple(tokens[: m.length])))

    @precondition(lambda self: self.extra_locks)
    @rule(i=st.integers(0, 100))
    def unlock_extra(self, i: int) -> None:
        handle, _ = self.extra_locks.pop(i % len(self.extra_locks))
        self.cache.unlock(handle)
        self.spent.append(handle)

    @precondition(lambda self: self.spent)
    @rule(i=st.integers(0, 100))
    def unlock_spent_handle_fails(self, i: int) -> None:
        before = (self.cache.evictable_tokens, self.cache.protected_tokens, self.alloc.num_free)
        with pytest.raises(ValueError, match="already unlocked"):
            self.cache.unlock(self.spent[i % len(self.spent)])
        assert (self.cache.evictable_tokens, self.cache.protected_tokens, self.alloc.num_free) == before

    @precondition(lambda self: not self.running and not self.extra_locks)
    @rule()
    def reset(self) -> None:
        self.cache.reset()
        self.ref.clear()
        self.used.clear()
        assert self.alloc.num_free == self.alloc.capacity

    # ---------------------------------------------------------------- invariants

    @invariant()
    def accounting_is_exact(self) -> None:
        own = [r.pages for r in self.running]
        self.cache.check_invariants(torch.cat(own) if own else torch.empty(0, dtype=torch.int64))
        self.table.check_invariants()
        assert self.cache.total_tokens == len(self.ref) * self.PAGE_SIZE
        assert self.cache.protected_tokens == len(self.locked_prefixes()) * self.PAGE_SIZE

    @invariant()
    def running_requests_keep_their_kv(self) -> None:
        for r in self.running:
            slots = self.table.table[r.row, : len(r.tokens)]
            assert self.k[slots].tolist() == [kv_value(tuple(r.tokens[: i + 1])) for i in range(len(r.tokens))]


class PageSize16Machine(MemoryMachine):
    PAGE_SIZE = 16
    NUM_PAGES = 14
    BASE_LEN = 64


TestMemoryPageSize1 = MemoryMachine.TestCase
TestMemoryPageSize16 = PageSize16Machine.TestCase
# Longer runs than the default 50 steps: requests must live long enough to collide and be evicted.
TestMemoryPageSize1.settings = settings(TestMemoryPageSize1.settings, stateful_step_count=100)
TestMemoryPageSize16.settings = settings(TestMemoryPageSize16.settings, stateful_step_count=100)
