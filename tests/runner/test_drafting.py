"""Drafting through the runner: ``fill_drafts``, the draft model's batched proposals, and the
draft KV pool size."""

from __future__ import annotations

import random

import pytest
import torch

from treeserve.kvcache import KVPool
from treeserve.runner import DraftModelDrafter, DraftRequest, NgramDrafter, draft_pool_tokens, fill_drafts
from treeserve.sampling import SamplingParams
from treeserve.scheduler import DraftTree, Request, ScheduledBatch, ScheduledItem

from ._helpers import VOCAB, tiny_model


def _req(rid: int, prompt: list[int]) -> Request:
    return Request(rid, prompt, SamplingParams(temperature=0.0), seed=0)


class FixedDrafter:
    """Proposes ``tokens[:max_tokens]`` of a fixed chain (or the given drafts), records calls."""

    def __init__(self, chain: list[int], extra: int = 0) -> None:
        self.chain, self.extra, self.calls = chain, extra, []

    def propose_batch(self, requests):
        self.calls.append(list(requests))
        out = []
        for r in requests:
            n = min(len(self.chain), r.max_tokens + self.extra)
            out.append(DraftTree(self.chain[:n], list(range(-1, n - 1))) if n else None)
        return out

    def release(self, key: int) -> None:
        pass


def test_fill_drafts_asks_only_items_with_a_budget() -> None:
    a, b, c = _req(0, [5, 6, 7]), _req(1, [8, 9]), _req(2, [1, 2, 3, 4])
    batch = ScheduledBatch(
        [
            ScheduledItem(a, 2, 1, True, None, 3),  # decoding, asks for <= 3 nodes
            ScheduledItem(b, 0, 2, True),  # prefill: never drafted
            ScheduledItem(c, 3, 1, True, None, 1),
        ]
    )
    drafter = FixedDrafter([11, 12, 13, 14])
    out = fill_drafts(batch, drafter)
    (asked,) = drafter.calls
    assert [(r.key, list(r.tokens), r.max_tokens) for r in asked] == [(0, [5, 6, 7], 3), (2, [1, 2, 3, 4], 1)]
    assert out.items[0].draft.tokens == [11, 12, 13] and out.items[0].num_scheduled_tokens == 4
    assert out.items[1] == batch.items[1]
    assert out.items[2].draft.tokens == [11] and out.items[2].num_scheduled_tokens == 2
    assert batch.items[0].draft is None, "the scheduler's batch is not modified"


def test_fill_drafts_without_asks_returns_the_batch_and_never_calls() -> None:
    batch = ScheduledBatch([ScheduledItem(_req(0, [1, 2]), 1, 1, True)])
    drafter = FixedDrafter([3])
    assert fill_drafts(batch, drafter) is batch and drafter.calls == []


def test_fill_drafts_rejects_a_draft_over_budget() -> None:
    batch = ScheduledBatch([ScheduledItem(_req(0, [1, 2]), 1, 1, True, None, 2)])
    with pytest.raises(ValueError, match="exceeds its budget of 2"):
        fill_drafts(batch, FixedDrafter([3, 4, 5], extra=1))


def test_ngram_batch_equals_one_by_one() -> None:
    rng = random.Random(3)
    d = NgramDrafter(max_n=3, min_n=1, width=2)
    reqs = [DraftRequest(i, [rng.randrange(5) for _ in range(rng.randint(2, 30))], rng.randint(1, 6)) for i in range(20)]
    assert d.propose_batch(reqs) == [d.propose(r.key, r.tokens, r.max_tokens) for r in reqs]


@pytest.mark.parametrize("width", [1, 3])
def test_draft_model_batch_equals_one_by_one(width: int) -> None:
    """One batched forward per depth proposes what each request alone would, across steps."""
    torch.manual_seed(0)
    model = tiny_model()
    cfg = model.config
    rng = random.Random(width)

    def drafter() -> DraftModelDrafter:
        kv = KVPool(cfg.num_layers, 2000, 1, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
        return DraftModelDrafter(model, kv, 8, 128, width=width)

    batched, alone = drafter(), drafter()
    seqs = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 30))] for _ in range(6)]
    for _ in range(3):  # later calls catch up on the tokens committed since
        reqs = [DraftRequest(i, list(s), rng.randint(1, 5)) for i, s in enumerate(seqs)]
        got = batched.propose_batch(reqs)
        want = [alone.propose(r.key, r.tokens, r.max_tokens) for r in reqs]
        for g, w, r in zip(got, want, reqs):
            assert g.tokens == w.tokens and g.parents == w.parents
            assert len(g) == r.max_tokens
        for s, g in zip(seqs, got):
            s.extend(g.tokens[: rng.randint(0, len(g))] + [rng.randrange(3, VOCAB)])
    for i in range(len(seqs)):
        batched.release(i)
    assert batched.kv.allocator.num_free == batched.kv.allocator.capacity
    assert batched.table.num_free == batched.table.max_requests


@pytest.mark.parametrize("width", [1, 3])
def test_sampled_drafts_carry_their_laws(width: int) -> None:
    """A sampling request's draft nodes come with the law each was drawn from (rows summing to 1,
    the token inside its support, siblings distinct) and the same seed drafts the same tree
    alone or batched; a greedy request keeps its point-mass draft (no laws)."""
    model = tiny_model()
    cfg = model.config

    def drafter() -> DraftModelDrafter:
        kv = KVPool(cfg.num_layers, 2000, 1, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
        return DraftModelDrafter(model, kv, 8, 128, width=width)

    hot = SamplingParams(temperature=0.8, top_p=0.95)
    reqs = [DraftRequest(i, [3 + i, 5, 7, 4 + i], 5, hot if i % 2 else SamplingParams(temperature=0.0), 40 + i, 2)
            for i in range(4)]
    got = drafter().propose_batch(reqs)
    for r, d in zip(reqs, got):
        if r.params.greedy:
            assert d.probs is None
            continue
        assert d.probs.shape == (len(d), cfg.vocab_size)
        torch.testing.assert_close(d.probs.sum(1), torch.ones(len(d)))
        assert all(d.probs[k, t] > 0 for k, t in enumerate(d.tokens))
        roots = [t for t, p in zip(d.tokens, d.parents) if p == -1]
        assert len(roots) == width and len(set(roots)) == width
    alone = [drafter().propose_batch([r])[0] for r in reqs]
    assert [d.tokens for d in alone] == [d.tokens for d in got]
    assert [d.parents for d in alone] == [d.parents for d in got]


def test_draft_model_without_slots_proposes_nothing() -> None:
    model = tiny_model()
    cfg = model.config
    kv = KVPool(cfg.num_layers, 12, 1, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")  # 11 usable slots
    d = DraftModelDrafter(model, kv, 4, 64)
    got = d.propose_batch([DraftRequest(0, [5, 6, 7, 8], 4), DraftRequest(1, [9, 10, 11], 3)])
    assert got[0] is not None and len(got[0]) == 4
    assert got[1] is None  # 8 slots taken, 6 more needed, 3 left


def test_draft_pool_tokens() -> None:
    # Short contexts: running requests x (context + draft nodes), far below the target's pool.
    assert draft_pool_tokens(4, 100, 5, 32768) == 4 * 105
    # Long contexts: bounded by what the target's pool can hold, plus the draft nodes.
    assert draft_pool_tokens(64, 4096, 4, 32768) == 32768 + 64 * 4
    with pytest.raises(ValueError, match="max_running must be an int >= 1"):
        draft_pool_tokens(0, 100, 5, 100)
    with pytest.raises(ValueError, match="num_speculative_tokens must be an int >= 0"):
        draft_pool_tokens(1, 100, -1, 100)


def _constrained(rid: int, regex: str) -> Request:
    """A request under ``regex`` over a vocabulary whose tokens 1..4 are "a", "b", "c", "d"."""
    from treeserve.sampling import GrammarCompiler, StructuredOutput

    names = ["<eos>", "a", "b", "c", "d"] + [f"<{i}>" for i in range(VOCAB - 5)]
    spec = StructuredOutput(regex=regex)
    req = Request(rid, [7, 8], SamplingParams(temperature=0.0, structured=spec), seed=0)
    req.grammar = GrammarCompiler(names, VOCAB, [0], vocab_type="raw").new_state(spec)
    return req


class StatefulDrafter(FixedDrafter):
    """Like ``FixedDrafter`` but keeps per-request state: never asked past uncommitted tokens."""


class StatelessDrafter(FixedDrafter):
    stateless = True


def test_grammar_drafts_are_forced_tokens_then_the_drafter_cut_by_the_grammar() -> None:
    """Under "abc(a|d)+": jump-forward proposes the forced "abc"; a stateless drafter continues
    after it (asked with them in its context) and its refused token is cut with what follows;
    the draft carries the masks of the root and of every kept node."""
    req = _constrained(0, "abc(a|d)+")
    batch = ScheduledBatch([ScheduledItem(req, 1, 1, True, None, 6)])
    drafter = StatelessDrafter([4, 2, 1])  # "d" ok, then "b" refused, "a" under it
    out = fill_drafts(batch, drafter, jump_forward_tokens=8)
    (asked,) = drafter.calls
    assert list(asked[0].tokens) == [7, 8, 1, 2, 3] and asked[0].max_tokens == 3
    draft = out.items[0].draft
    assert draft.tokens == [1, 2, 3, 4] and draft.parents == [-1, 0, 1, 2] and draft.num_forced == 3
    assert out.items[0].num_scheduled_tokens == 5
    assert draft.bitmask.shape[0] == 5
    check = req.grammar.check_draft([1, 2, 3, 4], [-1, 0, 1, 2], sampled=False)
    assert torch.equal(draft.bitmask, check.masks)


def test_a_stateful_drafter_drafts_only_when_nothing_is_forced() -> None:
    forced, free = _constrained(0, "abc(a|d)+"), _constrained(1, "(a|d)+")
    batch = ScheduledBatch([ScheduledItem(forced, 1, 1, True, None, 4), ScheduledItem(free, 1, 1, True, None, 4)])
    drafter = StatefulDrafter([1, 4, 2])
    out = fill_drafts(batch, drafter, jump_forward_tokens=8)
    (asked,) = drafter.calls
    assert [r.key for r in asked] == [1]
    assert out.items[0].draft.tokens == [1, 2, 3] and out.items[0].draft.num_forced == 3
    assert out.items[1].draft.tokens == [1, 4] and out.items[1].draft.num_forced == 0  # "b" cut
    off = fill_drafts(batch, None, jump_forward_tokens=0)
    assert [it.draft for it in off.items] == [None, None]  # nothing forced, no drafter: plain decodes
