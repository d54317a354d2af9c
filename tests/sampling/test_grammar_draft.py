"""Drafts under a grammar (issue 31): ``GrammarState.check_draft`` and ``jump_forward``.

``check_draft`` is compared with a reference built from fresh matchers (one per tree position,
advanced along the node's path), and the state it walks must be exactly as before: a hypothesis
state machine interleaves committed tokens, draft checks and jump-forward queries, and after
each step the state's mask equals that of a fresh matcher fed the committed tokens.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from treeserve.sampling import GrammarCompiler, StructuredOutput, unpack_bitmask

VOCAB = ["<eos>", "{", "}", '"', ":", ",", "a", "b", "1", '{"', '":', '"a', "ab", " "]
V = len(VOCAB) + 3  # padding ids past the tokenizer
SCHEMA = {"type": "object", "properties": {"ab": {"type": "string", "maxLength": 3}, "b": {"type": "integer"}},
          "required": ["ab", "b"], "additionalProperties": False}  # fmt: skip
SPECS = [StructuredOutput(json_schema=SCHEMA), StructuredOutput(regex="(ab|ba)+1?"), StructuredOutput(choice=("ab1", "b"))]
COMPILER = GrammarCompiler(VOCAB, V, [0], vocab_type="raw")


def fresh(spec: StructuredOutput, tokens: list[int]):
    """A new state fed ``tokens`` (None if the grammar refuses one)."""
    state = COMPILER.new_state(spec)
    for t in tokens:
        if not state.accept(t):
            return None
    return state


def reference(spec: StructuredOutput, prefix: list[int], tokens: list[int], parents: list[int], sampled: bool):
    """``check_draft`` by fresh matchers: node kept iff its parent is kept and accepted by the
    grammar (and, sampled, a refused node under an accepted parent is kept too)."""
    keep, rows, live = [], [fresh(spec, prefix).bitmask.clone()], set()
    for k, (tok, par) in enumerate(zip(tokens, parents)):
        if par >= 0 and par not in live:
            continue
        path, node = [tok], par
        while node >= 0:
            path.insert(0, tokens[node])
            node = parents[node]
        state = fresh(spec, prefix + path)
        if state is not None:
            keep.append(k)
            stopped = tok == 0
            rows.append(torch.full_like(rows[0], -1) if stopped else state.bitmask.clone())
            if not stopped:
                live.add(k)
        elif sampled:
            keep.append(k)
            rows.append(torch.full_like(rows[0], -1))
    return keep, torch.stack(rows)


def greedy_valid(spec: StructuredOutput, n: int, seed: int) -> list[int]:
    """``n`` tokens the grammar allows (random among the allowed, no stop token)."""
    gen = torch.Generator().manual_seed(seed)
    state, out = COMPILER.new_state(spec), []
    for _ in range(n):
        allowed = unpack_bitmask(state.bitmask[None], V)[0].nonzero().view(-1).tolist()
        allowed = [t for t in allowed if t != 0]
        if not allowed:
            break
        t = allowed[int(torch.randint(len(allowed), (1,), generator=gen))]
        state.accept(t)
        out.append(t)
    return out


trees = st.lists(st.tuples(st.integers(0, 8), st.integers(0, V - 1)), min_size=1, max_size=8)


@settings(max_examples=60, deadline=None)
@given(spec=st.sampled_from(SPECS), prefix_len=st.integers(0, 4), seed=st.integers(0, 100), nodes=trees,
       sampled=st.booleans(), valid_bias=st.integers(0, 3))  # fmt: skip
def test_check_draft_matches_fresh_matchers(spec, prefix_len, seed, nodes, sampled, valid_bias) -> None:
    prefix = greedy_valid(spec, prefix_len, seed)
    walk = greedy_valid(spec, prefix_len + 8, seed + 1)[len(prefix):] if fresh(spec, prefix) else []
    parents = [(c % (k + 1)) - 1 for k, (c, _) in enumerate(nodes)]
    # Mostly grammatical tokens (a valid continuation), some random ones (refused).
    tokens = [walk[k] if k < len(walk) and (t % 4) < valid_bias else t for k, (_, t) in enumerate(nodes)]
    state = fresh(spec, prefix)
    before = state.bitmask.clone()
    check = state.check_draft(tokens, parents, sampled)
    keep, masks = reference(spec, prefix, tokens, parents, sampled)
    assert check.keep == keep
    assert torch.equal(check.masks, masks)
    assert torch.equal(state.bitmask, before)
    for k in check.keep:  # kept nodes form a tree
        assert parents[k] < 0 or parents[k] in check.keep


def test_check_draft_cuts_a_deterministic_chain_at_the_first_refusal() -> None:
    state = COMPILER.new_state(StructuredOutput(regex="(ab|ba)+1?"))
    ab, a, b, one = VOCAB.index("ab"), VOCAB.index("a"), VOCAB.index("b"), VOCAB.index("1")
    chain = [ab, b, a, one, ab, a]  # "abba1" then "ab": refused
    check = state.check_draft(chain, [-1, 0, 1, 2, 3, 4], sampled=False)
    assert check.keep == [0, 1, 2, 3]
    after_one = unpack_bitmask(check.masks[4:5], V)[0].nonzero().view(-1).tolist()
    assert after_one == [0]  # "abba1" is complete: only the stop token
    sampled = state.check_draft(chain, [-1, 0, 1, 2, 3, 4], sampled=True)
    assert sampled.keep == [0, 1, 2, 3, 4] and bool((sampled.masks[5] == -1).all())


def test_jump_forward_gives_the_forced_tokens() -> None:
    state = COMPILER.new_state(StructuredOutput(json_schema=SCHEMA))
    forced = state.jump_forward(16)
    assert "".join(VOCAB[t] for t in forced) == '{"ab": "'[: len("".join(VOCAB[t] for t in forced))]
    assert len("".join(VOCAB[t] for t in forced)) >= 4  # '{"ab' at least (the last token may merge)
    assert state.jump_forward(1) == forced[:1] and state.jump_forward(0) == []
    for t in forced:
        assert state.accept(t)
    assert state.jump_forward(16) == [] or state.jump_forward(16)[0] != forced[0]
    choice = COMPILER.new_state(StructuredOutput(choice=("ab1", "b")))
    assert choice.jump_forward(8) == []  # two ways to start: nothing forced


class DraftedState(RuleBasedStateMachine):
    """Commits, draft checks and jump-forward queries interleaved: the state always has the mask
    of a fresh matcher fed the committed tokens."""

    @initialize(spec=st.sampled_from(SPECS))
    def start(self, spec) -> None:
        self.spec, self.state, self.committed = spec, COMPILER.new_state(spec), []

    @rule(seed=st.integers(0, 10**6))
    def commit_allowed(self, seed: int) -> None:
        allowed = unpack_bitmask(self.state.bitmask[None], V)[0].nonzero().view(-1).tolist()
        allowed = [t for t in allowed if t != 0]
        if allowed and not self.state.ended:
            t = allowed[seed % len(allowed)]
            assert self.state.accept(t)
            self.committed.append(t)

    @rule(nodes=trees, sampled=st.booleans())
    def check_a_draft(self, nodes, sampled: bool) -> None:
        if not self.state.ended:
            self.state.check_draft([t for _, t in nodes], [(c % (k + 1)) - 1 for k, (c, _) in enumerate(nodes)], sampled)

    @rule(n=st.integers(0, 8))
    def ask_jump_forward(self, n: int) -> None:
        forced = self.state.jump_forward(n)
        assert len(forced) <= n and forced == fresh(self.spec, self.committed).jump_forward(n)

    @invariant()
    def same_as_fresh(self) -> None:
        if hasattr(self, "state") and not self.state.ended:
            assert torch.equal(self.state.bitmask, fresh(self.spec, self.committed).bitmask)


TestDraftedState = DraftedState.TestCase
TestDraftedState.settings = settings(max_examples=30, stateful_step_count=12, deadline=None)
