"""N-gram drafter: proposals continue an earlier occurrence of the request's tail."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from treeserve.runner import NgramDrafter
from treeserve.scheduler import DraftTree


def test_chain_follows_most_recent_match() -> None:
    d = NgramDrafter(max_n=3, min_n=1)
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    draft = d.propose(0, tokens, 3)
    assert draft.tokens == [7, 8, 5] and draft.parents == [-1, 0, 1]


def test_tree_merges_distinct_continuations() -> None:
    d = NgramDrafter(max_n=2, min_n=2, width=3)
    tokens = [4, 5, 6, 7, 0, 4, 5, 6, 8, 0, 4, 5, 9, 0, 4, 5]
    # continuations, most recent first: [9, 0, 4, ..], [6, 8, 0, ..], [6, 7, 0, ..]; each gets
    # 6 // 3 = 2 tokens, and the two starting with 6 share that node.
    draft = d.propose(0, tokens, 6)
    assert draft.tokens == [9, 0, 6, 8, 7] and draft.parents == [-1, 0, -1, 2, 2]
    deeper = d.propose(0, tokens, 10)
    assert deeper.tokens == [9, 0, 4, 6, 8, 0, 7, 0] and deeper.parents == [-1, 0, 1, -1, 3, 4, 3, 6]


def test_no_match_no_draft() -> None:
    d = NgramDrafter(max_n=3, min_n=2)
    assert d.propose(0, [1, 2, 3, 4, 5], 4) is None
    assert d.propose(0, [1, 2, 1, 2], 0) is None


@pytest.mark.parametrize("kw", [dict(max_n=0), dict(min_n=3, max_n=2), dict(width=0)])
def test_bad_config(kw) -> None:
    with pytest.raises(ValueError):
        NgramDrafter(**kw)


def test_bad_tree() -> None:
    with pytest.raises(ValueError, match="parents"):
        DraftTree([1, 2], [-1, 1])
    with pytest.raises(ValueError, match="differ in length"):
        DraftTree([1, 2], [-1])


@given(
    tokens=st.lists(st.integers(0, 4), min_size=2, max_size=60),
    k=st.integers(1, 8),
    width=st.integers(1, 4),
)
def test_every_path_is_an_observed_continuation(tokens: list[int], k: int, width: int) -> None:
    d = NgramDrafter(max_n=3, min_n=1, width=width)
    draft = d.propose(0, tokens, k)
    if draft is None:
        assert tokens[-1] not in tokens[:-1]
        return
    assert 1 <= len(draft) <= k
    depths = draft.depths()
    for node in range(len(draft)):
        path = []
        j = node
        while j >= 0:
            path.append(draft.tokens[j])
            j = draft.parents[j]
        path.reverse()
        assert len(path) == depths[node]
        # the path follows some earlier occurrence of the last token
        hay = tokens[:-1]
        assert any(
            hay[i] == tokens[-1] and tokens[i + 1 : i + 1 + len(path)] == path for i in range(len(hay))
        ), (tokens, path)
    siblings = {(p, t) for p, t in zip(draft.parents, draft.tokens)}
    assert len(siblings) == len(draft), "no duplicate siblings"
