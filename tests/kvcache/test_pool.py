"""PageAllocator, KVPool and pages_to_slots: exact scenarios, a reference model, bad input."""

from __future__ import annotations

import gc
import mmap

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from treeserve.kvcache import InvariantError, KVPool, OutOfPagesError, PageAllocator, pages_to_slots


def long(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def state(a: PageAllocator) -> tuple[int, list[int]]:
    """Observable allocator state: number free and which pages are free."""
    return a.num_free, a.is_free(torch.arange(a.num_pages)).nonzero().flatten().tolist()


def test_fresh_allocator_hands_out_low_pages_never_the_dummy() -> None:
    a = PageAllocator(6, page_size=4)
    assert (a.capacity, a.num_free, a.num_used) == (5, 5, 0)
    assert a.alloc(2).tolist() == [1, 2]
    assert a.alloc(3).tolist() == [3, 4, 5]
    assert a.num_free == 0
    with pytest.raises(OutOfPagesError, match="only 0 of 5"):
        a.alloc(1)
    a.free(long([4, 2]))
    assert state(a) == (2, [2, 4])
    assert sorted(a.alloc(2).tolist()) == [2, 4]
    assert a.alloc(0).tolist() == []
    a.check_invariants()


def test_alloc_returns_an_owned_tensor() -> None:
    a = PageAllocator(8)
    pages = a.alloc(3)
    a.free(pages.clone())
    a.alloc(7)  # reuses the stack entries; the tensor handed out earlier must not change
    assert pages.tolist() == [1, 2, 3]


@given(st.lists(st.tuples(st.booleans(), st.integers(0, 9)), max_size=40))
def test_allocator_matches_a_set_model(ops: list[tuple[bool, int]]) -> None:
    a = PageAllocator(10)
    used: list[int] = []
    for is_alloc, n in ops:
        if is_alloc:
            if n > a.num_free:
                with pytest.raises(OutOfPagesError):
                    a.alloc(n)
                continue
            pages = a.alloc(n).tolist()
            assert not set(pages) & set(used) and 0 not in pages and len(set(pages)) == n
            used += pages
        else:
            give_back, used = used[: n % (len(used) + 1)], used[n % (len(used) + 1) :]
            a.free(long(give_back))
        assert a.num_free == 9 - len(used)
        assert state(a)[1] == sorted(set(range(1, 10)) - set(used))
        a.check_invariants()


@pytest.mark.parametrize(
    ("n", "error", "match"),
    [(-1, ValueError, r"n must be in \[0, capacity=4\]"), (5, ValueError, "capacity=4"), (2.0, TypeError, "int")],
)
def test_bad_alloc_leaves_state_unchanged(n: object, error: type[Exception], match: str) -> None:
    a = PageAllocator(5)
    a.alloc(1)
    before = state(a)
    with pytest.raises(error, match=match):
        a.alloc(n)  # type: ignore[arg-type]
    assert state(a) == before


@pytest.mark.parametrize(
    ("pages", "error", "match"),
    [
        (long([0]), ValueError, "dummy page"),
        (long([7]), ValueError, r"\[1, num_pages=6\)"),
        (long([-1]), ValueError, r"\[1, num_pages=6\)"),
        (long([3]), ValueError, "already free"),
        (long([1, 2, 1]), ValueError, "more than once"),
        (long([1, 3]), ValueError, "already free"),
        (torch.tensor([1.0]), TypeError, "int64"),
        (long([[1]]), ValueError, "1-D"),
        ([1], TypeError, "torch.Tensor"),
    ],
)
def test_bad_free_leaves_state_unchanged(pages: object, error: type[Exception], match: str) -> None:
    a = PageAllocator(6)
    a.alloc(2)  # pages 1 and 2 are in use
    before = state(a)
    with pytest.raises(error, match=match):
        a.free(pages)  # type: ignore[arg-type]
    assert state(a) == before
    a.check_invariants()


def test_check_invariants_catches_corruption() -> None:
    a = PageAllocator(6)
    a.alloc(2)
    a._is_free[1] = True  # noqa: SLF001 - deliberate corruption
    with pytest.raises(InvariantError, match="free mask counts 4 pages, num_free=3"):
        a.check_invariants()


@pytest.mark.parametrize("bad", [{"num_pages": 1}, {"page_size": 0}, {"num_pages": 4.5}])
def test_allocator_rejects_bad_construction(bad: dict[str, object]) -> None:
    kwargs: dict[str, object] = {"num_pages": 4, "page_size": 1} | bad
    with pytest.raises(ValueError, match=next(iter(bad))):
        PageAllocator(**kwargs)  # type: ignore[arg-type]


@given(st.lists(st.integers(0, 50), max_size=8, unique=True), st.integers(1, 5))
def test_pages_to_slots_matches_python(pages: list[int], page_size: int) -> None:
    expected = [p * page_size + j for p in pages for j in range(page_size)]
    assert pages_to_slots(long(pages), page_size).tolist() == expected


def test_pages_to_slots_rejects_bad_input() -> None:
    with pytest.raises(TypeError, match="int64"):
        pages_to_slots(torch.tensor([1], dtype=torch.int32), 2)
    with pytest.raises(ValueError, match="page_size must be >= 1"):
        pages_to_slots(long([1]), 0)


def test_kv_pool_shapes_memory_and_slot_addressing() -> None:
    pool = KVPool(num_layers=3, num_pages=5, page_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float16)
    assert len(pool.k_caches) == len(pool.v_caches) == 3
    for buf in pool.k_caches + pool.v_caches:
        assert buf.shape == (5, 4, 2, 8) and buf.dtype == torch.float16
    assert len({b.data_ptr() for b in pool.k_caches + pool.v_caches}) == 6
    assert pool.memory_bytes == sum(b.numel() * b.element_size() for b in pool.k_caches + pool.v_caches)
    assert KVPool.bytes_per_page(3, 4, 2, 8, torch.float32) == 2 * 3 * 4 * 2 * 8 * 4
    assert (pool.allocator.capacity, pool.allocator.page_size) == (4, 4)
    # slot 9 = page 2, offset 1 in the flattened [num_pages * page_size, H, D] view
    pool.k_caches[0].view(-1, 2, 8)[9] = 1.0
    assert bool((pool.k_caches[0][2, 1] == 1.0).all()) and float(pool.k_caches[0].sum()) == 16.0


@pytest.mark.parametrize("num_pages", [5, 3000, 40000])
def test_kv_pool_buffers_start_page_aligned_and_zero(num_pages: int) -> None:
    """Small and large (calloc'd through mmap: 16 bytes past a page when not re-aligned) buffers
    alike start on a 4096-byte boundary, so every cache row of a power-of-two size sits in the
    fewest cache lines; buffers of 2 MiB or more (15 MB here at 40000 pages) start on a 2 MiB
    huge-page boundary where the OS takes the huge-page advice; they read as zeros, are
    independent, and outlive everything but themselves (the mapping stays alive)."""
    pool = KVPool(num_layers=2, num_pages=num_pages, page_size=1, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16)
    gc.collect()
    huge = num_pages * 3 * 64 * 2 >= 2 << 20 and hasattr(mmap, "MADV_HUGEPAGE")
    for buf in pool.k_caches + pool.v_caches:
        assert buf.data_ptr() % (2 << 20 if huge else 4096) == 0 and buf.is_contiguous()
        assert not bool(buf[-1].any()) and not bool(buf[0].any())
    pool.k_caches[0][-1] = 1.0
    assert float(pool.k_caches[0].sum()) == 192.0 and not bool(pool.v_caches[0].any())


@pytest.mark.parametrize(
    ("bad", "error", "match"),
    [
        ({"num_layers": 0}, ValueError, "num_layers"),
        ({"num_kv_heads": 0}, ValueError, "num_kv_heads"),
        ({"head_dim": -1}, ValueError, "head_dim"),
        ({"dtype": torch.int32}, TypeError, "dtype"),
        ({"num_pages": 1}, ValueError, "num_pages"),
    ],
)
def test_kv_pool_rejects_bad_parameters(bad: dict[str, object], error: type[Exception], match: str) -> None:
    kwargs: dict[str, object] = {"num_layers": 1, "num_pages": 4, "page_size": 2, "num_kv_heads": 1, "head_dim": 4}
    with pytest.raises(error, match=match):
        KVPool(**(kwargs | bad))  # type: ignore[arg-type]
