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
    d = NgramDrafter(max_n=3, min_n=2, edits=False)
    assert d.propose(0, [1, 2, 3, 4, 5], 4) is None
    assert d.propose(0, [1, 2, 1, 2], 0) is None


@pytest.mark.parametrize("kw", [dict(max_n=0), dict(min_n=3, max_n=2), dict(width=0)])
def test_bad_config(kw) -> None:
    with pytest.raises(ValueError):
        NgramDrafter(**kw)
    with pytest.raises(TypeError, match="edits"):
        NgramDrafter(edits=1)


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
    d = NgramDrafter(max_n=3, min_n=1, width=width, edits=False)
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
    assert draft.is_chain == all(depths[j] == j + 1 for j in range(len(draft)))  # each node below the last
    if width == 1:
        assert draft.is_chain


# ---- one edit between the tail and an earlier occurrence (edits=True, the default) ----

PASSAGE = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19]
COMMA = 99


@pytest.mark.parametrize(
    ("output", "expected"),
    [
        ([10, 11, 12, COMMA], [13, 14, 15]),  # a token inserted: the copy goes on after it
        ([10, 11, 12, COMMA, 13], [14, 15, 16]),  # ... one token past it
        ([10, 11, 12, 50, 14], [15, 16, 17]),  # a token replaced
        ([10, 11, 12, 14], [15, 16, 17]),  # a token dropped
        ([10, 11, COMMA, 50], None),  # two edits: no alignment
    ],
)
def test_a_rewrite_of_a_passage_drafts_past_its_edit(output: list[int], expected: list[int] | None) -> None:
    tokens = [1, 2, *PASSAGE, 3, 4, *output]
    assert NgramDrafter(max_n=4, min_n=2, edits=False).propose(0, tokens, 3) is None
    draft = NgramDrafter(max_n=4, min_n=2).propose(0, tokens, 3)
    assert (draft and draft.tokens) == expected


def test_an_exact_match_wins_over_an_edit() -> None:
    # [12, 99] occurs exactly (-> 7); the passage aligns only with an edit
    tokens = [12, COMMA, 7, 1, *PASSAGE, 2, 10, 11, 12, COMMA]
    assert NgramDrafter(max_n=4, min_n=2).propose(0, tokens, 1).tokens == [7]


def test_the_alignment_holding_more_tokens_wins_then_kind_then_recency() -> None:
    # Inserted (hold 3: [20 21 22] + 99) beats a more recent replaced alignment holding 2.
    tokens = [20, 21, 22, 30, 5, 21, 22, 40, 6, 20, 21, 22, COMMA]
    assert NgramDrafter(max_n=4, min_n=2).propose(0, tokens, 1).tokens == [30]
    # Equal holdings: inserted before replaced, whatever their recency.
    tokens = [21, 22, 30, 5, 7, 21, 22, 40, 6, 21, 22, COMMA]
    draft = NgramDrafter(max_n=4, min_n=2).propose(0, tokens, 1)
    assert draft.tokens == [40]  # inserted at the later occurrence ([21 22] then 40)


def _edit_reference(tokens: list[int], max_n: int, min_n: int) -> list[int]:
    """Continuation starts ranked as NgramDrafter documents, by brute force."""
    L, need = len(tokens), max(2, min_n)
    best: dict[int, tuple[int, int]] = {}
    for e in range(L - 1):
        for q in range(1, min_n + 1):
            for kind, (skip_tail, skip_src) in enumerate([(1, 0), (1, 1), (0, 1)]):
                if kind == 2 and q == 1:
                    continue
                held, i = 0, 0
                while held < max_n:
                    if i < q - 1:
                        t, s = L - 1 - i, e - 1 - i
                    else:
                        t, s = L - q - skip_tail - (i - (q - 1)), e - q - skip_src - (i - (q - 1))
                    if t < 0 or s < 0 or tokens[t] != tokens[s]:
                        break
                    held, i = held + 1, i + 1
                if held >= need and (held, -kind) > best.get(e, (-1, 0)):
                    best[e] = (held, -kind)
    return sorted(best, key=lambda e: (best[e][0], best[e][1], e), reverse=True)


@given(
    tokens=st.lists(st.integers(0, 3), min_size=3, max_size=40),
    max_n=st.integers(1, 5),
    min_n=st.integers(1, 3),
    width=st.integers(1, 3),
    k=st.integers(1, 6),
)
def test_edit_alignments_match_a_brute_force_reference(
    tokens: list[int], max_n: int, min_n: int, width: int, k: int
) -> None:
    min_n = min(min_n, max_n)
    exact = NgramDrafter(max_n=max_n, min_n=min_n, width=width, edits=False).propose(0, tokens, k)
    draft = NgramDrafter(max_n=max_n, min_n=min_n, width=width).propose(0, tokens, k)
    if exact is not None:  # edits only where the exact lookup finds nothing
        assert draft == exact
        return
    starts = _edit_reference(tokens, max_n, min_n)
    conts: list[list[int]] = []
    for e in starts:
        cont = tokens[e : e + k]
        if cont not in conts:
            conts.append(cont)
        if len(conts) == width:
            break
    if not conts:
        assert draft is None
        return
    assert draft is not None and draft.tokens[0] == conts[0][0]
    if width == 1:
        assert draft.tokens == conts[0]
    # every root-to-node path is the start of one of the ranked continuations
    for node in range(len(draft)):
        path, j = [], node
        while j >= 0:
            path.append(draft.tokens[j])
            j = draft.parents[j]
        path.reverse()
        assert any(c[: len(path)] == path for c in conts), (tokens, path, conts)
