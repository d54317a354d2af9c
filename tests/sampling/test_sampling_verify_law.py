"""Exact law of verification: the emitted tokens have the processed target's law (to 1e-12)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.sampling._verify_law import Case, max_deviation, random_parents
from treeserve.sampling import SamplingParams

TOL = 1e-12

filters = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.7, 1.0, 1.6]),
    top_k=st.sampled_from([-1, 2, 3]),
    top_p=st.sampled_from([1.0, 0.8, 0.5]),
    min_p=st.sampled_from([0.0, 0.1]),
    repetition_penalty=st.sampled_from([1.0, 1.4]),
    presence_penalty=st.sampled_from([0.0, 0.6]),
    min_new_tokens=st.sampled_from([0, 2]),
)


@settings(max_examples=25)
@given(
    vocab=st.integers(3, 8),
    choices=st.lists(st.integers(0, 6), min_size=1, max_size=7),
    tokens=st.lists(st.integers(0, 7), min_size=7, max_size=7),
    params=filters,
    salt=st.integers(0, 10**6),
)
def test_point_mass_tree_law_is_exact(vocab: int, choices: list[int], tokens: list[int], params, salt: int) -> None:
    """Deterministic nodes told as one-hot laws (any tokens, duplicate siblings included), trees up
    to 7 nodes: the walk a greedy request, or a deterministic node, takes in a batch of sampled
    drafts (point-mass drafts alone take ``position_tokens``: test_sampling_verify)."""
    parents = random_parents(choices)
    case = Case(vocab, parents, params, [1, 2, 2], salt, stochastic=False, tokens=[t % vocab for t in tokens[: len(parents)]])
    assert max_deviation(case) < TOL


@settings(max_examples=15)
@given(vocab=st.integers(3, 4), length=st.integers(1, 3), params=filters, salt=st.integers(0, 10**6))
def test_stochastic_chain_law_is_exact(vocab: int, length: int, params, salt: int) -> None:
    """Leviathan/Chen on chains, integrated over the drafted tokens."""
    case = Case(vocab, list(range(-1, length - 1)), params, [2], salt, stochastic=True)
    assert max_deviation(case) < TOL


@settings(max_examples=10)
@given(choices=st.lists(st.integers(0, 6), min_size=2, max_size=5), params=filters, salt=st.integers(0, 10**6))
def test_stochastic_tree_law_is_exact(choices: list[int], params, salt: int) -> None:
    """SpecInfer recursive rejection over i.i.d. siblings, integrated over the drafted tokens."""
    case = Case(3, random_parents(choices), params, [], salt, stochastic=True)
    assert max_deviation(case) < TOL


@settings(max_examples=12)
@given(choices=st.lists(st.integers(0, 6), min_size=2, max_size=5), params=filters, draft=filters,
       salt=st.integers(0, 10**6))
def test_sampled_tree_without_replacement_law_is_exact(choices: list[int], params, draft, salt: int) -> None:
    """What the model drafters do (``sampling.draw_siblings``): nodes drawn from the drafter's own
    processed law (its temperature / top-k / top-p / penalties), siblings without replacement,
    each node verified against the law it was drawn from. Integrated over the drafted tokens."""
    case = Case(4, random_parents(choices), params, [1], salt, stochastic=True, draft_params=draft,
                without_replacement=True)
    assert max_deviation(case) < TOL


@settings(max_examples=10)
@given(vocab=st.integers(3, 4), length=st.integers(1, 3), params=filters, draft=filters, salt=st.integers(0, 10**6))
def test_sampled_chain_from_a_processed_draft_law_is_exact(vocab: int, length: int, params, draft, salt: int) -> None:
    """Chains drawn from a processed (filtered: some tokens have no mass) draft law."""
    case = Case(vocab, list(range(-1, length - 1)), params, [2], salt, stochastic=True, draft_params=draft)
    assert max_deviation(case) < TOL


def test_law_check_detects_siblings_told_the_law_with_replacement() -> None:
    """Negative control: siblings drawn without replacement but verified as if i.i.d. is lossy."""
    case = Case(4, [-1, -1, -1], SamplingParams(temperature=0.8), [], 5, stochastic=True, without_replacement=True,
                misreport_siblings=True)
    assert max_deviation(case) > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("parents", [[-1, -1, -1, 0, 0, 1, 3], [-1, 0, 1, 2, 3, 4, 5]], ids=["tree7", "chain7"])
def test_stochastic_seven_node_law_is_exact(parents: list[int]) -> None:
    params = SamplingParams(temperature=0.9, top_k=2, top_p=0.9, min_p=0.05)
    assert max_deviation(Case(3, parents, params, [1], 7, stochastic=True)) < TOL


def test_law_check_detects_a_wrong_draft_law() -> None:
    """Negative control: verifying against a misreported draft law is measurably lossy."""
    case = Case(4, [-1, -1, 0], SamplingParams(), [], 3, stochastic=True, misreport_draft=True)
    assert max_deviation(case) > 1e-3


# --- grammar-constrained verification (issue 31): the law is the constrained sampler's ----------

grammar_filters = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.7, 1.0, 1.6]),
    top_k=st.sampled_from([-1, 2]),
    top_p=st.sampled_from([1.0, 0.8]),
    repetition_penalty=st.sampled_from([1.0, 1.4]),
)
regexes = st.sampled_from(["(ab|ba)c*a?", "a(b|c)+", "(a|b)(c|ab)*", "abc?"])


@settings(max_examples=25, deadline=None)
@given(
    choices=st.lists(st.integers(0, 6), min_size=1, max_size=6),
    tokens=st.lists(st.integers(0, 4), min_size=6, max_size=6),
    regex=regexes,
    params=grammar_filters,
    salt=st.integers(0, 10**6),
)
def test_grammar_point_mass_tree_law_is_exact(choices: list[int], tokens: list[int], regex: str, params, salt: int) -> None:
    """Deterministic drafts told as one-hot laws (any tokens, refused ones included: those are cut
    with their subtrees), walked under each position's grammar mask."""
    parents = random_parents(choices)
    case = Case(5, parents, params, [1, 2], salt, stochastic=False, tokens=tokens[: len(parents)], grammar=regex)
    assert max_deviation(case) < TOL


@settings(max_examples=12, deadline=None)
@given(length=st.integers(1, 3), regex=regexes, params=grammar_filters, draft=grammar_filters,
       salt=st.integers(0, 10**6))
def test_grammar_sampled_chain_law_is_exact(length: int, regex: str, params, draft, salt: int) -> None:
    """Draft-model chains drawn from the drafter's own (unmasked) processed law: refused tokens
    are kept and told their real law, and the constrained target rejects them."""
    case = Case(5, list(range(-1, length - 1)), params, [2], salt, stochastic=True, draft_params=draft, grammar=regex)
    assert max_deviation(case) < TOL


@settings(max_examples=6, deadline=None)
@given(choices=st.lists(st.integers(0, 6), min_size=2, max_size=3), regex=regexes, params=grammar_filters,
       salt=st.integers(0, 10**6))
def test_grammar_sampled_tree_without_replacement_law_is_exact(choices: list[int], regex: str, params, salt: int) -> None:
    """Draft-model trees (siblings without replacement) under a grammar."""
    case = Case(5, random_parents(choices), params, [1], salt, stochastic=True, without_replacement=True, grammar=regex)
    assert max_deviation(case) < TOL


def test_law_check_detects_verification_without_the_grammar_masks() -> None:
    """Negative control: the same drafts verified against the unmasked target are lossy."""
    case = Case(5, [-1, 0], SamplingParams(temperature=1.0), [], 3, stochastic=True, grammar="(ab|ba)c*a?",
                unmasked_verify=True)
    assert max_deviation(case) > 1e-3
