"""CUDA-graph capture and replay against the eager runner (skipped without CUDA)."""

from __future__ import annotations

import random

import pytest

from treeserve.sampling import SamplingParams

from ._helpers import commit, make_bench, step_and_compare, tiny_model

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("page_size", [1, 16])
def test_replay_equals_eager(page_size: int) -> None:
    bench = make_bench(tiny_model(device="cuda"), page_size, max_batch=16, max_requests=40)
    bench.graph.capture()
    assert sorted(bench.graph.graphs) == sorted(bench.graph.keys) and bench.graph.capture_seconds > 0
    rng = random.Random(page_size)
    for n in (1, 3, 8, 13):
        reqs = bench.add_requests(rng, n)  # greedy
        for _ in range(3):
            commit(reqs, step_and_compare(bench, reqs, atol=1e-3))
    assert bench.graph.num_steps == 12


def test_random_numbers_advance_between_replays() -> None:
    bench = make_bench(tiny_model(init_std=0.02, device="cuda"), 1, max_batch=4, max_requests=4)
    bench.graph.capture()
    reqs = bench.add_requests(random.Random(1), 3, [SamplingParams(temperature=1.0, seed=s) for s in (5, 5, 9)])
    steps = []
    for _ in range(6):
        tokens = step_and_compare(bench, reqs, atol=1e-3)  # same tokens as eager at each position
        steps.append(tokens)
        commit(reqs, tokens)
    per_row = list(zip(*steps))
    assert all(len(set(row)) > 1 for row in per_row), "replays must draw fresh random numbers"
    assert per_row[0] != per_row[2], "different seeds must draw different numbers"


@pytest.mark.parametrize("page_size", [1, 16])
def test_verify_replay_equals_eager(page_size: int) -> None:
    """Verify keys captured and replayed: tokens, logprobs and compacted KV equal the eager runner's."""
    from .test_verify_graph import K, greedy_chain, random_draft, step, verify_item
    from .test_verify_graph import commit as commit_verified

    bench = make_bench(tiny_model(device="cuda"), page_size, max_batch=8, max_requests=24, max_draft_nodes=K)
    bench.graph.capture()
    assert sorted(bench.graph.graphs) == sorted(bench.graph.keys)
    rng = random.Random(page_size)
    for n in (1, 3, 7):
        reqs = bench.add_requests(rng, n)  # greedy
        for _ in range(2):
            items = [verify_item(r, random_draft(rng, greedy_chain(bench, r, K), K)) for r in reqs]
            commit_verified(items, step(bench, items, atol=1e-3))
    assert bench.graph.num_verify_steps > 0
