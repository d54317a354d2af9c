"""process_logits and sample against plain-Python references; sampling invariants."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import pytest
import torch
from tests.sampling._sampling_ref import process_row, softmax
from hypothesis import assume, given
from hypothesis import strategies as st
from scipy import stats

from treeserve.sampling import SamplingBatch, SamplingParams, process_logits, sample
from treeserve.sampling import processing

EOS = 1


@st.composite
def params_st(draw: st.DrawFn, vocab: int) -> SamplingParams:
    ids = st.integers(0, vocab - 1)
    kwargs = dict(
        temperature=draw(st.sampled_from([0.0, 0.5, 1.0, 1.7])),
        top_k=draw(st.sampled_from([-1, 1, 2, 5, vocab - 1, vocab + 3])),
        top_p=draw(st.sampled_from([1.0, 0.95, 0.6, 0.2, 1e-6])),
        min_p=draw(st.sampled_from([0.0, 0.05, 0.5])),
        repetition_penalty=draw(st.sampled_from([1.0, 1.3, 0.7])),
        frequency_penalty=draw(st.sampled_from([0.0, 0.5, -1.0])),
        presence_penalty=draw(st.sampled_from([0.0, 1.5, -0.5])),
        logit_bias=draw(st.dictionaries(ids, st.sampled_from([-100.0, -1.0, 2.5]), max_size=3)),
        allowed_token_ids=draw(st.none() | st.lists(ids, min_size=1, max_size=4)),
        min_new_tokens=draw(st.sampled_from([0, 0, 3])),
        stop_token_ids=draw(st.lists(ids, max_size=2)),
        ignore_eos=draw(st.booleans()),
        logprobs=draw(st.sampled_from([None, 0, 3])),
    )
    try:
        return SamplingParams(**kwargs)
    except ValueError:  # every allowed token a stop id under min_new_tokens: rejected up front
        assume(False)
        raise


@st.composite
def batch_case(draw: st.DrawFn, dtype: torch.dtype = torch.float64):
    vocab = draw(st.sampled_from([3, 8, 40, 97]))
    rows = draw(st.integers(1, 5))
    params = [draw(params_st(vocab)) for _ in range(rows)]
    histories = [draw(st.lists(st.integers(0, vocab - 1), max_size=8)) for _ in range(rows)]
    gens = [draw(st.integers(0, len(h))) for h in histories]
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    logits = torch.randn(rows, vocab, generator=gen, dtype=torch.float64) * draw(st.sampled_from([0.5, 3.0]))
    if draw(st.booleans()):  # coarse grid: many ties
        logits = torch.round(logits * 2) / 2
    batch = SamplingBatch.build(params, list(range(rows)), histories, vocab, eos_token_ids=[EOS], num_generated=gens)
    return params, histories, gens, logits.to(dtype), batch


@contextlib.contextmanager
def candidate_bound(k: int) -> Iterator[None]:
    """Temporarily lower the candidate bound so the refine/fallback paths run on small vocabularies."""
    old, processing.CANDIDATES = processing.CANDIDATES, k
    try:
        yield
    finally:
        processing.CANDIDATES = old


bounds = st.sampled_from([2, 3, 256])


def reference(params, histories, gens, logits) -> list[list[float]]:
    return [
        process_row(logits[i].tolist(), p, histories[i], gens[i], eos=(EOS,)) for i, p in enumerate(params)
    ]


@given(case=batch_case(), k=bounds)
def test_process_logits_matches_python_reference(case, k: int) -> None:
    params, histories, gens, logits, batch = case
    with candidate_bound(k):
        got = process_logits(logits, batch)
    want = torch.tensor(reference(params, histories, gens, logits), dtype=torch.float64)
    # A row with no admissible token (e.g. every allowed token banned by min_new_tokens) is
    # invalid: documented to come back all-NaN.
    dead = torch.isneginf(want).all(1)
    assert torch.isnan(got[dead]).all()
    assert torch.equal(torch.isinf(got[~dead]), torch.isinf(want[~dead]))
    finite = torch.isfinite(want)
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-12, atol=1e-12)


@given(case=batch_case(dtype=torch.float32), k=bounds, positions=st.lists(st.integers(0, 10**6), min_size=5, max_size=5))
def test_sample_stays_in_kept_set_and_greedy_is_argmax(case, k: int, positions) -> None:
    params, histories, gens, logits, batch = case
    processed = process_logits(logits, batch)
    with candidate_bound(k):
        out = sample(logits, batch, torch.tensor(positions[: len(params)]))
    # A row with no admissible token (every allowed token an EOS banned by min_new_tokens) is
    # documented as invalid: token -1. Every other row must sample from its kept set.
    dead = ~torch.isfinite(processed).any(1)
    assert (out.tokens[dead] == -1).all()
    rows = torch.arange(len(params))[~dead]
    tokens = out.tokens[~dead]
    assert torch.isfinite(processed[rows, tokens]).all()
    greedy = batch.greedy & ~dead
    assert torch.equal(out.tokens[greedy], processed[greedy].argmax(1))
    logp = torch.log_softmax(processed.double(), dim=1)
    if not batch.any_logprobs:  # nobody asked: not computed
        assert torch.isnan(out.logprobs).all() and out.top_ids.shape == (len(params), 0)
        return
    torch.testing.assert_close(out.logprobs[~dead].double(), logp[rows, tokens], rtol=1e-4, atol=1e-4)
    n = batch.num_logprobs
    assert out.top_ids.shape == (len(params), n)
    if n:
        want_top = torch.sort(logp[rows], dim=1, descending=True).values[:, :n]
        torch.testing.assert_close(out.top_logprobs[~dead].double(), want_top, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(
            logp[rows].gather(1, out.top_ids[~dead]), out.top_logprobs[~dead].double(), rtol=1e-4, atol=1e-4
        )


@given(case=batch_case(dtype=torch.float32), k=bounds, seed=st.integers(0, 2**40), pos=st.integers(0, 10**5))
def test_seeded_row_is_batch_invariant(case, k: int, seed: int, pos: int) -> None:
    params, histories, gens, logits, batch = case
    vocab = logits.shape[1]
    mine = SamplingParams(temperature=0.9, top_p=0.8, top_k=vocab - 1, logprobs=0)
    row = torch.randn(1, vocab, generator=torch.Generator().manual_seed(seed % 1000))
    with candidate_bound(k):
        alone = sample(row, SamplingBatch.build([mine], [seed], [[]], vocab), torch.tensor([pos]))
    big = SamplingBatch.build(
        [*params, mine], [*range(len(params)), seed], [*histories, []], vocab, eos_token_ids=[EOS], num_generated=[*gens, 0]
    )
    mixed = sample(torch.cat([logits, row]), big, torch.tensor([*range(len(params)), pos]))
    assert mixed.tokens[-1] == alone.tokens[0]
    assert mixed.logprobs[-1] == alone.logprobs[0]


def test_sample_law_matches_processed_distribution() -> None:
    """Many seeds, one row: chi-square of the empirical token law against softmax(processed)."""
    vocab, n = 12, 20000
    torch.manual_seed(0)
    row = torch.randn(vocab) * 1.5
    p = SamplingParams(temperature=0.8, top_k=8, top_p=0.9, min_p=0.02)
    batch = SamplingBatch.build([p] * n, list(range(n)), [[]] * n, vocab)
    out = sample(row.expand(n, vocab).contiguous(), batch, torch.full((n,), 7))
    probs = torch.tensor(softmax(process_row(row.double().tolist(), p)))
    counts = torch.bincount(out.tokens, minlength=vocab).double()
    assert counts[probs == 0].sum() == 0
    keep = probs > 0
    chi2, pvalue = stats.chisquare(counts[keep].numpy(), (probs[keep] * n).numpy())
    assert pvalue > 1e-4, (chi2, pvalue)


def test_same_seed_different_position_gives_fresh_draws() -> None:
    vocab, n = 50, 2000
    batch = SamplingBatch.build([SamplingParams()] * n, [123] * n, [[]] * n, vocab)
    out = sample(torch.zeros(n, vocab), batch, torch.arange(n))
    counts = torch.bincount(out.tokens, minlength=vocab)
    assert stats.chisquare(counts.numpy()).pvalue > 1e-4


def test_invalid_rows_are_flagged_not_crashing() -> None:
    vocab = 6
    logits = torch.randn(4, vocab)
    logits[0, 2] = float("nan")
    logits[1, 3] = float("inf")
    logits[2] = float("-inf")
    batch = SamplingBatch.build([SamplingParams(logprobs=2)] * 4, [0, 1, 2, 3], [[]] * 4, vocab)
    out = sample(logits, batch, torch.zeros(4, dtype=torch.long))
    assert out.tokens[:3].tolist() == [-1, -1, -1]
    assert 0 <= out.tokens[3] < vocab
    assert torch.isnan(out.logprobs[:3]).all() and torch.isfinite(out.logprobs[3])
    assert torch.isnan(process_logits(logits, batch)[:3]).all()


def test_min_new_tokens_bans_eos_until_reached() -> None:
    vocab = 5
    logits = torch.tensor([[0.0, 50.0, 0.0, 0.0, 0.0]] * 3)  # EOS (1) would always win
    p = SamplingParams(min_new_tokens=2, temperature=0)
    batch = SamplingBatch.build([p] * 3, [0, 1, 2], [[3], [3, 4], [3, 4, 4]], vocab, eos_token_ids=[1], num_generated=[0, 1, 2])
    assert sample(logits, batch, torch.tensor([1, 2, 3])).tokens.tolist()[:2] != [1, 1]
    assert sample(logits, batch, torch.tensor([1, 2, 3])).tokens.tolist()[2] == 1
    assert not torch.isfinite(process_logits(logits, batch)[:2, 1]).any()


def test_large_vocab_fast_path_matches_reference_thresholds() -> None:
    """A 2000-token vocabulary with the default bound: candidates and refine paths both taken."""
    vocab, rows = 2000, 6
    torch.manual_seed(1)
    logits = torch.randn(rows, vocab, dtype=torch.float64) * torch.tensor([[6.0], [6.0], [0.3], [0.3], [6.0], [0.3]])
    params = [
        SamplingParams(top_p=0.9), SamplingParams(top_k=300, top_p=0.99), SamplingParams(top_p=0.7),
        SamplingParams(top_k=5), SamplingParams(min_p=0.1), SamplingParams(top_p=0.5, min_p=0.5),
    ]
    batch = SamplingBatch.build(params, list(range(rows)), [[]] * rows, vocab)
    got = process_logits(logits, batch)
    want = torch.tensor([process_row(logits[i].tolist(), p) for i, p in enumerate(params)])
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    out = sample(logits, batch, torch.zeros(rows, dtype=torch.long))
    assert torch.isfinite(want[torch.arange(rows), out.tokens]).all()


def test_shape_errors() -> None:
    batch = SamplingBatch.build([SamplingParams(logprobs=0)], [0], [[]], 10)
    with pytest.raises(ValueError, match="logits must have shape"):
        sample(torch.zeros(1, 11), batch, torch.zeros(1, dtype=torch.long))
    with pytest.raises(ValueError, match="positions must have shape"):
        sample(torch.zeros(1, 10), batch, torch.zeros(2, dtype=torch.long))
    assert math.isfinite(float(sample(torch.zeros(1, 10), batch, torch.zeros(1, dtype=torch.long)).logprobs[0]))


@given(
    st.lists(st.sampled_from([0.0, -0.5, -3.0, -20.0, -86.0, -86.99, -87.01, -88.0, -95.0, -120.0, -1e4, -math.inf]),
             min_size=1, max_size=40),
    st.floats(0.0, 1.0, exclude_max=True),
    st.sampled_from([-math.inf, -50.0, -3.0]),
    st.sampled_from([torch.float32, torch.float64]),
)
def test_inverse_cdf_matches_the_reference_and_never_draws_below_the_floor(
    tail: list[float], u: float, threshold: float, dtype: torch.dtype
) -> None:
    """``inverse_cdf`` (what ``sample`` draws with) against a float64 plain-Python inverse CDF:
    row max 0, the other values far below it (masked -inf and the float32 exponent floor's
    neighbourhood included). The drawn token's cumulative interval holds ``u`` (up to float32
    rounding of the weights), a token under the threshold or the dtype's floor (``EXP_FLOOR``) or
    masked is never drawn, and the normalizer is the kept values' logsumexp."""
    from treeserve.sampling.sampler import EXP_FLOOR, inverse_cdf

    values = [0.0, *tail]
    floor = EXP_FLOOR[dtype]
    weights = [math.exp(v) if v >= max(threshold, floor) else 0.0 for v in values]
    total = sum(weights)
    col, lse = inverse_cdf(torch.tensor([values], dtype=dtype), torch.tensor([threshold], dtype=dtype),
                           torch.zeros(1, dtype=dtype), torch.tensor([u], dtype=torch.float64))  # fmt: skip
    c = int(col[0])
    assert weights[c] > 0, (c, values[c])
    below, upto = sum(weights[:c]), sum(weights[: c + 1])
    assert below - 1e-6 * total <= u * total <= upto + 1e-6 * total
    assert float(lse[0]) == pytest.approx(math.log(total), rel=1e-6, abs=1e-6)
