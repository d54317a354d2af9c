"""Exact output law of ``verify`` by enumeration (float64): a test helper.

The walk's randomness is integrated out exactly: node k's coin only matters through
``u_k < a_k`` where ``a_k`` (reported by the walk) depends on earlier coins, so scenarios are
split node by node into an accept branch (``u_k = 0``, weight ``a_k``) and a reject branch
(``u_k = a_k``, weight ``1 - a_k``), and the last token has the law of the final residual.
Stochastic drafts are integrated by enumerating every token assignment of the tree.

With a ``grammar`` (a tiny-vocabulary regex), the target law is the constrained sampler's
(disallowed tokens -inf before processing, the masks from a fresh xgrammar matcher per
context), and each drafted tree goes through the engine's path: ``GrammarState.check_draft``
cuts it and gives the per-position masks ``verify`` applies.
"""

from __future__ import annotations

import functools
import itertools
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tests.sampling._sampling_ref import process_row, softmax
from treeserve.sampling import GrammarCompiler, SamplingBatch, SamplingParams, StructuredOutput, unpack_bitmask
from treeserve.sampling.tree_walk import one_hot, walk_tree
from treeserve.sampling.verify import prepare_tree

Law = Callable[[tuple[int, ...]], list[float]]


def table_logits(ctx: tuple[int, ...], vocab: int, salt: int, scale: float = 1.5) -> torch.Tensor:
    """A deterministic 'model': float64 logits as a pseudo-random function of the context."""
    g = torch.Generator().manual_seed(hash((salt, *ctx)) % (2**31))
    return torch.randn(vocab, generator=g, dtype=torch.float64) * scale


@dataclass
class Case:
    vocab: int
    parents: list[int]
    params: SamplingParams
    history: list[int]
    salt: int
    stochastic: bool
    tokens: list[int] | None = None  # point-mass drafts: the fixed tree tokens
    misreport_draft: bool = False  # negative control: tell verify a uniform draft law
    draft_params: SamplingParams | None = None  # the drafter's processing of its logits (None: raw softmax)
    without_replacement: bool = False  # siblings drawn without replacement (each told its own law)
    misreport_siblings: bool = False  # negative control: such siblings told their parent's whole law
    grammar: str | None = None  # a regex over GRAMMAR_VOCAB (vocab must then be its length)
    unmasked_verify: bool = False  # negative control: verify without the grammar's masks

    def compiler(self) -> Any:
        return _compiler(self.vocab)

    def allowed(self, ctx: tuple[int, ...]) -> list[bool]:
        """Tokens the grammar allows after ``ctx`` (a fresh matcher; all after a stop token, whose
        next token the engine discards; none after a refused token, which has probability 0)."""
        if self.grammar is None:
            return [True] * self.vocab
        state = self.compiler().new_state(StructuredOutput(regex=self.grammar))
        for t in ctx:
            if not state.accept(t):
                return [False] * self.vocab
            if t == 0:
                return [True] * self.vocab
        return unpack_bitmask(state.bitmask[None], self.vocab)[0].tolist()

    def target_law(self) -> Law:
        memo: dict[tuple[int, ...], list[float]] = {}

        def law(ctx: tuple[int, ...]) -> list[float]:
            if ctx not in memo:
                allowed = self.allowed(ctx)
                if not any(allowed):
                    memo[ctx] = [1.0 / self.vocab] * self.vocab  # unreachable: a refused token came before
                    return memo[ctx]
                raw = table_logits(ctx, self.vocab, self.salt).tolist()
                row = process_row(
                    [x if ok else float("-inf") for x, ok in zip(raw, allowed)], self.params,
                    self.history + list(ctx), len(ctx), eos=(0,),
                )
                if self.params.greedy:
                    best = row.index(max(row))
                    memo[ctx] = [float(i == best) for i in range(self.vocab)]
                else:
                    memo[ctx] = softmax(row)
            return memo[ctx]

        return law

    def draft_law(self, ctx: tuple[int, ...]) -> list[float]:
        row = table_logits(ctx, self.vocab, self.salt + 1, scale=1.0).tolist()
        if self.draft_params is not None:
            row = process_row(row, self.draft_params, self.history + list(ctx), len(ctx), eos=(0,))
        return softmax(row)

    def node_law(self, k: int, tokens: Sequence[int]) -> list[float]:
        """The law node k was drawn from: its parent's draft law, minus (without replacement)
        the tokens of its earlier siblings, renormalized (all zeros when nothing is left)."""
        par = self.parents[k]
        q = self.draft_law(self.path(par, tokens) if par >= 0 else ())
        if self.without_replacement:
            taken = {tokens[j] for j in range(k) if self.parents[j] == par}
            q = [0.0 if t in taken else x for t, x in enumerate(q)]
            mass = sum(q)
            if mass > 0:
                return [x / mass for x in q]
            # exhausted: the untaken token with the largest raw draft logit, deterministically
            raw = table_logits(self.path(par, tokens) if par >= 0 else (), self.vocab, self.salt + 1, scale=1.0).tolist()
            pick = max((t for t in range(self.vocab) if t not in taken), key=lambda t: raw[t])
            return [float(t == pick) for t in range(self.vocab)]
        return q

    def path(self, k: int, tokens: Sequence[int]) -> tuple[int, ...]:
        out = []
        while k >= 0:
            out.append(tokens[k])
            k = self.parents[k]
        return tuple(reversed(out))


def emitted_law(case: Case) -> dict[tuple[int, ...], float]:
    """Exact law of the emitted token sequence, integrated over coins and draft tokens."""
    m, v = len(case.parents), case.vocab
    if case.stochastic:
        assignments = list(itertools.product(range(v), repeat=m))
    else:
        assert case.tokens is not None
        assignments = [tuple(case.tokens)]
    logits, probs, weights = [], [], []
    for toks in assignments:
        logits.append(table_logits((), v, case.salt))
        w = 1.0
        for k in range(m):
            logits.append(table_logits(case.path(k, toks), v, case.salt))
            q = case.node_law(k, toks)
            par = case.parents[k]
            probs.append(case.draft_law(case.path(par, toks) if par >= 0 else ()) if case.misreport_siblings else q)
            w *= q[toks[k]]
        weights.append(w if case.stochastic else 1.0)
    if case.stochastic:  # drop impossible draws (repeated siblings without replacement, filtered tokens)
        kept = [i for i, x in enumerate(weights) if x > 0]
        assignments = [assignments[i] for i in kept]
        logits = [x for i in kept for x in logits[i * (m + 1) : (i + 1) * (m + 1)]]
        probs = [x for i in kept for x in probs[i * m : (i + 1) * m]]
        weights = [weights[i] for i in kept]
    r = len(assignments)
    trees = [_checked_tree(case, toks, case.stochastic) for toks in assignments]
    pad = [[-1] * (m - len(p)) for _, p, _ in trees]
    tokens = torch.tensor([[toks[k] for k in keep] + [0] * len(z) for (keep, _, _), toks, z in zip(trees, assignments, pad)])
    parents = torch.tensor([par + z for (_, par, _), z in zip(trees, pad)], dtype=torch.int64).reshape(r, m)
    num_draft = torch.tensor([len(keep) for keep, _, _ in trees], dtype=torch.int64)
    # Rows of a cut tree: the kept nodes' rows in order, then padding (ignored by verify).
    rows = [[0, *[1 + k for k in keep], *[0] * len(z)] for (keep, _, _), z in zip(trees, pad)]
    logits = [logits[i * (m + 1) + j] for i, row in enumerate(rows) for j in row]
    probs = [probs[i * m + j - 1] if j else [1.0] * v for i, row in enumerate(rows) for j in row[1:]]
    bitmask = None
    if case.grammar is not None and not case.unmasked_verify:
        bitmask = torch.stack([torch.cat([mk, mk.new_full((m + 1 - mk.shape[0], mk.shape[1]), -1)]) for *_, mk in trees])
    batch = SamplingBatch.build(
        [case.params] * r, [0] * r, [case.history] * r, v, eos_token_ids=[0], num_generated=[0] * r
    )
    if case.stochastic:
        draft_probs = torch.tensor(probs, dtype=torch.float64).reshape(r * m, v)
    else:  # one-hot rows: the walk ``verify`` takes for deterministic nodes among sampled ones
        draft_probs = one_hot(tokens.reshape(-1), v, torch.float64)
    if case.misreport_draft and case.stochastic:
        draft_probs = torch.ones_like(draft_probs)
    prep = prepare_tree(torch.stack(logits), batch, tokens, parents, num_draft, draft_probs, draft_bitmask=bitmask)
    assert prep.valid.all()

    idx = torch.arange(r)
    u = torch.full((r, m), 0.5, dtype=torch.float64)
    w = torch.tensor(weights, dtype=torch.float64)

    def run(idx: torch.Tensor, u: torch.Tensor):
        return walk_tree(prep.target[idx], prep.draft[idx], tokens[idx], parents[idx], num_draft[idx], u)

    for k in range(m):
        a = run(idx, u).accept_probs[:, k]
        cons = ~torch.isnan(a)
        keep, acc, rej = ~cons, cons & (a > 0), cons & (a < 1)
        u_acc, u_rej = u[acc].clone(), u[rej].clone()
        u_acc[:, k] = 0.0
        u_rej[:, k] = a[rej]
        idx = torch.cat([idx[keep], idx[acc], idx[rej]])
        u = torch.cat([u[keep], u_acc, u_rej])
        w = torch.cat([w[keep], w[acc] * a[acc], w[rej] * (1 - a[rej])])
    walk = run(idx, u)
    law: dict[tuple[int, ...], float] = defaultdict(float)
    for s in range(idx.shape[0]):
        prefix = tuple(walk.accepted[s, : walk.accept_len[s]].tolist())
        res = walk.residual[s].tolist()
        for t in range(v):
            if res[t] > 0:
                law[prefix + (t,)] += float(w[s]) * res[t]
    return law


GRAMMAR_VOCAB = ("", "a", "b", "c", "ab")  # token 0: the stop token (EOS)


@functools.cache
def _compiler(vocab: int) -> GrammarCompiler:
    assert vocab == len(GRAMMAR_VOCAB), "grammar cases use GRAMMAR_VOCAB"
    return GrammarCompiler(GRAMMAR_VOCAB, vocab, [0], vocab_type="raw")


def _checked_tree(case: Case, toks: Sequence[int], sampled: bool) -> tuple[list[int], list[int], torch.Tensor | None]:
    """``(kept nodes, their parents renumbered, masks)``: the whole tree without a grammar,
    else what ``GrammarState.check_draft`` keeps of it."""
    m = len(case.parents)
    if case.grammar is None:
        return list(range(m)), list(case.parents), None
    state = case.compiler().new_state(StructuredOutput(regex=case.grammar))
    check = state.check_draft(toks[:m], case.parents, sampled)
    new = {k: j for j, k in enumerate(check.keep)}
    return check.keep, [-1 if case.parents[k] < 0 else new[case.parents[k]] for k in check.keep], check.masks


def max_deviation(case: Case) -> float:
    """max |P(continued output starts with s) - P_target(s)| over every relevant prefix s.

    The emitted sequence is continued by exact target sampling, so losslessness means the
    continued process has the target's law; it is checked on every sequence s whose first
    ``len(s) - 1`` tokens are a prefix of some emitted sequence (all next tokens included).
    """
    law = emitted_law(case)
    target = case.target_law()

    def t_cond(ctx: tuple[int, ...], rest: tuple[int, ...]) -> float:
        p = 1.0
        for i, y in enumerate(rest):
            p *= target(ctx + rest[:i])[y]
        return p

    starts: dict[tuple[int, ...], float] = defaultdict(float)
    for seq, p in law.items():
        for j in range(1, len(seq) + 1):
            starts[seq[:j]] += p

    def continued(s: tuple[int, ...]) -> float:
        return starts.get(s, 0.0) + sum(law.get(s[:i], 0.0) * t_cond(s[:i], s[i:]) for i in range(1, len(s)))

    worst = abs(sum(law.values()) - 1.0)
    for base in [(), *starts]:
        for y in range(case.vocab):
            s = base + (y,)
            worst = max(worst, abs(continued(s) - t_cond((), s)))
    return worst


def random_parents(sizes: Sequence[int]) -> list[int]:
    """A parent array from per-node parent choices: node k's parent is sizes[k] mod (k + 1) - 1."""
    return [(c % (k + 1)) - 1 for k, c in enumerate(sizes)]
