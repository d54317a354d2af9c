"""The radix tree's use of its tiers: a promotion in flight (CUDA) defers admission and keeps its
node locked; a promotion takes only the pages it can have; a tree without tiers never hashes."""

from __future__ import annotations

import pytest
import torch

from treeserve.kvcache import KVPool, KVTiers, RadixCache, TierLayout, pages_to_slots

CHUNK = 4


class FakeEvent:
    """Stands for a CUDA event of a host -> device copy on the side stream."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


def build(num_pages: int = 33, host_tokens: int = 64) -> tuple[KVPool, KVTiers, RadixCache]:
    pool = KVPool(1, num_pages, 1, 1, 1, torch.float64)
    tiers = KVTiers(pool, TierLayout("m", torch.float64, 1, 1, 1, 1, CHUNK), host_tokens)
    return pool, tiers, RadixCache(pool.allocator, 1, tiers=tiers)


def cache_and_demote(pool: KVPool, cache: RadixCache, tokens: list[int]) -> None:
    slots = pages_to_slots(pool.allocator.alloc(len(tokens)), 1)
    pool.k_caches[0].view(-1)[slots] = torch.tensor(tokens, dtype=torch.float64)
    cache.release_request(tokens, slots, None)
    cache.evict(cache.evictable_tokens)
    assert cache.total_tokens == 0


def test_admission_waits_for_a_promotion_in_flight(monkeypatch) -> None:
    pool, tiers, cache = build()
    tokens = list(range(10, 27))  # 17 tokens: 4 whole chunks, 16 promotable
    cache_and_demote(pool, cache, tokens)
    event = FakeEvent()
    real_load = tiers.load

    def async_load(fetched, start, slots):  # noqa: ANN001, ANN202
        real_load(fetched, start, slots)
        return event

    monkeypatch.setattr(tiers, "load", async_load)
    assert cache.prefetch(tokens) is False  # the copy is in flight: not admitted yet
    assert cache.protected_tokens == 16 and cache.evict(100) == 0  # the loading node is locked
    cache.check_invariants()
    assert cache.prefetch(tokens) is False
    assert cache.prefetch(list(range(50, 60))) is True  # other prefixes are not held back
    event.done = True
    assert cache.prefetch(tokens) is True and cache.protected_tokens == 0
    assert cache.prefix_len(tokens) == 16
    cache.check_invariants()


def test_promotion_takes_only_the_pages_it_can_have() -> None:
    pool, tiers, cache = build(num_pages=14)  # 13 pages
    tokens = list(range(100, 117))
    cache_and_demote(pool, cache, tokens[:12] + [999])  # 12 tokens: 3 chunks on the host
    held = pool.allocator.alloc(6)  # a running request holds 6 pages
    assert cache.prefetch(tokens, headroom=2)
    assert cache.prefix_len(tokens) == 5  # 7 free - 2 headroom = 5 pages
    cache.check_invariants(request_pages=held)
    assert cache.match_prefix(tokens).length == 7  # no headroom asked: the 2 still free
    cache.check_invariants(request_pages=held)
    m = cache.match_prefix(tokens)
    assert pool.k_caches[0].view(-1)[m.slots].tolist() == [float(t) for t in tokens[: m.length]]


def test_a_tree_without_tiers_never_hashes(monkeypatch) -> None:
    import treeserve.kvcache.tiers as tiers_mod

    monkeypatch.setattr(tiers_mod, "chunk_keys", lambda *a: (_ for _ in ()).throw(AssertionError("hashed")))
    pool = KVPool(1, 17, 1, 1, 1, torch.float64)
    cache = RadixCache(pool.allocator, 1)
    slots = pages_to_slots(pool.allocator.alloc(9), 1)
    cache.release_request(list(range(9)), slots, None)
    cache.evict(9)
    assert cache.prefetch(list(range(9))) and cache.match_prefix(list(range(9))).length == 0


def test_bandwidth_bench_runs() -> None:
    """``benches/bench_kv_tiers.py --bandwidth`` (the GPU session's promotion check) runs on CPU."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benches" / "bench_kv_tiers.py"
    spec = importlib.util.spec_from_file_location("bench_kv_tiers", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    promote, copy = bench.promotion_bandwidth("cpu", tokens=128, reps=1)
    assert promote > 0 and copy > 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize(("tokens", "page_size"), [(41, 1), (40, 4), (23, 4)])
def test_demote_then_promote_restores_every_layer_bitwise(device: str, tokens: int, page_size: int) -> None:
    """KV of several chunks (the last one partial or not), 3 layers, K and V distinct, leaves the
    device pool through the host tier and comes back (on CUDA through the pinned side-stream copy
    and one scatter per layer): every value of every promoted slot is the one evicted."""
    gen = torch.Generator().manual_seed(tokens)
    layers, heads, dim, dtype = 3, 2, 4, torch.bfloat16
    pool = KVPool(layers, 64 // page_size + 1, page_size, heads, dim, dtype, device)
    tiers = KVTiers(pool, TierLayout("m", dtype, layers, heads, dim, page_size, 8), 128)
    cache = RadixCache(pool.allocator, page_size, tiers=tiers)
    ids = list(range(7, 7 + tokens))
    slots = pages_to_slots(pool.allocator.alloc(-(-tokens // page_size)), page_size)[:tokens]
    values = [torch.randn(2, tokens, heads, dim, generator=gen).to(dtype) for _ in range(layers)]
    for layer, kv in enumerate(values):
        pool.k_caches[layer].view(-1, heads, dim)[slots] = kv[0].to(device)
        pool.v_caches[layer].view(-1, heads, dim)[slots] = kv[1].to(device)
    cache.release_request(ids, slots, None)
    cache.evict(cache.evictable_tokens)
    assert cache.total_tokens == 0
    while not cache.prefetch(ids):  # CUDA: the copy is in flight until its event completes
        torch.cuda.synchronize()
    m = cache.match_prefix(ids)
    # promoted: whole chunks; matched: whole pages, the last token excluded
    assert m.length == min(tokens // 8 * 8, (tokens - 1) // page_size * page_size) > 0
    for layer, kv in enumerate(values):
        assert torch.equal(pool.k_caches[layer].view(-1, heads, dim)[m.slots].cpu(), kv[0, : m.length])
        assert torch.equal(pool.v_caches[layer].view(-1, heads, dim)[m.slots].cpu(), kv[1, : m.length])
    cache.check_invariants()
