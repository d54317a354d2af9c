"""Issue 15: the grouped torch sampler (greedy rows: one argmax; logprobs only when asked; neutral
stages skipped) against the all-rows-together reference path it replaced, token for token."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from treeserve.sampling import SamplingBatch, SamplingParams, sample
from treeserve.sampling.processing import scale_logits
from treeserve.sampling.sampler import ARGMAX_BLOCK, first_argmax, sample_together

from .test_sampling_sample import EOS, batch_case, bounds, candidate_bound


@given(case=batch_case(dtype=torch.float32), k=bounds, positions=st.lists(st.integers(0, 10**6), min_size=5, max_size=5))
def test_grouped_sampler_matches_the_together_reference(case, k: int, positions) -> None:
    """Mixed greedy/stochastic batches with every stage: the same tokens and top ids as every row
    through one op sequence; greedy rows' logprobs bitwise equal (batch-invariant normalizer)."""
    params, _, _, logits, batch = case
    pos = torch.tensor(positions[: len(params)])
    with candidate_bound(k):
        got = sample(logits, batch, pos, backend="torch")
        want = sample_together(scale_logits(logits, batch), batch, pos, "torch")
    assert torch.equal(got.tokens, want.tokens)
    # top ids in the same order, ties by id, whether or not a row's group filtered (stable sort) or not (operator)
    assert torch.equal(got.top_ids, want.top_ids)
    greedy = batch.greedy
    assert torch.equal(got.logprobs[greedy].nan_to_num(7.0), want.logprobs[greedy].nan_to_num(7.0))
    torch.testing.assert_close(got.logprobs, want.logprobs, equal_nan=True, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got.top_logprobs, want.top_logprobs, equal_nan=True, rtol=1e-6, atol=1e-6)


@given(case=batch_case(dtype=torch.float32), k=bounds, positions=st.lists(st.integers(0, 10**6), min_size=5, max_size=5))
def test_top_ids_order_ties_by_id(case, k: int, positions) -> None:
    """The reported top ids run by processed logit, descending, equal logits by id (lower first), on
    every row whichever path its group took: the candidate operator, or the stable full sort where a
    filter needs most of the row (an unstable sort put ties in an order that changed with the batch)."""
    params, _, _, logits, batch = case
    if batch.num_logprobs == 0:
        return
    with candidate_bound(k):
        got = sample(logits, batch, torch.tensor(positions[: len(params)]), backend="torch")
    scaled = scale_logits(logits, batch)
    for r in range(len(params)):
        if got.tokens[r] < 0:  # an invalid row reports nothing
            continue
        values, ids = scaled[r, got.top_ids[r]].tolist(), got.top_ids[r].tolist()
        for j in range(len(ids) - 1):
            assert values[j] > values[j + 1] or (values[j] == values[j + 1] and ids[j] < ids[j + 1]), (r, ids, values)


def test_tied_top_ids_do_not_depend_on_the_batch() -> None:
    """Found by the long hypothesis profile: a stochastic row of many equal logits reported other top
    ids when another row of its batch had a filter (min-p), which sent every row through the sort."""
    halves = [-1, 0, -1, 0, 1, 1, 0, 0, 0, 1, 0, 0, 0, 0, -1, 1, -1, 1, -1, 1,
              0, 0, 0, -1, 1, 1, 0, 2, 0, 2, 0, 1, 0, 1, 0, 1, 0, -1, 1, 1]
    tied = torch.tensor(halves, dtype=torch.float32) / 2
    logits = torch.stack([torch.zeros(40), torch.zeros(40), tied])
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, min_p=0.05, logprobs=3),
              SamplingParams(temperature=0.5)]
    batch = SamplingBatch.build(params, [0, 1, 2], [[], [], []], 40, eos_token_ids=[EOS])
    pos = torch.zeros(3, dtype=torch.int64)
    got = sample(logits, batch, pos, backend="torch")
    want = sample_together(scale_logits(logits, batch), batch, pos, "torch")
    assert got.top_ids[2].tolist() == want.top_ids[2].tolist() == [27, 29, 4]  # the two 1.0s, then the first 0.5
    assert got.top_ids[0].tolist() == want.top_ids[0].tolist() == [0, 1, 2]  # all equal: by id


@given(
    rows=st.integers(1, 6),
    blocks=st.integers(1, 5),
    grid=st.sampled_from([0.5, 4.0]),
    seed=st.integers(0, 2**31),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
)
def test_first_argmax_is_torch_max(rows: int, blocks: int, grid: float, seed: int, dtype: torch.dtype) -> None:
    """Block search on vocabularies that are a multiple of the block, with many ties (a coarse
    grid) and -inf entries: the same value and *first* index as ``torch.max``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.round(torch.randn(rows, blocks * ARGMAX_BLOCK, generator=g) * grid)
    x[torch.rand(x.shape, generator=g) < 0.3] = float("-inf")
    x = x.to(dtype)
    values, index = first_argmax(x)
    want_values, want_index = x.max(dim=1)
    assert torch.equal(values, want_values)
    assert torch.equal(index, want_index)


def test_first_argmax_nan_row_has_nan_max() -> None:
    x = torch.zeros(2, 2 * ARGMAX_BLOCK)
    x[0, 200] = float("nan")
    values, index = first_argmax(x)
    assert torch.isnan(values[0]) and values[1] == 0 and index[1] == 0


def test_neutral_greedy_batch_is_one_argmax_without_copies() -> None:
    """All greedy, temperature 1, EOS ban lifted, no bias, no logprobs: the logits are not copied
    (no full-vocabulary stage ran), tokens are the argmax, logprobs are not computed."""
    vocab = 4 * ARGMAX_BLOCK
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.0, min_new_tokens=1)] * 5
    batch = SamplingBatch.build(params, list(range(5)), [[3]] * 5, vocab, eos_token_ids=[EOS], num_generated=[1] * 5)
    assert scale_logits(logits, batch) is logits
    out = sample(logits, batch, torch.zeros(5, dtype=torch.long))
    assert torch.equal(out.tokens, logits.argmax(1))
    assert torch.isnan(out.logprobs).all()
    banned = SamplingBatch.build(params, list(range(5)), [[3]] * 5, vocab, eos_token_ids=[EOS], num_generated=[0] * 5)
    assert scale_logits(logits, banned) is not logits  # the ban still applies while it holds
    assert torch.isneginf(scale_logits(logits, banned)[:, EOS]).all()


def test_logprobs_only_when_asked() -> None:
    """One row asking for logprobs switches them on for the batch, with the values of that row
    unchanged by companions that did not ask."""
    vocab = 2 * ARGMAX_BLOCK
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(1)) * 3
    mine = SamplingParams(temperature=0.0, top_p=0.9, logprobs=2)
    others = [SamplingParams(temperature=0.7, seed=4), SamplingParams(temperature=0.0)]
    alone = sample(logits[:1], SamplingBatch.build([mine], [0], [[]], vocab), torch.zeros(1, dtype=torch.long))
    mixed = sample(logits, SamplingBatch.build([mine, *others], [0, 4, 5], [[]] * 3, vocab), torch.zeros(3, dtype=torch.long))
    assert mixed.logprobs[0] == alone.logprobs[0] and torch.equal(mixed.top_logprobs[0], alone.top_logprobs[0])
    assert torch.isfinite(mixed.logprobs).all()
    quiet = SamplingBatch.build([*others, others[0]], [4, 5, 6], [[]] * 3, vocab)
    assert torch.isnan(sample(logits, quiet, torch.zeros(3, dtype=torch.long)).logprobs).all()
