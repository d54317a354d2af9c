"""Scheduler CPU overhead per step with 256 running requests and a null model.

Target (issue 5): <= 20 us per running request per step (schedule + update), measured with a
model that does nothing. Reported, with the cost of the null step itself as the floor.
"""

from __future__ import annotations

import time

import torch

from treeserve.kvcache import KVPool, RadixCache, ReqToTokenTable
from treeserve.sampling import SamplingParams
from treeserve.scheduler import SampledToken, Scheduler, SchedulerConfig, StopChecker

NUM_REQ = 256


def _null_sampled(batch) -> list[SampledToken | None]:
    return [SampledToken(7, 0.0, None) if it.sample else None for it in batch.items]


def _running_scheduler(page_size: int = 1) -> Scheduler:
    kv = KVPool(1, NUM_REQ * 160 // page_size + 1, page_size, 1, 1, torch.float32, "cpu")
    radix = RadixCache(kv.allocator, page_size)
    table = ReqToTokenTable(NUM_REQ, 1024)
    sched = Scheduler(SchedulerConfig(max_batched_tokens=8192, max_running=NUM_REQ, max_model_len=1024),
                      kv.allocator, radix, table, StopChecker([2], None))
    params = SamplingParams(temperature=0.0, max_new_tokens=100_000, ignore_eos=True)
    for i in range(NUM_REQ):
        sched.new_request([3 + i % 50] * 8 + [4 + i], params, seed=i, vocab_size=1000)
    while len(sched.running) < NUM_REQ or any(r.in_prefill for r in sched.running):
        batch = sched.schedule()
        sched.update(batch, _null_sampled(batch))
    return sched


def test_scheduler_overhead_per_request(benchmark) -> None:
    sched = _running_scheduler()

    def step() -> None:
        batch = sched.schedule()
        sched.update(batch, _null_sampled(batch))

    benchmark.pedantic(step, rounds=60, iterations=1, warmup_rounds=3)
    per_req_us = benchmark.stats.stats.median / NUM_REQ * 1e6
    t0 = time.perf_counter()
    for _ in range(60):
        sched.schedule()  # the floor: a schedule() alone
    sched_only_us = (time.perf_counter() - t0) / 60 / NUM_REQ * 1e6
    print(f"\nscheduler step overhead: {per_req_us:.2f} us/request (schedule alone {sched_only_us:.2f}); target <= 20")
    sched.check_invariants()
