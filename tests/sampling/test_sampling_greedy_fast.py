"""The plain-greedy fast path (``SamplingRows.all_plain_greedy`` + ``greedy_tokens``, and with
grammar masks ``greedy_masked_tokens``) gives exactly the tokens of the full ``sample`` of the
same rows, and is taken only when it may be."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from treeserve.sampling import (
    SamplingParams,
    SamplingRows,
    StructuredOutput,
    bitmask_words,
    greedy_masked_tokens,
    greedy_tokens,
    sample,
    unpack_bitmask,
)
from treeserve.sampling.sampler import ARGMAX_BLOCK

EOS = [2, 3]


def _params(**kw) -> SamplingParams | None:
    try:
        return SamplingParams(**kw)
    except ValueError:
        return None


def params_st(vocab: int) -> st.SearchStrategy[SamplingParams]:
    """Mostly greedy rows, each feature that disables the fast path drawn now and then."""
    rare = lambda s, off: st.integers(0, 5).flatmap(lambda k: s if k == 0 else st.just(off))  # noqa: E731
    return st.builds(
        _params,
        temperature=st.sampled_from([0.0, 0.0, 0.0, 0.8]),
        repetition_penalty=rare(st.just(1.3), 1.0),
        frequency_penalty=rare(st.just(0.5), 0.0),
        logit_bias=rare(st.dictionaries(st.integers(0, vocab - 1), st.floats(-5, 5), min_size=1, max_size=2), {}),
        allowed_token_ids=rare(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=4), None),
        stop_token_ids=st.lists(st.integers(0, vocab - 1), max_size=2),
        ignore_eos=st.booleans(),
        min_new_tokens=st.integers(0, 3),
        logprobs=rare(st.integers(0, 2), None),
    ).filter(lambda p: p is not None)


def plain(p: SamplingParams, generated: int) -> bool:
    """Reference predicate: greedy, nothing that changes logits this step, no logprobs."""
    banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(EOS))
    return (
        p.temperature == 0.0
        and p.repetition_penalty == 1.0 and p.frequency_penalty == 0.0 and p.presence_penalty == 0.0
        and not p.logit_bias
        and p.allowed_token_ids is None
        and p.logprobs is None
        and not (banned and generated < p.min_new_tokens)
    )  # fmt: skip


def logits_st(rows: int, vocab: int) -> st.SearchStrategy[torch.Tensor]:
    """Logits with ties (few distinct values) and rows holding NaN, +inf or -inf."""
    value = st.sampled_from([0.0, 1.5, -2.0, 3.25, 3.25, float("nan"), float("inf"), float("-inf")])
    return st.lists(st.lists(st.sampled_from([0.0, 1.5, -2.0, 3.25]), min_size=vocab, max_size=vocab),
                    min_size=rows, max_size=rows).flatmap(  # fmt: skip
        lambda base: st.lists(st.tuples(st.integers(0, rows - 1), st.integers(0, vocab - 1), value), max_size=3).map(
            lambda edits: _edited(base, edits)
        )
    )


def _edited(base: list[list[float]], edits: list[tuple[int, int, float]]) -> torch.Tensor:
    x = torch.tensor(base, dtype=torch.float32)
    for r, c, v in edits:
        x[r, c] = v
    return x


@pytest.mark.parametrize("vocab", [50, 2 * ARGMAX_BLOCK])  # plain max, then the two-level argmax
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_fast_path_equals_full_sample(vocab: int, data) -> None:
    n = data.draw(st.integers(1, 4))
    ps = data.draw(st.lists(params_st(vocab), min_size=n, max_size=n))
    generated = data.draw(st.lists(st.integers(0, 4), min_size=n, max_size=n))
    logits = data.draw(logits_st(n, vocab))
    rows = SamplingRows(8, vocab, "cpu", EOS)
    slots = data.draw(st.permutations(range(8)))[:n]
    for i, p in enumerate(ps):
        rows.admit(slots[i], i, p, 7 + i, [5, 6])
    outputs = [[4] * g for g in generated]
    fast = rows.all_plain_greedy(slots, generated)
    event(f"fast path: {fast}")
    assert fast == all(plain(p, g) for p, g in zip(ps, generated))
    if fast:
        ref = sample(logits, rows.batch(slots, outputs), torch.tensor(generated) + 2)
        got = greedy_tokens(logits)
        assert got.tolist() == ref.tokens.tolist()
        assert ref.logprobs.isnan().all()  # what the fast path reports too
        bad = ~torch.isfinite(logits.max(dim=1).values) | logits.isnan().any(1)
        assert (got[bad] == -1).all() and (got[~bad] >= 0).all()
        # batch invariance: each row alone gives its token in the batch
        assert [int(greedy_tokens(logits[i : i + 1])[0]) for i in range(n)] == got.tolist()


def test_min_new_tokens_ban_turns_the_fast_path_off_until_met() -> None:
    rows = SamplingRows(2, 10, "cpu", EOS)
    rows.admit(0, "a", SamplingParams(temperature=0.0, min_new_tokens=2), 0, [1])
    assert [rows.all_plain_greedy([0], [g]) for g in range(4)] == [False, False, True, True]
    rows.admit(1, "b", SamplingParams(temperature=0.0, min_new_tokens=2, ignore_eos=True), 0, [1])
    assert rows.all_plain_greedy([1], [0])  # nothing to ban: min_new_tokens changes no logit
    assert not rows.all_plain_greedy([0, 1], [0, 0])  # one row that must not: the batch falls back


def test_counts_given_as_a_function_are_read_only_for_a_pending_ban() -> None:
    rows = SamplingRows(3, 10, "cpu", EOS)
    rows.admit(0, "a", SamplingParams(temperature=0.0, min_new_tokens=2), 0, [1])
    rows.admit(1, "b", SamplingParams(temperature=0.0, min_new_tokens=2, ignore_eos=True), 0, [1])
    rows.admit(2, "c", SamplingParams(temperature=0.0), 0, [1])
    calls = []

    def counts(values: list[int]):
        return lambda: calls.append(values) or values

    assert rows.all_plain_greedy([1, 2], counts([0, 0])) and calls == []  # no ban: counts unread
    assert [rows.all_plain_greedy([0, 2], counts([g, 0])) for g in range(4)] == [False, False, True, True]
    assert len(calls) == 4


def test_float64_and_bfloat16_logits_match_sample() -> None:
    torch.manual_seed(0)
    rows = SamplingRows(3, 2 * ARGMAX_BLOCK, "cpu", EOS)
    for r in range(3):
        rows.admit(r, r, SamplingParams(temperature=0.0), 0, [1])
    for dtype in (torch.float64, torch.bfloat16):
        logits = torch.randn(3, 2 * ARGMAX_BLOCK).to(dtype)
        logits[1, 7] = float("nan")
        ref = sample(logits, rows.batch([0, 1, 2], [[], [], []]), torch.zeros(3, dtype=torch.long))
        assert greedy_tokens(logits).tolist() == ref.tokens.tolist()
        assert greedy_tokens(logits)[1] == -1


def bitmask_st(rows: int, vocab: int) -> st.SearchStrategy[torch.Tensor | None]:
    """A batch mask: None, or per row all allowed, a few tokens allowed, or none allowed."""
    words = bitmask_words(vocab)
    row = st.one_of(
        st.just([-1] * words),
        st.just([0] * words),
        st.lists(st.integers(-(2**31), 2**31 - 1), min_size=words, max_size=words),
        st.lists(st.integers(0, vocab - 1), min_size=1, max_size=3).map(lambda ids: _words(ids, words)),
    )
    masks = st.lists(row, min_size=rows, max_size=rows).map(lambda r: torch.tensor(r, dtype=torch.int64).to(torch.int32))
    return st.one_of(st.none(), masks, masks, masks)


def _words(ids: list[int], words: int) -> list[int]:
    w = [0] * words
    for t in ids:
        w[t // 32] |= 1 << (t % 32)
    return [v - (1 << 32) if v >= 1 << 31 else v for v in w]


@pytest.mark.parametrize("vocab", [50, 2 * ARGMAX_BLOCK])
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_grammar_fast_path_equals_full_sample(vocab: int, data) -> None:
    """``all_plain_greedy(..., grammar=True)`` admits rows whose only logit change is a grammar
    mask; ``greedy_masked_tokens`` then gives ``sample``'s tokens (every-token-masked rows -1)."""
    n = data.draw(st.integers(1, 4))
    greedy = st.builds(SamplingParams, temperature=st.just(0.0), ignore_eos=st.booleans(),
                       min_new_tokens=st.integers(0, 2))  # fmt: skip
    ps = data.draw(st.lists(st.one_of(greedy, greedy, params_st(vocab)), min_size=n, max_size=n))
    structured = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
    ps = [replace(p, structured=StructuredOutput(regex="[a-z]+")) if s else p for p, s in zip(ps, structured)]
    generated = data.draw(st.lists(st.integers(0, 4), min_size=n, max_size=n))
    logits = data.draw(logits_st(n, vocab))
    mask = data.draw(bitmask_st(n, vocab))
    rows = SamplingRows(8, vocab, "cpu", EOS)
    for i, p in enumerate(ps):
        rows.admit(i, i, p, 7 + i, [5, 6])
    fast = rows.all_plain_greedy(range(n), generated, grammar=True)
    event(f"fast path: {fast}")
    assert fast == all(plain(p, g) for p, g in zip(ps, generated))
    assert rows.all_plain_greedy(range(n), generated) == (fast and not any(structured))
    if fast:
        batch = rows.batch(list(range(n)), [[4] * g for g in generated])
        ref = sample(logits, replace(batch, token_bitmask=mask), torch.tensor(generated) + 2)
        given_logits = logits.clone()
        got = greedy_masked_tokens(given_logits, mask)
        assert got.tolist() == ref.tokens.tolist()
        if mask is not None:  # applied in place: the masked entries of the logits handed over are -inf
            banned = ~unpack_bitmask(mask, vocab)
            assert torch.isneginf(given_logits[banned]).all()
        assert greedy_masked_tokens(logits.double(), mask).tolist() == ref.tokens.tolist()  # the reference dtype
