"""``StepStaging`` / ``StagedLayout``: typed regions packed 8-byte aligned, one copy per send that
covers every field and the named prefix of the last, and bad layouts refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from treeserve.runner.staging import StepStaging, layout_bytes

DTYPES = (torch.int64, torch.int32, torch.float64, torch.bool)

fields_st = st.lists(st.tuples(st.sampled_from(DTYPES), st.integers(0, 9)), min_size=1, max_size=6).map(
    lambda fs: [(f"f{i}", dt, n) for i, (dt, n) in enumerate(fs)]
)


def _values(rng: np.random.Generator, dtype: torch.dtype, n: int) -> np.ndarray:
    if dtype is torch.bool:
        return rng.random(n) < 0.5
    if dtype is torch.float64:
        return rng.standard_normal(n)
    return rng.integers(-(2**30), 2**30, n).astype(np.int64 if dtype is torch.int64 else np.int32)


@settings(max_examples=40, deadline=None)
@given(fields=fields_st, seed=st.integers(0, 2**32 - 1), data=st.data())
def test_a_send_copies_every_field_and_the_tail_of_the_last(fields, seed, data) -> None:
    staging = StepStaging(layout_bytes(fields) + 16, torch.device("cpu"))
    layout = staging.layout(fields)
    assert layout.nbytes == layout_bytes(fields) and layout.nbytes % 8 == 0
    rng = np.random.default_rng(seed)
    before = {name: layout.device[name].clone() for name, _, _ in fields}
    host = layout.fill()
    values = {name: _values(rng, dt, n) for name, dt, n in fields}
    for name, arr in values.items():
        host[name][:] = arr
    last, _, count = fields[-1]
    tail = data.draw(st.integers(0, count))
    layout.send(tail=tail)
    assert staging.num_copies == 1
    for name, dt, n in fields:
        got = layout.device[name]
        assert got.dtype == dt and got.shape == (n,)
        if name != last:
            assert np.array_equal(got.numpy(), values[name]), name
    got = layout.device[last].numpy()
    assert np.array_equal(got[:tail], values[last][:tail])
    # Whole 8-byte words travel: past them the last field keeps what the device had.
    item = torch.empty((), dtype=fields[-1][1]).element_size()
    sent = -(-tail * item // 8) * 8 // item
    assert np.array_equal(got[sent:], before[last].numpy()[sent:])


def test_layouts_share_the_buffer_and_bad_layouts_are_refused() -> None:
    staging = StepStaging(64, torch.device("cpu"))
    a = staging.layout([("x", torch.int64, 2)])
    b = staging.layout([("y", torch.int32, 4)])
    a.fill()["x"][:] = [1, 2]
    a.send()
    assert b.device["y"].tolist() == [1, 0, 2, 0]  # little-endian int64 words seen as int32
    with pytest.raises(ValueError, match="bytes"):
        staging.layout([("x", torch.int64, 9)])
    with pytest.raises(ValueError, match="unique"):
        staging.layout([("x", torch.int64, 1), ("x", torch.int32, 1)])
    with pytest.raises(ValueError, match="tail"):
        a.send(tail=3)
    with pytest.raises(ValueError, match="nbytes"):
        StepStaging(-1, torch.device("cpu"))
