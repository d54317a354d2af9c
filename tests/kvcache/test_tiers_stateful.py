"""Stateful test of the radix tree over its host and disk tiers.

Requests match (promoting from the tiers), lock, compute and release their KV (written through to
disk); evictions demote; a disk write can crash between its write and its rename, a disk entry can
be corrupted, and the whole cache can restart over the same directory. Every slot a match returns
must hold exactly the KV computed for that token's prefix (never wrong KV, whatever the tiers went
through), ``check_invariants`` (device, host and disk) runs after every step, and after a restart a
released sequence whose chunks are all intact is promoted back to the last whole chunk.
"""

from __future__ import annotations

import random
import shutil
import tempfile

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from treeserve.kvcache import KVPool, KVTiers, LockHandle, OutOfPagesError, RadixCache, TierLayout, pages_to_slots
from treeserve.kvcache import disk_store as disk_mod

_rng = random.Random(29)
BASES = [[_rng.randrange(1000) for _ in range(40)] for _ in range(2)]
CHUNK = 4


class _Crash(BaseException):
    """Stands for the process dying between a temporary file's write and its rename."""


def kv_value(prefix: tuple[int, ...]) -> float:
    return float(hash(prefix) % (1 << 50))


class TierMachine(RuleBasedStateMachine):
    PAGE_SIZE = 1
    NUM_PAGES = 41
    HOST_TOKENS = 8

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="tiers-")
        self.layout = TierLayout("m", torch.float64, 1, 1, 1, self.PAGE_SIZE, CHUNK)
        self.locks: list[LockHandle] = []
        self.last_released: tuple[int, ...] | None = None
        self.corrupted: set[str] = set()  # keys (hex) of entries ever damaged
        self._build()

    def _build(self) -> None:
        self.pool = KVPool(1, self.NUM_PAGES, self.PAGE_SIZE, 1, 1, torch.float64)
        self.alloc = self.pool.allocator
        self.tiers = KVTiers(self.pool, self.layout, self.HOST_TOKENS, self.dir, 1 << 20)
        self.cache = RadixCache(self.alloc, self.PAGE_SIZE, tiers=self.tiers)

    def teardown(self) -> None:
        self.tiers.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    # ---------------------------------------------------------------- helpers
    def intact(self, tokens: list[int]) -> bool:
        """No chunk of ``tokens`` was ever damaged on disk (a read that finds a damaged entry
        deletes it and recomputes: the expected promotion stops there)."""
        keys = self.tiers.keys(tuple(tokens), len(tokens) // CHUNK)
        return not {k.hex() for k in keys} & self.corrupted

    def kv(self, which: int) -> torch.Tensor:
        return (self.pool.k_caches if which == 0 else self.pool.v_caches)[0].view(-1)

    def checked_match(self, tokens: list[int]):  # noqa: ANN201
        m = self.cache.match_prefix(tokens)
        ps = self.PAGE_SIZE
        assert m.length % ps == 0 and m.length <= len(tokens) - 1
        expected = torch.tensor([kv_value(tuple(tokens[: i + 1])) for i in range(m.length)], dtype=torch.float64)
        assert torch.equal(self.kv(0)[m.slots], expected), "a match returned KV of other tokens"
        assert torch.equal(self.kv(1)[m.slots], -expected)
        return m

    def alloc_pages(self, n: int) -> torch.Tensor | None:
        if n > self.alloc.num_free:
            self.cache.evict((n - self.alloc.num_free) * self.PAGE_SIZE)
        try:
            return self.alloc.alloc(n)
        except OutOfPagesError:
            return None

    seqs = st.tuples(st.integers(0, 1), st.integers(0, 4), st.lists(st.integers(0, 3), max_size=8))

    def sequence(self, data: tuple[int, int, list[int]]) -> list[int]:
        base, keep, suffix = data
        return (BASES[base][: 32 * keep // 4] + suffix) or [0]

    # ---------------------------------------------------------------- rules
    @rule(data=seqs)
    def run_request(self, data: tuple[int, int, list[int]]) -> None:
        """Match (promoting), compute the rest, release (write-through to disk)."""
        tokens = self.sequence(data)
        m = self.checked_match(tokens)
        handle = self.cache.lock(m.node)
        ps = self.PAGE_SIZE
        pages = self.alloc_pages(-(-(len(tokens) - m.length) // ps))
        if pages is None:
            self.cache.unlock(handle)
            return
        slots = torch.cat([m.slots, pages_to_slots(pages, ps)[: len(tokens) - m.length]])
        values = torch.tensor([kv_value(tuple(tokens[: i + 1])) for i in range(m.length, len(tokens))], dtype=torch.float64)
        self.kv(0)[slots[m.length :]] = values
        self.kv(1)[slots[m.length :]] = -values
        self.cache.release_request(tokens, slots, handle)
        self.tiers.flush()
        self.last_released = tuple(tokens)

    @rule(data=seqs)
    def match(self, data: tuple[int, int, list[int]]) -> None:
        self.checked_match(self.sequence(data))

    @rule(data=seqs)
    def lock(self, data: tuple[int, int, list[int]]) -> None:
        if len(self.locks) < 3:
            self.locks.append(self.cache.lock(self.checked_match(self.sequence(data)).node))

    @precondition(lambda self: self.locks)
    @rule(i=st.integers(0, 7))
    def unlock(self, i: int) -> None:
        self.cache.unlock(self.locks.pop(i % len(self.locks)))

    @rule(n=st.integers(0, 48))
    def evict(self, n: int) -> None:
        """Demote least-recently-used leaves to the host tier (whose LRU spills to disk)."""
        host_before = self.tiers.stats.bytes_device_to_host
        freed = self.cache.evict(n)
        assert freed >= n or self.cache.evictable_tokens == 0
        assert self.tiers.stats.bytes_device_to_host >= host_before

    @rule(data=seqs)
    def promote_after_demotion(self, data: tuple[int, int, list[int]]) -> None:
        """A sequence just released, then evicted from the device, comes back from the tiers."""
        tokens = self.sequence(data)
        if self.locks or len(tokens) < CHUNK + 1:
            return
        self.run_request(data)
        self.cache.evict(self.cache.evictable_tokens)
        assert self.cache.total_tokens == 0
        intact = self.intact(tokens)
        m = self.checked_match(tokens)
        whole = min((len(tokens) - 1) // self.PAGE_SIZE * self.PAGE_SIZE, len(tokens) // CHUNK * CHUNK)
        assert m.length == whole or not intact, (m.length, whole)

    @rule(data=seqs)
    def crash_between_write_and_rename(self, data: tuple[int, int, list[int]]) -> None:
        """A write of garbage for one of this sequence's chunks dies before its rename: the entry
        never becomes visible, so the garbage is never read."""
        tokens = self.sequence(data)
        if len(tokens) < CHUNK:
            return
        key = self.tiers.keys(tuple(tokens), 1)[0]
        if key in self.tiers.disk:
            return
        garbage = torch.full(self.layout.chunk_shape, -1.0, dtype=torch.float64)
        real_replace = disk_mod.os.replace

        def crash(src: object, dst: object) -> None:
            raise _Crash

        disk_mod.os.replace = crash
        try:
            self.tiers.disk.write(key, tuple(tokens[:CHUNK]), garbage)
        except _Crash:
            pass
        finally:
            disk_mod.os.replace = real_replace
        assert key not in self.tiers.disk and not self.tiers.disk.has(key)

    @precondition(lambda self: len(self.tiers.disk))
    @rule(i=st.integers(0, 1 << 16), flip=st.integers(0, 255))
    def corrupt_disk_entry(self, i: int, flip: int) -> None:
        files = sorted(p for p in self.tiers.disk.dir.iterdir() if p.suffix == ".kv")
        if not files:
            return
        path = files[i % len(files)]
        data = bytearray(path.read_bytes())
        data[(i * 7919) % len(data)] ^= flip or 1
        path.write_bytes(data)
        self.corrupted.add(path.stem)

    @rule()
    def restart(self) -> None:
        """A new process over the same directory: the device and host tiers start empty."""
        for h in self.locks:
            self.cache.unlock(h)
        self.locks.clear()
        self.tiers.close()
        self._build()
        if self.last_released is not None and self.intact(list(self.last_released)):
            tokens = list(self.last_released)
            m = self.checked_match(tokens)
            whole = min((len(tokens) - 1) // self.PAGE_SIZE * self.PAGE_SIZE, len(tokens) // CHUNK * CHUNK)
            assert m.length == whole, (m.length, whole)

    @invariant()
    def invariants(self) -> None:
        self.cache.check_invariants()


TierMachine.TestCase.settings = settings(max_examples=30, stateful_step_count=25, deadline=None)
TestTiers = TierMachine.TestCase


class PagedTierMachine(TierMachine):
    PAGE_SIZE = 2
    NUM_PAGES = 21


PagedTierMachine.TestCase.settings = settings(max_examples=20, stateful_step_count=25, deadline=None)
TestPagedTiers = PagedTierMachine.TestCase
