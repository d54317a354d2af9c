"""RadixCache scenarios with exact expected states, and bad input leaving state unchanged."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import pytest
import torch

from treeserve.kvcache import InvariantError, LockHandle, PageAllocator, RadixCache, RadixNode, pages_to_slots

NO_PAGES = torch.empty(0, dtype=torch.int64)


def make(page_size: int = 1, num_pages: int = 64, disable: bool = False) -> RadixCache:
    return RadixCache(PageAllocator(num_pages, page_size), page_size, disable=disable)


def slots_for(cache: RadixCache, num_tokens: int) -> torch.Tensor:
    """Allocate pages for ``num_tokens`` tokens (the last page may be partly used)."""
    ps = cache.page_size
    return pages_to_slots(cache.allocator.alloc(-(-num_tokens // ps)), ps)[:num_tokens]


def tree(cache: RadixCache) -> dict[tuple[int, ...], Any]:
    """The tree as nested dicts ``{edge key: (slots, lock_ref, subtree)}`` (test-only introspection)."""

    def walk(node: RadixNode) -> dict[tuple[int, ...], Any]:
        return {c.key: (c.value.tolist(), c.lock_ref, walk(c)) for c in node.children.values()}

    return walk(cache._root)  # noqa: SLF001


def snapshot(cache: RadixCache) -> tuple[Any, ...]:
    a = cache.allocator
    free = a.is_free(torch.arange(a.num_pages)).nonzero().flatten().tolist()
    counters = (cache.evictable_tokens, cache.protected_tokens, cache.hit_tokens, cache.query_tokens)
    return tree(cache), free, counters, cache.num_nodes, len(cache._locks)  # noqa: SLF001


def test_token_granular_insert_match_and_split() -> None:
    c = make()
    s = slots_for(c, 4)  # slots 1..4
    assert c.insert([1, 2, 3, 4], s) == 0
    assert tree(c) == {(1, 2, 3, 4): ([1, 2, 3, 4], 0, {})}
    m = c.match_prefix([1, 2, 3, 4, 5])
    assert (m.length, m.slots.tolist()) == (4, [1, 2, 3, 4])
    m = c.match_prefix([1, 2, 3, 4])  # never the whole query: at most 3 tokens, so the edge splits
    assert (m.length, m.slots.tolist(), m.node.key) == (3, [1, 2, 3], (1, 2, 3))
    assert tree(c) == {(1, 2, 3): ([1, 2, 3], 0, {(4,): ([4], 0, {})})}
    assert c.match_prefix([1, 2, 9]).length == 2
    assert tree(c) == {(1, 2): ([1, 2], 0, {(3,): ([3], 0, {(4,): ([4], 0, {})})})}
    s2 = slots_for(c, 4)  # slots 5..8; the first two duplicate cached tokens
    assert c.insert([1, 2, 5, 6], s2) == 2
    assert tree(c) == {(1, 2): ([1, 2], 0, {(3,): ([3], 0, {(4,): ([4], 0, {})}), (5, 6): ([7, 8], 0, {})})}
    assert (c.num_nodes, c.total_tokens, c.evictable_tokens) == (4, 6, 6)
    assert (c.hit_tokens, c.query_tokens) == (4 + 3 + 2, 5 + 4 + 3)
    c.allocator.free(s2[:2])  # the caller frees its duplicates
    c.check_invariants(NO_PAGES)


def test_page_granular_matching() -> None:
    c = make(page_size=4)
    toks = list(range(100, 110))
    s = slots_for(c, 10)  # pages 1, 2, 3 -> slots 4..15
    assert c.insert(toks, s) == 0
    assert tree(c) == {tuple(toks[:8]): (list(range(4, 12)), 0, {})}
    assert c.total_tokens == 8  # the unaligned tail (2 tokens, page 3) stays with the caller
    assert c.match_prefix(toks).length == 8
    assert c.match_prefix(toks[:8]).length == 4  # capped at 7 tokens, rounded down to a page
    assert c.match_prefix(toks[:5] + [0, 0, 0, 0]).length == 4  # mismatch inside page 2
    assert c.match_prefix([100, 0] + toks[2:]).length == 0  # mismatch inside page 1
    assert c.match_prefix(toks[:4]).length == 0
    assert c.match_prefix([]).length == 0
    assert tree(c) == {tuple(toks[:4]): ([4, 5, 6, 7], 0, {tuple(toks[4:8]): ([8, 9, 10, 11], 0, {})})}
    c.check_invariants(torch.tensor([3]))


def test_insert_shares_only_whole_pages() -> None:
    c = make(page_size=2)
    a = slots_for(c, 6)  # pages 1, 2, 3
    c.insert([1, 2, 3, 4, 5, 6], a)
    b = slots_for(c, 6)  # pages 4, 5, 6; shares tokens [1, 2, 3] with a: one whole page
    assert c.insert([1, 2, 3, 9, 9, 9], b) == 2
    assert tree(c) == {
        (1, 2): ([2, 3], 0, {(3, 4, 5, 6): ([4, 5, 6, 7], 0, {}), (3, 9, 9, 9): ([10, 11, 12, 13], 0, {})})
    }
    c.allocator.free(torch.tensor([4]))
    c.check_invariants(NO_PAGES)


def test_evicts_least_recently_used_leaves_and_then_emptied_parents() -> None:
    c = make()
    c.insert([1, 2, 3, 4], slots_for(c, 4))  # slots 1..4
    c.insert([1, 2, 5, 6], s := slots_for(c, 4))  # slots 5..8, 5 and 6 are duplicates
    c.allocator.free(s[:2])
    c.insert([7, 8], slots_for(c, 2))  # reuses freed slots 6, 5 (LIFO)
    c.match_prefix([1, 2, 3, 4, 0])  # touches [1,2] and [3,4]; [5,6] and [7,8] are older
    assert c.evict(1) == 2 and tree(c).keys() == {(1, 2), (7, 8)}
    assert c.allocator.is_free(torch.tensor([7, 8])).all()  # the [5,6] leaf's slots
    assert c.evict(1) == 2 and tree(c).keys() == {(1, 2)}
    assert c.evict(1) == 2 and tree(c) == {(1, 2): ([1, 2], 0, {})}
    assert c.evict(1) == 2 and tree(c) == {}  # [1,2] became a leaf when its last child went
    assert c.evict(1) == 0
    assert c.allocator.num_free == c.allocator.capacity
    c.check_invariants(NO_PAGES)


def test_evict_frees_at_least_the_request_in_whole_leaves() -> None:
    c = make()
    for t in range(3):
        c.insert([t, 1, 2], slots_for(c, 3))
    assert c.evict(4) == 6  # two whole leaves
    assert (c.total_tokens, c.num_nodes) == (3, 1)
    assert c.evict(0) == 0 and c.total_tokens == 3


def test_locks_protect_the_path_and_are_receipts() -> None:
    c = make()
    c.insert([1, 2, 3, 4], slots_for(c, 4))
    c.insert([1, 2, 5, 6], s := slots_for(c, 4))
    c.allocator.free(s[:2])
    node = c.match_prefix([1, 2, 3, 4, 9]).node
    h1, h2 = c.lock(node), c.lock(node)
    assert (c.protected_tokens, c.evictable_tokens) == (4, 2)
    assert tree(c) == {(1, 2): ([1, 2], 2, {(3, 4): ([3, 4], 2, {}), (5, 6): ([7, 8], 0, {})})}
    c.check_invariants(NO_PAGES)
    assert c.evict(100) == 2  # only the unlocked sibling leaf
    c.unlock(h1)
    assert c.evict(100) == 0 and c.protected_tokens == 4
    c.unlock(h2)
    assert (c.protected_tokens, c.evictable_tokens) == (0, 4)
    before = snapshot(c)
    with pytest.raises(ValueError, match="already unlocked"):
        c.unlock(h1)
    assert snapshot(c) == before
    assert c.evict(100) == 4
    with pytest.raises(ValueError, match="not in this cache"):
        c.lock(node)  # evicted
    c.check_invariants(NO_PAGES)


def test_lock_survives_a_split_of_the_locked_edge() -> None:
    c = make()
    c.insert([1, 2, 3, 4], slots_for(c, 4))
    h = c.lock(c.match_prefix([1, 2, 3, 4, 5]).node)
    c.match_prefix([1, 2, 7])  # splits the locked edge
    assert tree(c) == {(1, 2): ([1, 2], 1, {(3, 4): ([3, 4], 1, {})})}
    c.check_invariants(NO_PAGES)
    c.unlock(h)
    assert c.evictable_tokens == 4
    c.check_invariants(NO_PAGES)


def test_locking_the_root_is_a_harmless_receipt() -> None:
    c = make()
    h = c.lock(c.match_prefix([5, 6]).node)
    assert c.protected_tokens == 0
    c.unlock(h)
    with pytest.raises(ValueError, match="already unlocked"):
        c.unlock(h)


def test_release_request_inserts_unlocks_and_frees_duplicates_and_tail() -> None:
    c = make(page_size=2, num_pages=32)
    first = slots_for(c, 5)  # pages 1, 2, 3 (page 3 half used)
    r = c.release_request([1, 2, 3, 4, 5], first, None)
    assert (r.cached_tokens, r.duplicate_tokens, r.freed_pages) == (4, 0, 1)
    assert c.allocator.is_free(torch.tensor([3])).all() and c.allocator.num_used == 2
    # second request: matches [1,2,3,4], computes 3 more tokens in a fresh page pair
    m = c.match_prefix([1, 2, 3, 4, 5, 6, 7])
    h = c.lock(m.node)
    slots = torch.cat([m.slots, slots_for(c, 3)])
    # meanwhile a third request cached [1..6] under other pages
    other = slots_for(c, 6)
    c.release_request([1, 2, 3, 4, 5, 6], other, None)  # duplicates pages 1, 2 of the tree
    assert c.allocator.num_used == 2 + 2 + 1  # tree [1..4], request 2's own 2 pages, tree [5, 6]
    r = c.release_request([1, 2, 3, 4, 5, 6, 7], slots, h)
    assert (r.cached_tokens, r.duplicate_tokens, r.freed_pages) == (6, 2, 2)  # [5,6] duplicate + tail
    assert c.allocator.num_used == 3 and c.protected_tokens == 0
    assert c.match_prefix([1, 2, 3, 4, 5, 6, 0]).slots.tolist() == [2, 3, 4, 5] + other[4:6].tolist()
    c.check_invariants(NO_PAGES)


def test_counters_and_reset() -> None:
    c = make()
    c.insert([1, 2, 3], slots_for(c, 3))
    c.match_prefix([1, 2, 3, 4])
    c.match_prefix([9, 9])
    assert (c.hit_tokens, c.query_tokens) == (3, 6)
    h = c.lock(c.match_prefix([1, 2, 3, 4]).node)
    with pytest.raises(ValueError, match="1 live locks"):
        c.reset()
    c.unlock(h)
    c.reset()
    assert snapshot(c) == ({}, list(range(1, 64)), (0, 0, 0, 0), 0, 0)
    c.check_invariants(NO_PAGES)


def test_disabled_cache_keeps_nothing() -> None:
    c = make(page_size=2, disable=True)
    s = slots_for(c, 5)
    assert c.insert([1, 2, 3, 4, 5], s) == 0
    assert c.match_prefix([1, 2, 3, 4, 5]).length == 0 and c.total_tokens == 0
    r = c.release_request([1, 2, 3, 4, 5], s, None)
    assert (r.cached_tokens, r.duplicate_tokens, r.freed_pages) == (0, 0, 3)
    assert c.allocator.num_free == c.allocator.capacity
    assert c.evict(10) == 0
    c.check_invariants(NO_PAGES)


def test_node_values_are_copies_of_caller_slots() -> None:
    c = make()
    s = slots_for(c, 3)
    c.insert([1, 2, 3], s)
    s.fill_(0)  # the caller reuses its buffer
    m = c.match_prefix([1, 2, 3, 4])
    assert m.slots.tolist() == [1, 2, 3]
    m.slots.fill_(0)  # and may modify what it was handed
    assert c.match_prefix([1, 2, 3, 4]).slots.tolist() == [1, 2, 3]
    c.check_invariants(NO_PAGES)


def test_tensor_tokens_are_accepted() -> None:
    c = make()
    c.insert(torch.tensor([4, 5, 6]), slots_for(c, 3))
    assert c.match_prefix(torch.tensor([4, 5, 6, 7], dtype=torch.int32)).length == 3


class Setup(NamedTuple):
    cache: RadixCache
    slots: torch.Tensor  # 4 slots (pages 3, 4) the caller owns
    spent: LockHandle  # a handle already unlocked


def _cache_with_entries() -> Setup:
    """ps=2 cache holding [1,2,3,4] (pages 1, 2) with one live lock; the caller holds pages 3, 4."""
    c = make(page_size=2, num_pages=8)
    c.insert([1, 2, 3, 4], slots_for(c, 4))
    c.lock(c.match_prefix([1, 2, 3]).node)
    spent = c.lock(c.match_prefix([1, 2, 3]).node)
    c.unlock(spent)
    return Setup(c, slots_for(c, 4), spent)


BAD_CALLS = [
    pytest.param(lambda c, s, h: c.insert([5, 6, 7], s), ValueError, "3 tokens and 4 slots", id="length mismatch"),
    pytest.param(lambda c, s, h: c.insert([5, 6, 7, 8], s.int()), TypeError, "int64", id="slot dtype"),
    pytest.param(lambda c, s, h: c.insert([5, 6, 7, 8], s[None]), TypeError, "1-D", id="slots 2-D"),
    pytest.param(lambda c, s, h: c.insert(torch.tensor([5.0, 6, 7, 8]), s), TypeError, "integer tensor", id="float tokens"),
    pytest.param(lambda c, s, h: c.match_prefix(torch.tensor([[5, 6]])), TypeError, "1-D", id="2-D tokens"),
    pytest.param(lambda c, s, h: c.match_prefix("abc"), TypeError, "sequence of token ids", id="str tokens"),
    pytest.param(lambda c, s, h: c.insert([5, 6, 7, 8], s.flip(0)), ValueError, "whole pages", id="not whole pages"),
    pytest.param(lambda c, s, h: c.insert([5, 6], torch.tensor([0, 1])), ValueError, "dummy page", id="dummy page"),
    pytest.param(lambda c, s, h: c.insert([5, 6], torch.tensor([12, 13])), ValueError, "free in the allocator", id="free pages"),
    pytest.param(lambda c, s, h: c.insert([5, 6, 7, 8], torch.cat([s[:2], s[:2]])), ValueError, "same page twice", id="page twice"),
    pytest.param(lambda c, s, h: c.insert([5, 6, 7, 8], torch.tensor([2, 3, 4, 5])), ValueError, "already owns", id="tree-owned"),
    pytest.param(lambda c, s, h: c.insert([1, 2, 5, 6], torch.tensor([4, 5, 6, 7])), ValueError, "already owns", id="tree-owned dup"),
    pytest.param(lambda c, s, h: c.evict(-1), ValueError, "num_tokens must be an int >= 0", id="evict negative"),
    pytest.param(lambda c, s, h: c.lock("x"), TypeError, "RadixNode", id="lock non-node"),
    pytest.param(lambda c, s, h: c.lock(make().match_prefix([1]).node), ValueError, "not in this cache", id="foreign node"),
    pytest.param(lambda c, s, h: c.unlock((o := make()).lock(o.match_prefix([1]).node)), ValueError, "not from", id="foreign handle"),
    pytest.param(lambda c, s, h: c.unlock(3), TypeError, "LockHandle", id="handle type"),
    pytest.param(lambda c, s, h: c.unlock(h), ValueError, "already unlocked", id="spent handle"),
    pytest.param(lambda c, s, h: c.release_request([5, 6, 7], s, None), ValueError, "3 tokens and 4 slots", id="release len"),
    pytest.param(lambda c, s, h: c.release_request([5, 6, 7, 8], s, h), ValueError, "already unlocked", id="release spent"),
    pytest.param(lambda c, s, h: c.release_request([5, 6], torch.tensor([2, 3]), None), ValueError, "already owns", id="release owned"),
]


@pytest.mark.parametrize(("call", "error", "match"), BAD_CALLS)
def test_bad_input_is_rejected_and_state_unchanged(
    call: Callable[[RadixCache, torch.Tensor, LockHandle], Any], error: type[Exception], match: str
) -> None:
    c, s, spent = _cache_with_entries()
    before = snapshot(c)
    with pytest.raises(error, match=match):
        call(c, s, spent)
    assert snapshot(c) == before
    c.check_invariants(s[::2] // 2)


def test_check_invariants_reports_precise_accounting_errors() -> None:
    c, s, _ = _cache_with_entries()
    own = s[::2] // 2
    c.check_invariants(own)
    with pytest.raises(InvariantError, match=r"free 3 \+ tree 2 .* \+ requests 1 = 6 pages != capacity 7"):
        c.check_invariants(own[:1])
    with pytest.raises(InvariantError, match="held both by a request and by the tree"):
        c.check_invariants(torch.tensor([1, 3, 4]))
    node = next(iter(c._root.children.values()))  # noqa: SLF001
    node.lock_ref += 1
    with pytest.raises(InvariantError, match="lock_ref=2 but 1 live locks"):
        c.check_invariants()
    node.lock_ref -= 1
    c.allocator.free(node.value[:1] // 2)  # a tree page freed behind the tree's back
    with pytest.raises(InvariantError, match="also on the allocator's free list"):
        c.check_invariants()


def test_heap_of_stale_entries_stays_bounded() -> None:
    c = make()
    c.insert([1, 2], slots_for(c, 2))
    c.insert([3, 4], slots_for(c, 2))
    for _ in range(500):  # every touch of a leaf pushes a fresh heap entry
        c.match_prefix([1, 2, 0])
    assert len(c._heap) <= 2 * 2 + 64 + 1  # noqa: SLF001 - the bound the rebuild keeps
    c.check_invariants(NO_PAGES)
    assert c.evict(1) == 2 and tree(c).keys() == {(1, 2)}  # [3,4] is still the LRU leaf
