"""``SamplingRows`` gathers exactly the ``SamplingBatch`` that ``SamplingBatch.build`` makes."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from treeserve.sampling import SamplingBatch, SamplingParams, SamplingRows

VOCAB = 50
EOS = [2, 3]

def _params(**kw) -> SamplingParams | None:
    try:
        return SamplingParams(**kw)
    except ValueError:  # e.g. allowed ids all banned: not a request anyone can send
        return None


params_st = st.builds(
    _params,
    temperature=st.sampled_from([0.0, 0.7, 1.0]),
    top_k=st.sampled_from([-1, 1, 5, VOCAB]),
    top_p=st.sampled_from([1.0, 0.8]),
    min_p=st.sampled_from([0.0, 0.1]),
    repetition_penalty=st.sampled_from([1.0, 1.3]),
    frequency_penalty=st.sampled_from([0.0, 0.5]),
    presence_penalty=st.sampled_from([0.0, -0.4]),
    logit_bias=st.dictionaries(st.integers(0, VOCAB - 1), st.floats(-5, 5), max_size=3),
    allowed_token_ids=st.none() | st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=4),
    stop_token_ids=st.lists(st.integers(0, VOCAB - 1), max_size=3),
    ignore_eos=st.booleans(),
    min_new_tokens=st.integers(0, 4),
    logprobs=st.none() | st.integers(0, 3),
).filter(lambda p: p is not None)


def assert_same(a: SamplingBatch, b: SamplingBatch) -> None:
    for f in dataclasses.fields(SamplingBatch):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if f.name.startswith("hist_"):
            continue  # compared as a set of (row, token) entries below
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y), f.name
        else:
            assert x == y, f.name
    entries = lambda s: sorted(zip(s.hist_rows.tolist(), s.hist_tokens.tolist(), s.hist_output.tolist()))  # noqa: E731
    assert entries(a) == entries(b)


@settings(max_examples=30, deadline=None)
@given(
    reqs=st.lists(
        st.tuples(params_st, st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6), st.integers(0, 2**63 - 1)),
        min_size=1,
        max_size=5,
    ),
    steps=st.lists(st.lists(st.integers(0, VOCAB - 1), max_size=3), min_size=1, max_size=3),
    data=st.data(),
)
def test_gathered_batch_equals_build(reqs, steps, data) -> None:
    rows = SamplingRows(8, VOCAB, "cpu", EOS)
    slots = data.draw(st.permutations(range(8)))[: len(reqs)]
    outputs: list[list[int]] = [[] for _ in reqs]
    for i, (p, prompt, seed) in enumerate(reqs):
        rows.admit(slots[i], i, p, seed, prompt)
    for new in steps:  # penalty counts are updated incrementally across steps
        for out in outputs:
            out.extend(new)
        order = data.draw(st.permutations(range(len(reqs))))
        got = rows.batch([slots[i] for i in order], [outputs[i] for i in order])
        ref = SamplingBatch.build(
            [reqs[i][0] for i in order],
            [reqs[i][2] for i in order],
            [reqs[i][1] + outputs[i] for i in order],
            VOCAB,
            eos_token_ids=EOS,
            num_generated=[len(outputs[i]) for i in order],
        )
        assert_same(got, ref)


@settings(max_examples=30, deadline=None)
@given(
    reqs=st.lists(st.tuples(params_st, st.integers(0, 2**63 - 1), st.integers(0, 6)), min_size=1, max_size=6),
    data=st.data(),
)
def test_host_rows_equal_the_device_gather(reqs, data) -> None:
    """``host_rows`` (numpy mirrors) gathers the values ``batch`` gathers on the device, and
    ``per_row_only`` says exactly when those values are all a row needs."""
    import numpy as np

    rows = SamplingRows(8, VOCAB, "cpu", EOS)
    slots = data.draw(st.permutations(range(8)))[: len(reqs)]
    for i, (p, seed, _) in enumerate(reqs):
        rows.admit(slots[i], i, p, seed, [1])
    idx = np.array(slots, dtype=np.int64)
    outputs = [[0] * n for _, _, n in reqs]
    ref = rows.batch(slots, outputs)
    width = ref.ban_ids.shape[1] + data.draw(st.integers(0, 2))
    got = rows.host_rows(idx, np.array([n for _, _, n in reqs]), width)
    for name in ("temperature", "greedy", "top_k", "top_p", "min_p", "seeds", "min_tokens_left"):
        assert np.array_equal(getattr(got, name), getattr(ref, name).numpy()), name
    assert np.array_equal(got.ban_ids[:, : ref.ban_ids.shape[1]], ref.ban_ids.numpy())
    assert (got.ban_ids[:, ref.ban_ids.shape[1] :] == -1).all()
    plain = not (ref.has_penalties or ref.allowed is not None or ref.bias_ids.shape[1])
    for max_ban, max_lp in ((width, 3), (ref.ban_ids.shape[1] - 1, 3), (width, ref.num_logprobs - 1)):
        fits = max_ban >= ref.ban_ids.shape[1] and max_lp >= ref.num_logprobs
        assert rows.per_row_only(idx, max_ban, max_lp) == (plain and fits)
    if ref.ban_ids.shape[1]:
        with pytest.raises(ValueError, match="ban_width"):
            rows.host_rows(idx, np.zeros(len(reqs), dtype=np.int64), ref.ban_ids.shape[1] - 1)


def test_admit_rejects_bad_input_and_readmission_resets_history() -> None:
    rows = SamplingRows(2, VOCAB, "cpu")
    with pytest.raises(ValueError, match="row"):
        rows.admit(2, "a", SamplingParams(), 0, [1])
    with pytest.raises(ValueError, match="seed"):
        rows.admit(0, "a", SamplingParams(), -1, [1])
    with pytest.raises(ValueError, match="stop_token_ids"):
        rows.admit(0, "a", SamplingParams(stop_token_ids=[VOCAB]), 0, [1])
    with pytest.raises(TypeError, match="SamplingParams"):
        rows.admit(0, "a", {"temperature": 1.0}, 0, [1])
    with pytest.raises(ValueError, match="eos_token_ids"):
        SamplingRows(2, VOCAB, "cpu", [VOCAB])
    assert rows.owner(0) is None
    pen = SamplingParams(frequency_penalty=1.0)
    rows.admit(0, "a", pen, 0, [1])
    rows.batch([0], [[5, 5]])
    rows.admit(0, "b", pen, 0, [4])  # a new owner: the old counts are gone
    b = rows.batch([0], [[6]])
    assert sorted(zip(b.hist_tokens.tolist(), b.hist_output.tolist())) == [(4, 0.0), (6, 1.0)]
    assert rows.owner(0) == "b"
    assert rows.holds(0, "b", pen) and not rows.holds(0, "b", SamplingParams(frequency_penalty=1.0))
    assert not rows.holds(1, "b", pen)
