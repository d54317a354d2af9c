"""The decode graph runner's static-buffer path (run eagerly on CPU) against the eager runner."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from treeserve.runner import DecodeGraphRunner, decode_buckets
from treeserve.sampling import SamplingParams
from treeserve.scheduler import ScheduledBatch, ScheduledItem

from ._helpers import PADDED_GEMM_ATOL, commit, decode_batch, make_bench, step_and_compare, tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def mixed_params(rng: random.Random, n: int) -> list[SamplingParams]:
    """Greedy and seeded sampling with every filter the graph path serves."""
    out = []
    for _ in range(n):
        out.append(
            SamplingParams(
                temperature=rng.choice([0.0, 0.7, 1.0, 1.5]),
                top_k=rng.choice([-1, 1, 5, 300]),
                top_p=rng.choice([1.0, 0.9, 0.5]),
                min_p=rng.choice([0.0, 0.05]),
                min_new_tokens=rng.choice([0, 2]),
                stop_token_ids=tuple(rng.sample(range(3, 256), rng.randint(0, 2))),
                logprobs=rng.choice([None, 0, 3, 20]),
            )
        )
    return out


def test_buckets_small_then_multiples_of_8() -> None:
    assert decode_buckets(256) == (1, 2, 4, *range(8, 257, 8))
    assert decode_buckets(1) == (1,)
    assert decode_buckets(3) == (1, 2, 4)
    assert decode_buckets(8) == (1, 2, 4, 8)
    assert decode_buckets(10) == (1, 2, 4, 8, 16)


@given(max_batch=st.integers(1, 300), data=st.data())
def test_bucket_for_is_the_smallest_holding_bucket(max_batch: int, data: st.DataObject) -> None:
    buckets = decode_buckets(max_batch)
    assert list(buckets) == sorted(set(buckets)) and buckets[-1] >= max_batch
    assert all(b in (1, 2, 4) or b % 8 == 0 for b in buckets)
    assert len(buckets) == 1 or buckets[-2] < max_batch  # no bucket beyond what max_batch needs
    n = data.draw(st.integers(1, max_batch))
    smallest = min(b for b in buckets if b >= n)
    assert next(b for b in buckets if b >= n) == smallest


@pytest.mark.parametrize("bad", [0, -3, True, 2.0, "8"])
def test_bad_max_batch(bad) -> None:
    with pytest.raises(ValueError, match="max_batch"):
        decode_buckets(bad)


@pytest.mark.parametrize("page_size", [1, 16])  # 2 and 8: the hypothesis test below
def test_padded_to_every_bucket_equals_eager(model, page_size: int) -> None:
    bench = make_bench(model, page_size, max_batch=16, max_requests=70)
    rng = random.Random(page_size)
    for n in (1, 2, 3, 4, 5, 8, 9, 13, 16):  # every bucket, full and partly padding
        reqs = bench.add_requests(rng, n, mixed_params(rng, n))
        for _ in range(2):  # positions advance, KV grows across page boundaries
            commit(reqs, step_and_compare(bench, reqs))
    assert bench.graph.num_steps == 18


@settings(max_examples=8)
@given(n=st.integers(1, 8), page_size=st.sampled_from([1, 2, 8]), seed=st.integers(0, 2**16))
def test_random_decode_batches_equal_eager(model, n: int, page_size: int, seed: int) -> None:
    bench = make_bench(model, page_size, max_batch=8, max_requests=8)
    rng = random.Random(seed)
    reqs = bench.add_requests(rng, n, mixed_params(rng, n))
    commit(reqs, step_and_compare(bench, reqs))
    commit(reqs, step_and_compare(bench, reqs))


def test_padding_writes_only_the_dummy_page(model) -> None:
    bench = make_bench(model, page_size=4, max_batch=8, max_requests=8)
    rng = random.Random(7)
    reqs = bench.add_requests(rng, 5)  # bucket 8: three padding rows
    caches = bench.kv.k_caches + bench.kv.v_caches
    for c in caches:
        c[0].fill_(1e4)  # garbage in the dummy page must not reach real rows either
    before = [c.clone() for c in caches]
    batch = decode_batch(reqs)
    bench.graph.run(batch)
    graph_logits = bench.graph_rec.last[:5].clone()
    real_slots = {int(bench.table.table[r.row, r.seq_len - 1]) for r in reqs}
    ps = bench.kv.page_size
    for old, new in zip(before, caches):
        changed = (old != new).flatten(2).any(-1).flatten().nonzero().flatten().tolist()
        assert real_slots <= set(changed), "every real token's K/V must be written"
        assert set(changed) <= real_slots | set(range(ps)), "padding wrote outside the dummy page"
    bench.eager.run(batch)  # the eager runner never touches the dummy page
    torch.testing.assert_close(graph_logits, bench.eager_rec.last, atol=PADDED_GEMM_ATOL, rtol=1e-5)


def test_ineligible_batches_are_refused_untouched(model) -> None:
    bench = make_bench(model, page_size=1, max_batch=4, max_requests=12)
    rng = random.Random(3)
    plain = bench.add_requests(rng, 5)
    special = bench.add_requests(
        rng,
        4,
        [
            SamplingParams(repetition_penalty=1.2),
            SamplingParams(logit_bias={5: 1.0}),
            SamplingParams(allowed_token_ids=(5, 6, 7)),
            SamplingParams(stop_token_ids=tuple(range(10, 20))),  # more stop ids than the buffers hold
        ],
    )
    r = plain[0]
    refused = [
        decode_batch(plain),  # 5 > max_batch
        ScheduledBatch([ScheduledItem(r, r.seq_len - 2, 2, True)]),  # not one token
        ScheduledBatch([ScheduledItem(r, r.seq_len - 1, 1, False)]),  # not sampled
        ScheduledBatch([]),
        *(decode_batch([plain[1], s]) for s in special),
    ]
    before = [c.clone() for c in bench.kv.k_caches]
    for batch in refused:
        assert bench.graph.run(batch) is None
    assert all(torch.equal(a, b) for a, b in zip(before, bench.kv.k_caches))
    assert bench.graph.num_steps == 0
    few = make_bench(model, page_size=1, max_batch=4, max_requests=2)
    few.graph = DecodeGraphRunner(model, few.kv, few.table, 256, [2], max_batch=4, max_logprobs=2)
    (wants_5,) = few.add_requests(rng, 1, [SamplingParams(logprobs=5)])
    assert few.graph.run(decode_batch([wants_5])) is None


def test_bad_arguments(model) -> None:
    bench = make_bench(model, page_size=1, max_batch=4, max_requests=2)
    kv, table = bench.kv, bench.table
    with pytest.raises(ValueError, match="use_cuda_graph"):
        DecodeGraphRunner(model, kv, table, 256, use_cuda_graph=True)
    with pytest.raises(ValueError, match="max_logprobs"):
        DecodeGraphRunner(model, kv, table, 256, max_logprobs=21)
    with pytest.raises(ValueError, match="max_stop_token_ids"):
        DecodeGraphRunner(model, kv, table, 256, max_stop_token_ids=-1)
    with pytest.raises(ValueError, match="max_batch"):
        DecodeGraphRunner(model, kv, table, 256, max_batch=0)
    with pytest.raises(ValueError, match="max_draft_nodes"):
        DecodeGraphRunner(model, kv, table, 256, max_draft_nodes=-1)
    with pytest.raises(ValueError, match="must agree"):
        DecodeGraphRunner(model, kv, table, 256, device="meta")
    for n in (0, 5):
        with pytest.raises(ValueError, match="batch_size"):
            bench.graph.bucket_for(n)
    bench.graph.capture()  # eager mode: nothing to capture
    assert bench.graph.graphs == {} and bench.graph.capture_seconds == 0.0
