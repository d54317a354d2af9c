"""ReqToTokenTable: row lifecycle, dummy row, bounds, bad input with state unchanged."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from treeserve.kvcache import InvariantError, OutOfRowsError, ReqToTokenTable


def snapshot(t: ReqToTokenTable) -> tuple[int, torch.Tensor]:
    return t.num_free, t.table.clone()


def test_rows_are_handed_out_in_order_and_recycled() -> None:
    t = ReqToTokenTable(max_requests=3, max_context_len=8)
    assert t.table.shape == (4, 8) and t.table.dtype == torch.int64
    assert [t.alloc(), t.alloc(), t.alloc()] == [1, 2, 3]
    with pytest.raises(OutOfRowsError, match="all 3 request rows"):
        t.alloc()
    t.write(2, 1, torch.tensor([5, 6, 7]))
    assert t.table[2].tolist() == [0, 5, 6, 7, 0, 0, 0, 0]
    t.free(2)
    assert t.num_free == 1 and not bool(t.table[2].any())
    assert t.alloc() == 2
    t.check_invariants()


@given(st.lists(st.integers(0, 4), max_size=30))
def test_table_matches_a_set_model(ops: list[int]) -> None:
    t = ReqToTokenTable(max_requests=4, max_context_len=4)
    held: list[int] = []
    for op in ops:
        if op == 0 or not held:
            if len(held) == 4:
                with pytest.raises(OutOfRowsError):
                    t.alloc()
            else:
                row = t.alloc()
                assert 1 <= row <= 4 and row not in held
                t.write(row, 0, torch.full((4,), row, dtype=torch.int64))
                held.append(row)
        else:
            t.free(held.pop(op % len(held)))
        assert t.num_free == 4 - len(held)
        for row in held:
            assert t.table[row].tolist() == [row] * 4
        t.check_invariants()


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda t: t.free(0), ValueError, "row 0 is the dummy row"),
        (lambda t: t.free(5), ValueError, r"\[1, max_requests=4\]"),
        (lambda t: t.free(2), ValueError, "not in use"),
        (lambda t: t.free(True), TypeError, "row must be an int"),
        (lambda t: t.write(1, 3, torch.tensor([1, 2])), ValueError, "max_context_len=4"),
        (lambda t: t.write(1, -1, torch.tensor([1])), ValueError, "start"),
        (lambda t: t.write(1, 0, torch.tensor([1.0])), TypeError, "int64"),
        (lambda t: t.write(0, 0, torch.tensor([1])), ValueError, "dummy row"),
    ],
)
def test_bad_input_leaves_state_unchanged(call, error: type[Exception], match: str) -> None:  # noqa: ANN001
    t = ReqToTokenTable(max_requests=4, max_context_len=4)
    t.write(t.alloc(), 0, torch.tensor([9, 9]))
    before = snapshot(t)
    with pytest.raises(error, match=match):
        call(t)
    after = snapshot(t)
    assert after[0] == before[0] and torch.equal(after[1], before[1])
    t.check_invariants()


def test_double_free_is_an_error() -> None:
    t = ReqToTokenTable(2, 2)
    row = t.alloc()
    t.free(row)
    with pytest.raises(ValueError, match="already freed"):
        t.free(row)


def test_check_invariants_catches_a_dirty_dummy_row() -> None:
    t = ReqToTokenTable(2, 2)
    t.table[0, 1] = 3
    with pytest.raises(InvariantError, match="dummy row 0"):
        t.check_invariants()


@pytest.mark.parametrize("bad", [{"max_requests": 0}, {"max_context_len": 0}])
def test_rejects_bad_construction(bad: dict[str, int]) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        ReqToTokenTable(**({"max_requests": 2, "max_context_len": 2} | bad))


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@given(ops=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 3), st.integers(0, 99)), max_size=30))
def test_the_host_view_equals_the_table(device: str, ops: list[tuple[int, int, int]]) -> None:
    """``host`` (the memory itself on CPU, a mirror elsewhere) follows ``write``, ``scatter`` and
    ``free``: a step gathers its slots there without reading the device."""
    import numpy as np

    t = ReqToTokenTable(max_requests=3, max_context_len=4, device=device)
    if device == "cpu":
        assert np.shares_memory(t.host, t.table.numpy())
    held: list[int] = []
    for op, col, value in ops:
        if op == 0 and t.num_free:
            held.append(t.alloc())
            t.write(held[-1], col, torch.full((4 - col,), value, dtype=torch.int64))
        elif op == 1 and held:
            row = held[value % len(held)]
            t.scatter(np.array([row * 4 + col]), torch.tensor([value + 1]))
        elif held:
            t.free(held.pop(value % len(held)))
        assert np.array_equal(t.host, t.table.view(-1).cpu().numpy())
        t.check_invariants()
