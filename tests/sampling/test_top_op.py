"""Issue 15: the C++ top-k operator behind CPU sampling (``treeserve.sampling._top_op``) against
torch's stable descending sort (values, ids with ties by id, NaN largest) and a float64 mass."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from treeserve.sampling import _top_op
from treeserve.sampling._top_op import load_top_op, top_candidates, topk_rows

pytestmark = pytest.mark.skipif(load_top_op() is not None, reason="no C++ compiler: the torch path is used")


@st.composite
def rows_case(draw: st.DrawFn):
    rows = draw(st.integers(1, 4))
    vocab = draw(st.sampled_from([1, 7, 16, 97, 130, 700]))
    k = draw(st.integers(1, min(vocab, 40)))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    x = torch.randn(rows, vocab, generator=gen, dtype=torch.float64) * draw(st.sampled_from([0.5, 4.0]))
    if draw(st.booleans()):  # coarse grid: ties at the k-th value
        x = torch.round(x)
    if draw(st.booleans()):  # the largest values off the sampled blocks: the cutoff guess misses
        x = torch.where((torch.arange(vocab) // 16) % 8 == 3, x + 20.0, x)
    special = draw(st.sampled_from([None, "-inf", "+inf", "nan", "all-inf"]))
    row = draw(st.integers(0, rows - 1))
    if special == "-inf":
        x[row, ::2] = float("-inf")
    elif special == "+inf":
        x[row, vocab // 2] = float("inf")
    elif special == "nan":
        x[row, vocab // 3] = float("nan")
    elif special == "all-inf":
        x[row] = float("-inf")
    return x.to(dtype), k


def reference(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stable descending sort, NaN first (torch.sort's order), truncated to k."""
    key = torch.where(torch.isnan(x), float("inf"), x)
    nan_first = torch.sort(torch.isnan(x).to(torch.int8), dim=1, descending=True, stable=True).indices
    order = torch.sort(key.gather(1, nan_first), dim=1, descending=True, stable=True).indices
    ids = nan_first.gather(1, order)[:, :k]
    return x.gather(1, ids), ids


@given(case=rows_case())
def test_top_candidates_is_a_stable_descending_sort_prefix(case) -> None:
    x, k = case
    values, ids = topk_rows(x, k)
    want_values, want_ids = reference(x, k)
    assert values.dtype == x.dtype and ids.dtype == torch.int64
    assert torch.equal(ids, want_ids)
    assert torch.equal(values.nan_to_num(7.0), want_values.nan_to_num(7.0))
    torch_values = torch.topk(x, k, dim=1).values  # the same values as torch.topk
    assert torch.equal(values.nan_to_num(7.0), torch_values.nan_to_num(7.0))


@given(case=rows_case())
def test_mass_is_the_float64_sum_of_exp_below_the_max(case) -> None:
    x, k = case
    values, ids, mass = top_candidates(x, k)
    assert torch.equal(ids, topk_rows(x, k)[1]) and mass.dtype == x.dtype
    top = x.double().amax(1)
    finite = torch.isfinite(top) & ~torch.isnan(x).any(1)
    want = torch.exp(x.double() - top[:, None]).sum(1)
    tol = 1e-6 if x.dtype == torch.float32 else 1e-12
    torch.testing.assert_close(mass[finite].double(), want[finite], rtol=tol, atol=0.0)
    assert torch.isnan(mass[~finite]).all()


@given(case=rows_case())
def test_torch_fallback_gives_the_same_answer(case) -> None:
    x, k = case
    op = top_candidates(x, k)
    real = _top_op.load_top_op
    _top_op.load_top_op = lambda: "disabled for the test"
    try:
        fallback = top_candidates(x, k)
    finally:
        _top_op.load_top_op = real
    assert torch.equal(op[0].nan_to_num(7.0), fallback[0].nan_to_num(7.0))
    tol = 1e-5 if x.dtype == torch.float32 else 1e-12
    torch.testing.assert_close(op[2], fallback[2], rtol=tol, atol=0.0, equal_nan=True)


def test_large_vocab_matches_torch_topk() -> None:
    """The sampling shape: 64 x 49152 float32, k = 256 (every row on the block-cutoff path)."""
    x = torch.randn(64, 49152, generator=torch.Generator().manual_seed(0)) * 5.0
    values, ids = topk_rows(x, 256)
    want = torch.topk(x, 256, dim=1)
    assert torch.equal(values, want.values) and torch.equal(ids, want.indices)


# Bad input to the raw operator: tests/test_cpp_bad_input.py (in a child process, so a crash fails
# one test instead of killing the run).
