"""Radix prefix cache on the scheduler's path, against naive baselines in the same run.

1. Serving 10k requests of 1k-4k tokens that share random prefixes (a document/system prompt of a
   random page-aligned length, then a private tail): per request ``match_prefix``, lock, allocate
   the uncached pages, ``release_request`` (insert + unlock + free duplicates and the tail page).
   Baseline: a flat dict of chained page hashes (one Python step per page per call, the
   block-hash scheme) doing the same match / allocate / insert. Page sizes 16 and 1 (at page size 1
   the baseline runs on the first 1,000 requests only; per-request times are compared).
2. ``evict`` of a few tokens with 100k cached nodes. Target from the issue: < 0.5 ms per call.
   Baseline: a whole-tree walk that collects the unlocked leaves and evicts the oldest one.

Ratios are asserted with wide margins (shared, noisy CPU); absolute times are only reported.
Results and discussion: benches/RESULTS.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch

from treeserve.kvcache import PageAllocator, RadixCache, RadixNode, pages_to_slots

NUM_REQUESTS = 10_000
NUM_DOCS = 64
VOCAB = 256  # small ids keep the 25M-token workload cheap to hold in Python tuples


def workload(num_requests: int, seed: int = 0) -> list[list[int]]:
    """Requests of 1k-4k tokens: a random page-aligned prefix of one of NUM_DOCS documents + a private tail."""
    g = torch.Generator().manual_seed(seed)
    docs = torch.randint(VOCAB, (NUM_DOCS, 3072), generator=g).tolist()
    doc_ids = torch.randint(NUM_DOCS, (num_requests,), generator=g).tolist()
    shared = (torch.randint(0, 3072 // 16 + 1, (num_requests,), generator=g) * 16).tolist()
    lengths = torch.randint(1024, 4097, (num_requests,), generator=g).tolist()
    prefixes = [docs[d][: min(s, n - 16)] for d, s, n in zip(doc_ids, shared, lengths, strict=True)]
    tails = torch.randint(VOCAB, (sum(lengths) - sum(map(len, prefixes)),), generator=g).tolist()
    out, pos = [], 0
    for prefix, n in zip(prefixes, lengths, strict=True):
        out.append(prefix + tails[pos : pos + n - len(prefix)])
        pos += n - len(prefix)
    return out


class HashChainCache:
    """Naive baseline: ``{hash of the whole prefix up to page i: page}`` built by chaining page hashes."""

    def __init__(self, allocator: PageAllocator) -> None:
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.pages: dict[int, int] = {}

    def _hashes(self, tokens: list[int], num_pages: int):  # noqa: ANN202
        h, ps = 0, self.page_size
        for i in range(num_pages):
            h = hash((h, tuple(tokens[i * ps : (i + 1) * ps])))
            yield h

    def match(self, tokens: list[int]) -> list[int]:
        found = []
        for h in self._hashes(tokens, (len(tokens) - 1) // self.page_size):
            page = self.pages.get(h)
            if page is None:
                break
            found.append(page)
        return found

    def insert(self, tokens: list[int], pages: torch.Tensor) -> list[int]:
        """Keep the pages of new full pages; return the caller's pages to free (duplicates, tail)."""
        own = pages.tolist()
        to_free = []
        for i, h in enumerate(self._hashes(tokens, len(tokens) // self.page_size)):
            if self.pages.setdefault(h, own[i]) != own[i]:
                to_free.append(own[i])
        return to_free + own[len(tokens) // self.page_size :]


def serve_radix(cache: RadixCache, requests: list[list[int]]) -> None:
    ps = cache.page_size
    for tokens in requests:
        m = cache.match_prefix(tokens)
        handle = cache.lock(m.node)
        pages = cache.allocator.alloc(-(-(len(tokens) - m.length) // ps))
        slots = torch.cat([m.slots, pages_to_slots(pages, ps)[: len(tokens) - m.length]])
        cache.release_request(tokens, slots, handle)


def serve_hash_chain(cache: HashChainCache, requests: list[list[int]]) -> None:
    ps = cache.page_size
    for tokens in requests:
        cached = cache.match(tokens)
        pages = torch.cat([torch.tensor(cached, dtype=torch.int64),
                           cache.allocator.alloc(-(-(len(tokens) - len(cached) * ps) // ps))])
        cache.allocator.free(torch.tensor(cache.insert(tokens, pages), dtype=torch.int64))


def _seconds(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


@pytest.fixture(scope="module")
def requests() -> list[list[int]]:
    return workload(NUM_REQUESTS)


@pytest.mark.parametrize(("page_size", "baseline_requests"), [(16, NUM_REQUESTS), (1, 1_000)])
def test_serve_10k_requests_vs_hash_chain(benchmark, requests: list[list[int]], page_size: int,
                                          baseline_requests: int) -> None:
    num_pages = 16_000_000 // page_size  # room for every request: eviction is benchmarked below

    def run() -> RadixCache:
        cache = RadixCache(PageAllocator(num_pages, page_size), page_size)
        serve_radix(cache, requests)
        return cache

    cache = benchmark.pedantic(run, rounds=1, iterations=1)
    ours = benchmark.stats.stats.min / len(requests)
    cache.check_invariants(torch.empty(0, dtype=torch.int64))
    baseline = HashChainCache(PageAllocator(num_pages, page_size))
    base = _seconds(lambda: serve_hash_chain(baseline, requests[:baseline_requests])) / baseline_requests
    ratio = base / ours
    hit_rate = cache.hit_tokens / cache.query_tokens
    benchmark.extra_info.update(ours_us_per_request=ours * 1e6, baseline_us_per_request=base * 1e6,
                                speedup=ratio, hit_rate=hit_rate, nodes=cache.num_nodes)
    print(f"\npage_size {page_size}: radix {ours * 1e6:.0f} us/request, hash chain {base * 1e6:.0f} us/request "
          f"-> {ratio:.1f}x (hit rate {hit_rate:.2f}, {cache.num_nodes} nodes, {cache.total_tokens} tokens)")
    # Token-granular: the radix must beat per-token hashing clearly (measured 3-6x). Page size 16: the
    # hash chain does one cheap Python step per page while the radix pays ~60 small torch ops per
    # request (validation, ownership masks), so it is slower here (measured ~0.5x on a loaded
    # 2-core CPU); the bound only guards against regressions.
    floor = 0.2 if page_size == 16 else 2.0
    assert ratio > floor, f"radix {ratio:.2f}x the hash-chain baseline, expected > {floor}x"


def build_tree(num_leaves: int) -> RadixCache:
    """A token-granular tree of about ``num_leaves`` leaves: random 9-token sequences, 256 first tokens."""
    cache = RadixCache(PageAllocator(num_leaves * 9 + 1, 1), 1)
    seqs = torch.randint(VOCAB, (num_leaves, 9), generator=torch.Generator().manual_seed(1))
    for tokens, slots in zip(seqs.tolist(), cache.allocator.alloc(num_leaves * 9).view(num_leaves, 9), strict=True):
        cache.allocator.free(slots[: cache.insert(tokens, slots)])  # the caller's duplicates
    for tokens in seqs[::7].tolist():  # re-touch some entries: stale heap entries, a shuffled LRU order
        cache.match_prefix(tokens + [0])
    return cache


def lru_leaf_by_tree_walk(cache: RadixCache) -> RadixNode:
    """Baseline eviction choice: walk the whole tree for unlocked leaves, take the least recently used.

    Only the choice is timed (not the removal), so the baseline is charged less than a real call.
    """
    root = cache._root  # noqa: SLF001 - the baseline needs the tree itself
    leaves, stack = [], [root]
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        if not node.children and node is not root and node.lock_ref == 0:
            leaves.append(node)
    return min(leaves, key=lambda n: n.last_access)


def test_evict_at_100k_nodes_vs_tree_walk(benchmark) -> None:
    cache = build_tree(100_000)
    assert cache.num_nodes >= 100_000
    benchmark.pedantic(cache.evict, args=(4,), rounds=2_000, iterations=1, warmup_rounds=10)
    ours = benchmark.stats.stats.median
    walk = min(_seconds(lambda: lru_leaf_by_tree_walk(cache)) for _ in range(5))
    ratio = walk / ours
    benchmark.extra_info.update(ours_ms=ours * 1e3, tree_walk_ms=walk * 1e3, speedup=ratio, nodes=cache.num_nodes)
    print(f"\nevict(4) at {cache.num_nodes} nodes: {ours * 1e3:.3f} ms median per call (target < 0.5 ms), "
          f"whole-tree walk {walk * 1e3:.1f} ms -> {ratio:.0f}x")
    cache.check_invariants(torch.empty(0, dtype=torch.int64))
    assert ratio > 20, f"evict only {ratio:.1f}x faster than a whole-tree walk"
