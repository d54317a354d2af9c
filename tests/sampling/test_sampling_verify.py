"""verify: greedy reference, consistency with sample, batch invariance, edge cases, Monte Carlo law."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from tests.sampling._sampling_ref import process_row, softmax
from tests.sampling._verify_law import random_parents, table_logits
from treeserve.sampling import SamplingBatch, SamplingParams, greedy_tokens, sample, verify
from treeserve.sampling.tree_walk import one_hot, walk_tree
from treeserve.sampling.verify import assemble, final_tokens, greedy_paths, prepare_tree, verify_uniforms


def pack(trees: list[tuple[list[int], list[int]]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens, parents) per request -> padded [B, M] tensors and num_draft [B]."""
    m = max((len(t) for t, _ in trees), default=0)
    tokens = torch.tensor([t + [-1] * (m - len(t)) for t, _ in trees], dtype=torch.int64).reshape(len(trees), m)
    parents = torch.tensor([p + [-1] * (m - len(p)) for _, p in trees], dtype=torch.int64).reshape(len(trees), m)
    return tokens, parents, torch.tensor([len(t) for t, _ in trees], dtype=torch.int64)


def tree_logits(trees, vocab: int, salt: int) -> torch.Tensor:
    rows = []
    for toks, parents in trees:
        rows.append(table_logits((), vocab, salt))
        for k in range(len(toks)):
            path, j = [], k
            while j >= 0:
                path.append(toks[j])
                j = parents[j]
            rows.append(table_logits(tuple(reversed(path)), vocab, salt))
    return torch.stack(rows)


def greedy_reference(
    trees, vocab: int, salt: int, params: SamplingParams, history: list[int]
) -> list[tuple[list[int], list[float]]]:
    """Per tree: the emitted tokens and their logprobs under the processed row they came from."""
    out = []
    for toks, parents in trees:
        emitted, logprobs, cur, ctx = [], [], -1, ()
        while True:
            row = process_row(table_logits(ctx, vocab, salt).tolist(), params, history + list(ctx), len(ctx))
            best = row.index(max(row))
            child = next((k for k in range(len(toks)) if parents[k] == cur and toks[k] == best), None)
            emitted.append(best)
            logprobs.append(row[best] - math.log(sum(math.exp(x) for x in row)))
            if child is None:
                break
            cur, ctx = child, ctx + (best,)
        out.append((emitted, logprobs))
    return out


tree_st = st.lists(st.integers(0, 6), max_size=6).flatmap(
    lambda c: st.tuples(st.lists(st.integers(0, 4), min_size=len(c), max_size=len(c)), st.just(random_parents(c)))
)


@settings(max_examples=30)
@given(trees=st.lists(tree_st, min_size=1, max_size=4), salt=st.integers(0, 1000),
       penalty=st.sampled_from([1.0, 1.5]))
def test_greedy_accepts_longest_argmax_path(trees, salt: int, penalty: float) -> None:
    vocab = 5
    params = SamplingParams(temperature=0, repetition_penalty=penalty, top_k=3, logprobs=0)
    tokens, parents, nd = pack(trees)
    b = len(trees)
    batch = SamplingBatch.build([params] * b, list(range(b)), [[1]] * b, vocab, num_generated=[0] * b)
    out = verify(tree_logits(trees, vocab, salt), batch, tokens, parents, nd, torch.zeros(b, dtype=torch.int64))
    quiet = SamplingBatch.build([replace(params, logprobs=None)] * b, list(range(b)), [[1]] * b, vocab, num_generated=[0] * b)
    unasked = verify(tree_logits(trees, vocab, salt), quiet, tokens, parents, nd, torch.zeros(b, dtype=torch.int64))
    assert torch.equal(unasked.tokens, out.tokens) and unasked.logprobs.isnan().all()  # as ``sample``: not computed
    want = greedy_reference(trees, vocab, salt, params, [1])
    for i, (w, lps) in enumerate(want):
        assert out.tokens[i, : out.num_tokens[i]].tolist() == w
        assert out.logprobs[i, : out.num_tokens[i]].tolist() == pytest.approx(lps, abs=1e-5)
        assert out.logprobs[i, out.num_tokens[i] :].isnan().all()
        assert int(out.accept_len[i]) == len(w) - 1
        path = out.path[i, : out.accept_len[i]].tolist()
        assert [trees[i][0][k] for k in path] == w[:-1]
        assert int(out.last_node[i]) == (path[-1] if path else -1)
        assert all(trees[i][1][c] == p for p, c in zip([-1, *path], path))


def _general_verify(target, batch, tokens, parents, nd, pos):
    """``verify`` through the general path (laws, ``walk_tree`` with one-hot draft rows, the
    residual's argmax)."""
    nodes = torch.cat([tokens[i, :n] for i, n in enumerate(nd.tolist())])
    prep = prepare_tree(target, batch, tokens, parents, nd, one_hot(nodes, batch.vocab_size, torch.float32))
    walk = walk_tree(prep.target, prep.draft, tokens, parents, nd, verify_uniforms(batch, pos, prep.depth))
    return assemble(prep, walk, final_tokens(prep, walk, batch.greedy, torch.zeros(batch.num_rows)), batch.any_logprobs)


def greedy_case(trees: list, seed: int, bad_row: int, bad: float,
                vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed ``trees`` and target rows for them (rounded: ties happen), row ``bad_row`` (when in
    range) holding ``bad`` (NaN / +inf: an invalid request)."""
    tokens, parents, nd = pack(trees)
    target = torch.randn(int((1 + nd).sum()), vocab, generator=torch.Generator().manual_seed(seed)).round(decimals=1)
    if 0 <= bad_row < target.shape[0]:
        target[bad_row, 1] = bad
    return tokens, parents, nd, target


@settings(max_examples=40)
@given(trees=st.lists(tree_st, min_size=1, max_size=4), seed=st.integers(0, 2**31 - 1),
       nan_row=st.integers(-1, 20), penalty=st.sampled_from([1.0, 1.3]), logprobs=st.sampled_from([None, 0]))
def test_all_greedy_fast_path_equals_the_general_walk(trees, seed: int, nan_row: int, penalty: float,
                                                      logprobs: int | None) -> None:
    """All-greedy batches with point-mass drafts skip the laws (``greedy_walk``); every output
    equals the general walk's, invalid (NaN) requests and duplicated sibling tokens included."""
    vocab = 5
    tokens, parents, nd, target = greedy_case(trees, seed, nan_row, float("nan"), vocab)
    b = len(trees)
    params = SamplingParams(temperature=0, repetition_penalty=penalty, logprobs=logprobs)
    batch = SamplingBatch.build([params] * b, list(range(b)), [[1, 2]] * b, vocab)
    assert batch.all_greedy
    pos = torch.arange(b, dtype=torch.int64)
    fast, ref = verify(target, batch, tokens, parents, nd, pos), _general_verify(target, batch, tokens, parents, nd, pos)
    for name in ("tokens", "num_tokens", "accept_len", "last_node", "path", "valid"):
        assert torch.equal(getattr(fast, name), getattr(ref, name)), name
    torch.testing.assert_close(fast.logprobs, ref.logprobs, equal_nan=True, rtol=0, atol=0)


@settings(max_examples=60)
@given(trees=st.lists(tree_st, min_size=1, max_size=4), seed=st.integers(0, 2**31 - 1), nan_row=st.integers(-1, 20),
       inf=st.booleans())
def test_host_greedy_paths_equal_verify(trees, seed: int, nan_row: int, inf: bool) -> None:
    """``greedy_paths`` (the runner's host walk for plain greedy steps with point-mass drafts) gives
    ``verify``'s tokens, accepted nodes and validity: ties, duplicated sibling tokens and NaN / +inf
    rows (invalid requests) included."""
    vocab = 5
    tokens, parents, nd, target = greedy_case(trees, seed, nan_row, float("inf") if inf else float("nan"), vocab)
    b = len(trees)
    batch = SamplingBatch.build([SamplingParams(temperature=0)] * b, list(range(b)), [[1, 2]] * b, vocab)
    ref = verify(target, batch, tokens, parents, nd, torch.arange(b, dtype=torch.int64))
    n = nd.tolist()
    paths = greedy_paths(greedy_tokens(target).tolist(), [tokens[i, : n[i]].tolist() for i in range(b)],
                         [parents[i, : n[i]].tolist() for i in range(b)])
    for i, path in enumerate(paths):
        assert bool(ref.valid[i]) == bool(path.tokens), i
        if path.tokens:
            a = int(ref.accept_len[i])
            assert path.tokens == tuple(ref.tokens[i, : a + 1].tolist())
            assert path.nodes == tuple(ref.path[i, :a].tolist())


def test_zero_drafts_equals_sample_and_rows_are_batch_invariant() -> None:
    vocab = 30
    params = [SamplingParams(top_p=0.9, seed=1, logprobs=0), SamplingParams(temperature=0), SamplingParams(top_k=4, min_p=0.05),
              SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4)]
    b = len(params)
    batch = SamplingBatch.build(params, [11, 12, 13, 14], [[1, 2, 2]] * b, vocab)
    logits = torch.randn(b, vocab)
    pos = torch.tensor([5, 6, 7, 8])
    empty = torch.zeros(b, 0, dtype=torch.int64)
    out = verify(logits, batch, empty, empty, torch.zeros(b, dtype=torch.int64), pos)
    alone = sample(logits, batch, pos)
    assert torch.equal(out.tokens[:, 0], alone.tokens)
    torch.testing.assert_close(out.logprobs[:, 0], alone.logprobs, atol=1e-5, rtol=1e-5)

    trees = [([3, 4, 5], [-1, 0, 1]), ([], []), ([7, 7, 2, 9], [-1, -1, 0, 2]), ([1], [-1])]
    tokens, parents, nd = pack(trees)
    target = torch.randn(int((1 + nd).sum()), vocab)
    probs = torch.softmax(torch.randn(int(nd.sum()), vocab), -1)
    full = verify(target, batch, tokens, parents, nd, pos, draft_probs=probs)
    row_start, node_start = 0, 0
    for i, (toks, par) in enumerate(trees):
        one = SamplingBatch.build([params[i]], [11 + i], [[1, 2, 2]], vocab)
        t, p, n = pack([(toks, par)])
        alone = verify(target[row_start: row_start + 1 + len(toks)], one, t, p, n, pos[i: i + 1],
                       draft_probs=probs[node_start: node_start + len(toks)])
        k = int(alone.num_tokens[0])
        assert full.tokens[i, :k].tolist() == alone.tokens[0, :k].tolist()
        assert int(full.last_node[i]) == int(alone.last_node[0])
        row_start += 1 + len(toks)
        node_start += len(toks)


def test_edge_cases_never_crash() -> None:
    vocab = 6
    params = [SamplingParams()] * 5
    batch = SamplingBatch.build(params, list(range(5)), [[]] * 5, vocab)
    trees = [([2], [-1]), ([3], [-1]), ([4, 4], [-1, -1]), ([1], [-1]), ([5], [-1])]
    tokens, parents, nd = pack(trees)
    target = torch.randn(int((1 + nd).sum()), vocab, dtype=torch.float64)
    probs = torch.softmax(torch.randn(int(nd.sum()), vocab, dtype=torch.float64), -1)
    probs[0, 2] = 0.0  # request 0: drafted token has draft probability 0 -> node skipped
    target[2, 0] = float("nan")  # request 1: NaN target row -> invalid
    probs[2] = torch.softmax(target[4], -1)  # request 2: q == p -> residual mass 0, always accepted
    probs[4, 1] = float("inf")  # request 3: inf draft row -> invalid
    target[9] = float("-inf")  # request 4: node row with no admissible token -> invalid
    out = verify(target, batch, tokens, parents, nd, torch.zeros(5, dtype=torch.int64), draft_probs=probs)
    assert out.valid.tolist() == [True, False, True, False, False]
    assert out.accept_len[0] == 0 and 0 <= out.tokens[0, 0] < vocab
    assert out.accept_len[2] == 1 and out.tokens[2, 0] == 4 and out.last_node[2] == 0
    assert (out.tokens[~out.valid] == -1).all() and (out.num_tokens[~out.valid] == 0).all()


def test_bad_inputs_raise() -> None:
    vocab = 6
    batch = SamplingBatch.build([SamplingParams()] * 2, [0, 1], [[], []], vocab)
    tokens, parents, nd = pack([([1, 2], [-1, 0]), ([3], [-1])])
    target = torch.randn(5, vocab)
    pos = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="target_logits has 4 rows"):
        verify(target[:4], batch, tokens, parents, nd, pos)
    with pytest.raises(ValueError, match="draft_parents must satisfy"):
        verify(target, batch, tokens, torch.tensor([[-1, 1], [-1, -1]]), nd, pos)
    with pytest.raises(ValueError, match="draft_tokens must be in"):
        verify(target, batch, torch.tensor([[1, 9], [3, 0]]), parents, nd, pos)
    with pytest.raises(ValueError, match="num_draft must be in"):
        verify(target, batch, tokens, parents, torch.tensor([3, 0]), pos)
    with pytest.raises(ValueError, match="draft_probs has 2 rows"):
        verify(target, batch, tokens, parents, nd, pos, draft_probs=torch.ones(2, vocab))
    with pytest.raises(TypeError, match="positions must be int64"):
        verify(target, batch, tokens, parents, nd, pos.int())
    with pytest.raises(ValueError, match="draft_tokens and draft_parents"):
        verify(target, batch, tokens[:1], parents[:1], nd, pos)


def test_monte_carlo_joint_law_through_real_rng() -> None:
    """Chains of 2 stochastic drafts, then ``sample`` to complete 3 tokens: G-test + TV bound."""
    vocab, salt, n = 4, 5, 20000
    params = SamplingParams(temperature=0.9, top_k=3, top_p=0.95)
    law_memo: dict[tuple[int, ...], list[float]] = {}

    def target(ctx: tuple[int, ...]) -> list[float]:
        if ctx not in law_memo:
            law_memo[ctx] = softmax(process_row(table_logits(ctx, vocab, salt).tolist(), params))
        return law_memo[ctx]

    def draft(ctx: tuple[int, ...]) -> torch.Tensor:
        return torch.softmax(table_logits(ctx, vocab, salt + 1, scale=1.0), 0)

    gen = torch.Generator().manual_seed(0)
    first = torch.multinomial(draft(()), n, replacement=True, generator=gen)
    second = torch.empty(n, dtype=torch.int64)
    for t in range(vocab):
        sel = first == t
        second[sel] = torch.multinomial(draft((t,)), int(sel.sum()), replacement=True, generator=gen)
    tokens = torch.stack([first, second], 1)
    rows, probs = [], []
    for a, b in tokens.tolist():
        rows += [table_logits((), vocab, salt), table_logits((a,), vocab, salt), table_logits((a, b), vocab, salt)]
        probs += [draft(()), draft((a,))]
    batch = SamplingBatch.build([params] * n, list(range(n)), [[]] * n, vocab)
    out = verify(torch.stack(rows).float(), batch, tokens, torch.tensor([[-1, 0]] * n), torch.full((n,), 2),
                 torch.full((n,), 10), draft_probs=torch.stack(probs).float())
    seqs = out.tokens.clone()
    for j in (1, 2):  # complete short outputs with plain sampling at the next positions
        short = (out.num_tokens <= j).nonzero()[:, 0]
        ctx_logits = torch.stack([table_logits(tuple(seqs[i, :j].tolist()), vocab, salt) for i in short.tolist()])
        sub = SamplingBatch.build([params] * len(short), short.tolist(), [[]] * len(short), vocab)
        seqs[short, j] = sample(ctx_logits.float(), sub, torch.full((len(short),), 10 + j)).tokens
    codes = (seqs[:, 0] * vocab + seqs[:, 1]) * vocab + seqs[:, 2]
    counts = torch.bincount(codes, minlength=vocab**3).double()
    expected = torch.tensor([
        target(())[a] * target((a,))[b] * target((a, b))[c]
        for a, b, c in itertools.product(range(vocab), repeat=3)
    ], dtype=torch.float64)
    assert counts[expected == 0].sum() == 0
    keep = expected > 0
    g = stats.power_divergence(counts[keep].numpy(), (expected[keep] * n).numpy(), lambda_="log-likelihood")
    assert g.pvalue > 1e-4, g
    tv = 0.5 * (counts / n - expected).abs().sum()
    assert tv < 0.04, tv
    assert out.accept_len.double().mean() > 0.3  # the drafts are actually being accepted


@settings(max_examples=40)
@given(trees=st.lists(tree_st, min_size=1, max_size=4), salt=st.integers(0, 1000), seed=st.integers(0, 2**31 - 1),
       pos=st.integers(0, 500), vocab=st.sampled_from([5, 600]), params=st.builds(
           SamplingParams, temperature=st.sampled_from([0.0, 0.7, 1.3]), top_k=st.sampled_from([-1, 3]),
           top_p=st.sampled_from([1.0, 0.8]), min_p=st.sampled_from([0.0, 0.1]),
           repetition_penalty=st.sampled_from([1.0, 1.4]), min_new_tokens=st.sampled_from([0, 2]), logprobs=st.just(0)))
def test_point_mass_drafts_emit_the_tokens_sample_draws(trees, salt: int, seed: int, pos: int, vocab: int,
                                                        params) -> None:
    """With point-mass drafts every emitted token is the one ``sample`` draws at its position, with
    the history of its path (so the law is the target's, and the output is what the request emits
    with no draft at all): the walk follows the first child whose token equals that draw. A
    600-token vocabulary has rows whose kept set fits the candidates (top-k 3) and rows it does
    not (top-p over a flat row)."""
    tokens, parents, nd = pack(trees)
    b = len(trees)
    history = [1, 2]
    batch = SamplingBatch.build([params] * b, [seed + i for i in range(b)], [history] * b, vocab,
                                eos_token_ids=[0], num_generated=[0] * b)  # fmt: skip
    positions = torch.arange(pos, pos + b, dtype=torch.int64)
    out = verify(tree_logits(trees, vocab, salt), batch, tokens, parents, nd, positions)
    for i, (toks, pars) in enumerate(trees):
        emitted, cur, ctx = [], -1, []
        while True:
            one = SamplingBatch.build([params], [seed + i], [history + ctx], vocab, eos_token_ids=[0],
                                      num_generated=[len(ctx)])  # fmt: skip
            drawn = sample(table_logits(tuple(ctx), vocab, salt)[None], one, positions[i : i + 1] + len(ctx))
            t = int(drawn.tokens[0])
            emitted.append(t)
            child = next((k for k in range(len(toks)) if pars[k] == cur and toks[k] == t), None)
            if child is None:
                break
            cur, ctx = child, ctx + [t]
        assert out.tokens[i, : out.num_tokens[i]].tolist() == emitted
        assert int(out.accept_len[i]) == len(emitted) - 1
