"""``draw_siblings``: draft tokens drawn from the drafter's processed law, siblings without
replacement, each reported with the law it was drawn from (against the float64 reference)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.sampling._sampling_ref import process_row, softmax
from treeserve.sampling import SamplingBatch, SamplingParams, draw_siblings
from treeserve.sampling.rng import Purpose, uniform

params = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.5, 0.8, 1.3]),
    top_k=st.sampled_from([-1, 1, 3]),
    top_p=st.sampled_from([1.0, 0.7]),
    min_p=st.sampled_from([0.0, 0.2]),
    repetition_penalty=st.sampled_from([1.0, 1.3]),
    seed=st.integers(0, 2**40),
)


def _batch(ps: list[SamplingParams], histories: list[list[int]], vocab: int) -> SamplingBatch:
    return SamplingBatch.build(ps, [p.seed for p in ps], histories, vocab, eos_token_ids=[0],
                               num_generated=[len(h) for h in histories])


@settings(max_examples=30, deadline=None)
@given(rows=st.lists(params, min_size=1, max_size=4), vocab=st.integers(2, 12), width=st.integers(1, 4),
       data=st.data())
def test_siblings_follow_the_processed_law_without_replacement(rows, vocab: int, width: int, data) -> None:
    """Sibling j's reported law is the processed law minus siblings 0..j-1, renormalized (one-hot
    once exhausted, and for greedy rows their top tokens); its token is the reference inverse-CDF
    draw with the DRAFT-purpose uniform; siblings are distinct."""
    width = min(width, vocab)
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(data.draw(st.integers(0, 99))))
    hist = [data.draw(st.lists(st.integers(0, vocab - 1), max_size=4)) for _ in rows]
    positions = torch.tensor([data.draw(st.integers(0, 500)) for _ in rows])
    out = draw_siblings(logits, _batch(rows, hist, vocab), positions, width)
    for r, p in enumerate(rows):
        law = softmax(process_row(logits[r].double().tolist(), p, hist[r], len(hist[r]), eos=(0,)))
        toks = out.tokens[r].tolist()
        assert len(set(toks)) == width
        taken: list[int] = []
        for j, tok in enumerate(toks):
            left = [0.0 if t in taken else x for t, x in enumerate(law)]
            mass = sum(left)
            got = out.probs[r, j].double()
            if p.greedy or mass <= 1e-12:  # deterministic: a point mass at the token
                assert got.tolist() == [float(t == tok) for t in range(vocab)]
            else:
                want = torch.tensor([x / mass for x in left], dtype=torch.float64)
                torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-4)
                u = float(uniform(torch.tensor(p.seed), positions[r], Purpose.DRAFT, j))
                cdf = [sum(want[: t + 1].tolist()) for t in range(vocab)]
                ref = next(t for t in range(vocab) if cdf[t] > u * cdf[-1])
                if all(abs(c - u * cdf[-1]) > 1e-5 for c in cdf):  # not on a rounding edge
                    assert tok == ref
            if p.greedy:
                order = sorted(range(vocab), key=lambda t: (-law[t], t))
                assert law[tok] == law[order[j]]
            taken.append(tok)


def test_rows_are_reproducible_and_batch_independent() -> None:
    """A seeded row draws the same siblings alone and in any batch; another seed or position
    draws others (counter-based, keyed by (seed, position, DRAFT, sibling))."""
    vocab = 50
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(1))
    ps = [SamplingParams(temperature=1.0, seed=s) for s in (7, 8, 9)]
    pos = torch.tensor([10, 11, 12])
    together = draw_siblings(logits, _batch(ps, [[], [], []], vocab), pos, 3)
    for r in range(3):
        alone = draw_siblings(logits[r : r + 1], _batch([ps[r]], [[]], vocab), pos[r : r + 1], 3)
        assert torch.equal(alone.tokens[0], together.tokens[r])
        assert torch.equal(alone.probs[0], together.probs[r])
    draws = {tuple(draw_siblings(logits[:1], _batch([SamplingParams(temperature=1.0, seed=s)], [[]], vocab),
                                 torch.tensor([p]), 3).tokens[0].tolist()) for s in range(6) for p in (3, 4)}
    assert len(draws) > 6


def test_sibling_frequencies_match_their_laws() -> None:
    """Monte Carlo through the real RNG: over many seeds the first two siblings' joint frequency
    matches q(a) * q(b) / (1 - q(a)) (sampling without replacement)."""
    vocab, n = 4, 6000
    logits = torch.tensor([[1.0, 0.2, -0.5, 0.7]]).expand(n, vocab).contiguous()
    ps = [SamplingParams(temperature=0.9, seed=s) for s in range(n)]
    out = draw_siblings(logits, _batch(ps, [[]] * n, vocab), torch.zeros(n, dtype=torch.int64), 2)
    q = torch.softmax(logits[0].double() / 0.9, 0).tolist()
    counts: dict[tuple[int, int], int] = {}
    for a, b in out.tokens.tolist():
        counts[(a, b)] = counts.get((a, b), 0) + 1
    for a in range(vocab):
        for b in range(vocab):
            want = 0.0 if a == b else q[a] * q[b] / (1 - q[a])
            got = counts.get((a, b), 0) / n
            assert abs(got - want) <= 4 * math.sqrt(want * (1 - want) / n) + 1e-9, (a, b, got, want)


def test_bad_input_is_named() -> None:
    batch = _batch([SamplingParams(temperature=1.0, seed=1)], [[]], 5)
    pos = torch.tensor([0])
    with pytest.raises(ValueError, match="width must be an int in \\[1, 5\\]"):
        draw_siblings(torch.zeros(1, 5), batch, pos, 6)
    with pytest.raises(ValueError, match="width must be an int in \\[1, 5\\]"):
        draw_siblings(torch.zeros(1, 5), batch, pos, 0)
    with pytest.raises(ValueError, match="logits must have shape \\[1, 5\\]"):
        draw_siblings(torch.zeros(1, 4), batch, pos, 1)
    with pytest.raises(ValueError, match="positions must be int64 of shape \\[1\\]"):
        draw_siblings(torch.zeros(1, 5), batch, torch.tensor([0.0]), 1)
