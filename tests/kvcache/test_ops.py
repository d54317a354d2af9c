"""store_kv / compact_tree_path / rollback_slots: torch and Triton against plain references."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests._devices import backend_device
from treeserve.kvcache import RollbackPlan, compact_tree_path, padded_path_moves, rollback_slots, store_kv

BACKENDS = ["torch", "triton"]  # triton: on CUDA where present, else the interpreter


def on(backend: str, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``tensors`` on the device a test of ``backend`` runs on (``tests._devices``)."""
    dev = backend_device(backend)
    return tuple(t.to(dev) for t in tensors)


def caches(num_pages: int, page_size: int, h: int, d: int, dtype: torch.dtype = torch.float32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    shape = (num_pages, page_size, h, d)
    return torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype)


# ---------------------------------------------------------------- store_kv


@pytest.mark.parametrize("backend", BACKENDS)
@given(
    data=st.data(),
    page_size=st.sampled_from([1, 4, 16]),
    h=st.integers(1, 3),
    d=st.sampled_from([4, 8]),
    index_dtype=st.sampled_from([torch.int32, torch.int64]),
)
def test_store_kv_matches_plain_loop(
    data: st.DataObject, backend: str, page_size: int, h: int, d: int, index_dtype: torch.dtype
) -> None:
    num_pages = data.draw(st.integers(2, 5))
    total = num_pages * page_size
    slots = data.draw(st.lists(st.integers(0, total - 1), max_size=min(total, 12), unique=True))
    kc, vc = caches(num_pages, page_size, h, d)
    k = torch.randn(len(slots), h, d)
    v = torch.randn(len(slots), h, d)
    want_k, want_v = kc.clone(), vc.clone()
    for i, s in enumerate(slots):  # the oracle: one token at a time, page/offset arithmetic
        want_k[s // page_size, s % page_size] = k[i]
        want_v[s // page_size, s % page_size] = v[i]
    kc, vc, idx, k, v = on(backend, kc, vc, torch.tensor(slots, dtype=index_dtype), k, v)
    store_kv(kc, vc, idx, k, v, backend=backend)
    assert torch.equal(kc.cpu(), want_k) and torch.equal(vc.cpu(), want_v)


@pytest.mark.parametrize("backend", BACKENDS)
def test_store_kv_bfloat16(backend: str) -> None:
    kc, vc = caches(3, 4, 2, 8, torch.bfloat16)
    k = torch.randn(3, 2, 8).bfloat16()
    v = torch.randn(3, 2, 8).bfloat16()
    kc, vc, slots, k, v = on(backend, kc, vc, torch.tensor([11, 0, 5]), k, v)
    store_kv(kc, vc, slots, k, v, backend=backend)
    flat_k, flat_v = kc.view(-1, 2, 8), vc.view(-1, 2, 8)
    assert torch.equal(flat_k[slots], k) and torch.equal(flat_v[slots], v)


def test_store_kv_rejects_bad_input_without_writing() -> None:
    kc, vc = caches(2, 4, 2, 8)
    before = kc.clone(), vc.clone()
    k = torch.randn(2, 2, 8)
    slots = torch.tensor([1, 2])
    cases = [
        ((kc, vc, torch.tensor([1]), k, k), ValueError, r"k must be \[N=1"),
        ((kc, vc, torch.tensor([1, 8]), k, k), ValueError, r"slots must lie in \[0, 8\), got values in \[1, 8\]"),
        ((kc, vc, torch.tensor([-1, 2]), k, k), ValueError, r"slots must lie in \[0, 8\)"),
        ((kc, vc, slots.float(), k, k), TypeError, "slots must be int32 or int64"),
        ((kc, vc, slots, k.double(), k), TypeError, "k dtype"),
        ((kc, vc, slots, k, k[:, :1]), ValueError, "v must be"),
        ((kc, vc.double(), slots, k, k), TypeError, "k/v cache dtypes differ"),
        ((kc[0], vc[0], slots, k, k), ValueError, r"k_cache must be \[num_pages"),
        ((kc, vc, slots[None], k, k), ValueError, "slots must have 1 dim"),
    ]
    for args, exc, match in cases:
        with pytest.raises(exc, match=match):
            store_kv(*args)
    with pytest.raises(ValueError, match="backend"):
        store_kv(kc, vc, slots, k, k, backend="flashinfer")
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])


# ---------------------------------------------------------------- compact_tree_path


@pytest.mark.parametrize("backend", BACKENDS)
@given(data=st.data(), page_size=st.sampled_from([1, 4]), layers=st.integers(1, 3))
def test_compact_reads_every_source_before_writing(
    data: st.DataObject, backend: str, page_size: int, layers: int
) -> None:
    num_pages = 4
    total = num_pages * page_size
    dst = data.draw(st.lists(st.integers(0, total - 1), max_size=min(total, 10), unique=True))
    # sources drawn from the same small range, so they overlap destinations in any order
    src = data.draw(st.lists(st.integers(0, total - 1), min_size=len(dst), max_size=len(dst)))
    kcs, vcs = zip(*(caches(num_pages, page_size, 2, 4, seed=s) for s in range(layers)))
    kcs, vcs = list(kcs), list(vcs)
    want = [(kc.clone(), vc.clone()) for kc, vc in zip(kcs, vcs)]
    for (wk, wv), kc, vc in zip(want, kcs, vcs):
        for s, t in zip(src, dst):  # oracle: copy from a snapshot of the original cache
            wk.view(-1, 2, 4)[t] = kc.view(-1, 2, 4)[s]
            wv.view(-1, 2, 4)[t] = vc.view(-1, 2, 4)[s]
    kcs, vcs = list(on(backend, *kcs)), list(on(backend, *vcs))
    compact_tree_path(kcs, vcs, *on(backend, torch.tensor(src).long(), torch.tensor(dst).long()), backend=backend)
    for (wk, wv), kc, vc in zip(want, kcs, vcs):
        assert torch.equal(kc.cpu(), wk) and torch.equal(vc.cpu(), wv)


@pytest.mark.parametrize("backend", BACKENDS)
def test_compact_shift_left_chain(backend: str) -> None:
    """The typical tree case: accepted nodes 2, 3, 5 moved to slots 1, 2, 3 of one run of slots."""
    kc, vc = caches(8, 1, 1, 4)
    orig = kc.clone()
    kc, vc, src, dst = on(backend, kc, vc, torch.tensor([2, 3, 5]), torch.tensor([1, 2, 3]))
    compact_tree_path([kc], [vc], src, dst, backend=backend)
    kc = kc.cpu()
    assert torch.equal(kc[1:4], orig[[2, 3, 5]]) and torch.equal(kc[4:], orig[4:]) and torch.equal(kc[0], orig[0])


def test_compact_rejects_bad_input_without_writing() -> None:
    kc, vc = caches(2, 4, 2, 8)
    k2, v2 = caches(3, 4, 2, 8)
    before = kc.clone()
    src, dst = torch.tensor([1, 2]), torch.tensor([3, 4])
    cases = [
        (([kc], [vc], src, dst[:1]), ValueError, "same length"),
        (([kc], [vc], src, torch.tensor([5, 5])), ValueError, "dst_slots must be distinct"),
        (([kc], [vc], torch.tensor([1, 9]), dst), ValueError, r"src_slots must lie in \[0, 8\)"),
        (([kc], [vc, vc], src, dst), ValueError, "equally long"),
        (([], [], src, dst), ValueError, "non-empty"),
        (([kc, k2], [vc, v2], src, dst), ValueError, r"k_caches\[1\] differs"),
        (([kc], [vc], src.float(), dst), TypeError, "src_slots must be int32 or int64"),
    ]
    for args, exc, match in cases:
        with pytest.raises(exc, match=match):
            compact_tree_path(*args)
    assert torch.equal(kc, before)


# ---------------------------------------------------------------- rollback_slots


def test_rollback_chain() -> None:
    draft = torch.tensor([[10, 11, 12, 13], [20, 21, 22, 0]])
    plan = rollback_slots(draft, torch.tensor([4, 3]), torch.tensor([1, 3]))
    assert isinstance(plan, RollbackPlan)
    assert plan.src_slots.numel() == 0 and plan.dst_slots.numel() == 0
    assert plan.free_slots.tolist() == [11, 12, 13]
    assert plan.num_kept.tolist() == [1, 3]


def test_rollback_tree_path() -> None:
    draft = torch.tensor([[10, 11, 12, 13, 14], [20, 21, 22, 23, 24]])
    accepted = torch.tensor([[0, 2, 4], [0, 1, -1]])
    plan = rollback_slots(draft, torch.tensor([5, 4]), accepted)
    assert plan.src_slots.tolist() == [12, 14] and plan.dst_slots.tolist() == [11, 12]
    assert plan.free_slots.tolist() == [13, 14, 22, 23]
    assert plan.num_kept.tolist() == [3, 2]


@st.composite
def tree_verdicts(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
    b = draw(st.integers(1, 4))
    k = draw(st.integers(1, 6))
    nd = [draw(st.integers(0, k)) for _ in range(b)]
    slots = torch.tensor(draw(st.permutations(range(100, 100 + b * k))), dtype=torch.long).view(b, k)
    paths = [sorted(draw(st.sets(st.integers(0, n - 1), max_size=n))) if n else [] for n in nd]
    return slots, torch.tensor(nd), paths


@given(tree_verdicts())
def test_rollback_then_compact_keeps_accepted_kv_in_place(verdict: tuple) -> None:
    """Applying the plan leaves each request's accepted KV, in path order, in its first slots."""
    slots, nd, paths = verdict
    b, k = slots.shape
    p = max(1, max(len(x) for x in paths))
    accepted = torch.full((b, p), -1, dtype=torch.long)
    for r, path in enumerate(paths):
        accepted[r, : len(path)] = torch.tensor(path, dtype=torch.long)
    plan = rollback_slots(slots, nd, accepted)
    kc = torch.arange(200, dtype=torch.float32).view(200, 1, 1, 1)  # value = original slot
    vc = kc.clone()
    compact_tree_path([kc], [vc], plan.src_slots, plan.dst_slots, backend="torch")
    freed = set(plan.free_slots.tolist())
    for r, path in enumerate(paths):
        kept = slots[r, : len(path)]
        assert kc[kept].flatten().tolist() == [float(slots[r, n]) for n in path]
        assert plan.num_kept[r] == len(path)
        assert freed & set(kept.tolist()) == set()
        assert set(slots[r, len(path) : int(nd[r])].tolist()) <= freed
    assert len(freed) == int(nd.sum()) - sum(map(len, paths)) == plan.free_slots.numel()


@given(verdict=tree_verdicts(), page_size=st.sampled_from([1, 4]))
def test_padded_moves_compact_like_the_plan(verdict: tuple, page_size: int) -> None:
    """The fixed-shape moves (padding as 0 -> 0 on the dummy page) leave the cache exactly as
    the plan's moves do: every real slot equal, the dummy page untouched."""
    slots, nd, paths = verdict
    b, k = slots.shape
    accepted = torch.full((b, k), -1, dtype=torch.long)
    for r, path in enumerate(paths):
        accepted[r, : len(path)] = torch.tensor(path, dtype=torch.long)
    src, dst = padded_path_moves(slots, accepted)
    assert src.shape == dst.shape == (b * k,)
    plan = rollback_slots(slots, nd, accepted)
    ref = torch.arange(200, dtype=torch.float32).view(200 // page_size, page_size, 1, 1)
    got = ref.clone()
    compact_tree_path([ref], [ref.clone()], plan.src_slots, plan.dst_slots, backend="torch")
    compact_tree_path([got], [got.clone()], src, dst, backend="torch")
    assert torch.equal(got, ref)
    moved = (src != 0) | (dst != 0)
    assert moved.sum() == plan.src_slots.numel()


@pytest.mark.parametrize(
    ("num_draft", "accepted", "match"),
    [
        ([3, 4], [4, 1], r"accepted lengths must lie in \[0, num_draft\[b\]\]"),
        ([3, 4], [-1, 1], "accepted lengths"),
        ([3, 5], [1, 1], r"num_draft must lie in \[0, 5\)"),
        ([3], [1], "num_draft must have B=2"),
        ([3, 4], [[0, 2], [1, 1]], "strictly increasing"),
        ([3, 4], [[0, 3], [1, -1]], r"node indices must lie in \[0, num_draft\[b\]\)"),
        ([3, 4], [[-1, 1], [1, -1]], "followed only by -1 padding"),
        ([3, 4], [[0, 1, 2, 3, 3]], "B=2 rows"),
        ([3, 4], [[0, 1, 2, 3, -1], [0, 1, 2, 3, -1]], "P=5 columns"),
    ],
)
def test_rollback_rejects_bad_input(num_draft: list, accepted: list, match: str) -> None:
    draft = torch.arange(8).view(2, 4)
    with pytest.raises(ValueError, match=match):
        rollback_slots(draft, torch.tensor(num_draft), torch.tensor(accepted))


def test_rollback_rejects_bad_types() -> None:
    with pytest.raises(TypeError, match="draft_slots must be int32 or int64"):
        rollback_slots(torch.zeros(2, 2), torch.tensor([1, 1]), torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="accepted must be"):
        rollback_slots(torch.zeros(2, 2).long(), torch.tensor([1, 1]), torch.zeros(2, 2, 2).long())
