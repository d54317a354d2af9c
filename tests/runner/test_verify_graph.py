"""The graph runner's verify keys (speculative decoding, run eagerly on CPU) against the eager runner.

A verify step carries each request's pending token plus a draft tree, padded to a node bucket;
the graph path must emit the eager runner's tokens and logprobs, leave the KV exactly as the
eager verify + compaction does, and write nothing outside the real slots and the dummy page.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from treeserve.sampling import SamplingParams
from treeserve.scheduler import DraftTree, Request, SampledToken, ScheduledBatch, ScheduledItem

from ._helpers import PADDED_GEMM_ATOL, VOCAB, Bench, make_bench, tiny_model

K = 5  # node buckets 0, 1, 2, 4, 8


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def verify_item(req: Request, draft: DraftTree | None) -> ScheduledItem:
    return ScheduledItem(req, req.seq_len - 1, 1 + (len(draft) if draft else 0), True, draft)


def greedy_chain(bench: Bench, req: Request, k: int) -> list[int]:
    """The next ``k`` greedy tokens of ``req``, found with eager verify steps (nothing committed;
    each step accepts the chain so far and corrects the guess after it)."""
    params, req.params = req.params, SamplingParams(temperature=0.0)
    chain: list[int] = []
    while len(chain) < k:
        guess = DraftTree([*chain, 3], list(range(-1, len(chain))))
        out = bench.eager.run(ScheduledBatch([verify_item(req, guess)]))[0]
        assert list(out.accepted[: len(chain)]) == chain
        chain = [*out.accepted, out.token][: len(chain) + 1]
    req.params = params
    return chain


def random_draft(rng: random.Random, chain: list[int], k: int) -> DraftTree | None:
    """No draft, a (partly) right chain, or a tree whose right path is not in node order."""
    kind = rng.choice(["none", "chain", "wrong_then_right", "tree"])
    n = rng.randint(1, k)
    if kind == "none":
        return None
    if kind == "chain":
        right = rng.randint(0, n)
        tokens = chain[:right] + [rng.randrange(3, VOCAB) for _ in range(n - right)]
        return DraftTree(tokens, list(range(-1, n - 1)))
    if kind == "wrong_then_right" or n < 3:  # a wrong root child first, then the right chain
        m = max(1, min(n - 1, len(chain)))
        return DraftTree([(chain[0] + 1) % VOCAB, *chain[:m]], [-1, -1, *range(1, m)])
    # Tree: two root children (wrong, right), the right one's two children (right, wrong), ...
    return DraftTree(
        [(chain[0] + 7) % VOCAB, chain[0], (chain[1] + 5) % VOCAB, chain[1]][:n] + [chain[2]] * (n > 4),
        [-1, -1, 1, 1, 3][: min(n, 5)],
    )


def kv_snapshot(bench: Bench) -> list[torch.Tensor]:
    return [c.clone() for c in bench.kv.k_caches + bench.kv.v_caches]


def real_slots(bench: Bench, items: list[ScheduledItem]) -> set[int]:
    out = set()
    for it in items:
        out.update(bench.table.table[it.req.row, it.start : it.start + it.num_scheduled_tokens].tolist())
    return out


def step(bench: Bench, items: list[ScheduledItem], atol: float = PADDED_GEMM_ATOL) -> list[SampledToken]:
    """One verify step through the graph runner, then the eager runner, compared."""
    batch = ScheduledBatch(items)
    before = kv_snapshot(bench)
    got = bench.graph.run(batch)
    assert got is not None, "a decode/verify batch of eligible requests must be served"
    allowed = real_slots(bench, items) | set(range(bench.kv.page_size))
    after_graph = kv_snapshot(bench)
    for old, new in zip(before, after_graph):
        changed = (old != new).flatten(2).any(-1).flatten().nonzero().flatten().tolist()
        assert set(changed) <= allowed, "padding wrote outside the real slots and the dummy page"
    ref = bench.eager.run(batch)
    for g, e in zip(after_graph, kv_snapshot(bench)):  # same KV after verify + compaction
        torch.testing.assert_close(g[1:], e[1:], atol=atol, rtol=1e-5)  # page 0: the dummy page
    for g, r, item in zip(got, ref, items):
        assert (g.token, g.accepted) == (r.token, r.accepted)
        if item.req.params.logprobs is None:
            continue  # a row that asked for no logprobs: eager sampling and verification skip them
        lp = torch.tensor([*g.accepted_logprobs, g.logprob])
        torch.testing.assert_close(lp, torch.tensor([*r.accepted_logprobs, r.logprob]), atol=5 * atol + 1e-4, rtol=1e-4)
        assert len(g.accepted_logprobs) == len(g.accepted) and not lp.isnan().any()
    return got


def commit(items: list[ScheduledItem], tokens: list[SampledToken]) -> None:
    for it, t in zip(items, tokens):
        it.req.output_ids.extend([*t.accepted, t.token])


def mixed(rng: random.Random, n: int) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0)
        if rng.random() < 0.5
        else SamplingParams(temperature=rng.choice([0.7, 1.0]), top_p=rng.choice([1.0, 0.9]), top_k=rng.choice([-1, 20]),
                            logprobs=rng.choice([None, 0]))
        for _ in range(n)
    ]


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_verify_steps_equal_eager(model, page_size: int) -> None:
    bench = make_bench(model, page_size, max_batch=8, max_requests=20, max_draft_nodes=K)
    assert bench.graph.node_buckets == (0, 1, 2, 4, 8)
    rng = random.Random(page_size)
    accepted = 0
    for n in (1, 3, 6):
        reqs = bench.add_requests(rng, n, mixed(rng, n))
        for _ in range(2):
            items = []
            for r in reqs:
                draft = random_draft(rng, greedy_chain(bench, r, K), K)
                if r.params.logprobs is not None:
                    draft = None  # the scheduler never drafts for logprob requests
                items.append(verify_item(r, draft))
            out = step(bench, items)
            accepted += sum(len(t.accepted) for t in out)
            commit(items, out)
    assert accepted > 0, "the drafts must get some tokens accepted"
    assert bench.graph.num_steps == 6


@settings(max_examples=6, deadline=None)
@given(n=st.integers(1, 4), page_size=st.sampled_from([1, 2, 8]), seed=st.integers(0, 2**16))
def test_random_verify_batches_equal_eager(model, n: int, page_size: int, seed: int) -> None:
    bench = make_bench(model, page_size, max_batch=4, max_requests=4, max_draft_nodes=K)
    rng = random.Random(seed)
    reqs = bench.add_requests(rng, n, mixed(rng, n))
    items = [verify_item(r, random_draft(rng, greedy_chain(bench, r, K), K) if r.params.logprobs is None else None)
             for r in reqs]
    commit(items, step(bench, items))


def test_ineligible_verify_batches_are_refused(model) -> None:
    bench = make_bench(model, page_size=2, max_batch=4, max_requests=6, max_draft_nodes=2)
    rng = random.Random(5)
    plain, top = bench.add_requests(rng, 2, [SamplingParams(temperature=0.0), SamplingParams(logprobs=2)])
    chain = DraftTree([5, 6], [-1, 0])
    refused = [
        [verify_item(plain, DraftTree([5, 6, 7], [-1, 0, 1]))],  # more nodes than max_draft_nodes
        [verify_item(plain, DraftTree([5], [-1], torch.full((1, VOCAB), 1.0 / VOCAB)))],  # draft probabilities
        [verify_item(plain, chain), verify_item(top, None)],  # top logprobs in a verify step
        [ScheduledItem(plain, plain.seq_len - 1, 2, True, chain)],  # num_scheduled_tokens != 1 + nodes
    ]
    before = kv_snapshot(bench)
    for items in refused:
        assert bench.graph.run(ScheduledBatch(items)) is None
    assert all(torch.equal(a, b) for a, b in zip(before, kv_snapshot(bench)))
    decode_only = make_bench(model, page_size=2, max_batch=4, max_requests=2)  # max_draft_nodes = 0
    (r,) = decode_only.add_requests(rng, 1)
    assert decode_only.graph.run(ScheduledBatch([verify_item(r, chain)])) is None
