"""The static-buffer step path on the embedded SmolLM2-135M (bf16, CPU), against its baselines.

- torch.compile vs eager for one decode step: both run the decode graph runner's static,
  bucket-padded path (on CPU it runs eagerly); only the model forward differs: ``model`` itself
  vs ``treeserve.runner.compile_model(model)`` (inductor). Reports the compile time and the
  per-step ratio; the engine keeps ``compile=False`` by default unless the compiled step is
  faster here.
- A speculative verify step (ragged drafts of 0-4 nodes) through the graph runner's verify key
  (padded to 4 nodes, eager on CPU) vs the eager runner: the price of the fixed shapes where no
  CUDA graph pays it back.

Set ``TREESERVE_BENCH_QUICK=1`` for fewer rounds.
"""

from __future__ import annotations

import os
import random
import time

import pytest
import torch

from treeserve.runner import compile_model
from treeserve.runner import DecodeGraphRunner
from treeserve.kvcache import KVPool, ReqToTokenTable, pages_to_slots
from treeserve.runner import ModelRunner
from treeserve.sampling import SamplingParams
from treeserve.scheduler import DraftTree, Request, ScheduledBatch, ScheduledItem

QUICK = os.environ.get("TREESERVE_BENCH_QUICK") == "1"
THREADS = int(os.environ.get("TREESERVE_BENCH_THREADS", "2"))
BATCH = int(os.environ.get("TREESERVE_BENCH_BATCH", "8"))
PROMPT, MAX_LEN = 128, 256
ROUNDS = 5 if QUICK else 20


@pytest.fixture(scope="module")
def setup():
    """SmolLM2 with ``BATCH`` requests prefilled to ``PROMPT`` tokens, and their decode batch."""
    from treeserve.models import load

    torch.set_num_threads(THREADS)
    model, _ = load("smollm2-135m-instruct", dtype=torch.bfloat16)
    cfg = model.config
    kv = KVPool(cfg.num_layers, BATCH * MAX_LEN + 1, 1, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, "cpu")
    table = ReqToTokenTable(BATCH, MAX_LEN)
    eager = ModelRunner(model, kv, table, cfg.vocab_size, cfg.eos_token_ids)
    rng = random.Random(0)
    reqs = []
    for i in range(BATCH):
        req = Request(i, [rng.randrange(cfg.vocab_size) for _ in range(PROMPT)], SamplingParams(temperature=0.0), 0)
        req.row = table.alloc()
        table.write(req.row, 0, pages_to_slots(kv.allocator.alloc(MAX_LEN), 1))
        eager.run(ScheduledBatch([ScheduledItem(req, 0, PROMPT - 1, False)]))
        reqs.append(req)
    batch = ScheduledBatch([ScheduledItem(r, PROMPT - 1, 1, True) for r in reqs])
    return model, kv, table, batch


def _step_seconds(runner: DecodeGraphRunner | ModelRunner, batch: ScheduledBatch, rounds: int) -> float:
    """Median wall time of one step (the same step, rewritten in place)."""
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        assert runner.run(batch) is not None
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def _compare(benchmark, base, ours, batch: ScheduledBatch, label: str, base_name: str, ours_name: str) -> float:
    """Time ``base`` then ``ours`` (under pytest-benchmark) on ``batch``; print and record the ratio."""
    base_s = _step_seconds(base, batch, ROUNDS)
    ours_s = benchmark.pedantic(_step_seconds, args=(ours, batch, ROUNDS), rounds=1, iterations=1)
    ratio = base_s / ours_s
    print(
        f"\n{label} bf16 {THREADS} threads: {base_name} {base_s * 1e3:.1f} ms, "
        f"{ours_name} {ours_s * 1e3:.1f} ms -> {ratio:.2f}x"
    )
    benchmark.extra_info.update(ratio=ratio, base_ms=base_s * 1e3, ours_ms=ours_s * 1e3)
    return ratio


def test_decode_step_compiled_vs_eager(benchmark, setup) -> None:
    model, kv, table, batch = setup
    cfg = model.config
    eager = DecodeGraphRunner(model, kv, table, cfg.vocab_size, cfg.eos_token_ids, max_batch=BATCH)
    compiled_fwd = compile_model(model)
    compiled = DecodeGraphRunner(compiled_fwd, kv, table, cfg.vocab_size, cfg.eos_token_ids, max_batch=BATCH)
    ref = eager.run(batch)
    got = compiled.run(batch)  # compiles
    for _ in range(2):  # warm-up: any late recompiles happen here
        compiled.run(batch)
    compile_s, compiles = compiled_fwd.compile_seconds, compiled_fwd.num_compiles
    matches = sum(a.token == b.token for a, b in zip(ref, got))
    _compare(benchmark, eager, compiled, batch, f"decode step batch {BATCH}", "eager", "compiled")
    print(f"compile {compile_s:.1f}s ({compiles} graphs); greedy tokens equal {matches}/{BATCH}")
    benchmark.extra_info.update(compile_seconds=compile_s)
    assert compiled_fwd.num_compiles == compiles, "recompiled during timed steps"
    assert matches >= BATCH - 1  # bf16: a near-tie may flip one greedy token


def test_verify_step_static_vs_eager(benchmark, setup) -> None:
    model, kv, table, batch = setup
    cfg = model.config
    rng = random.Random(1)
    items = []
    for it, n in zip(batch.items, [0, 2, 4, 4, 1, 3, 0, 4] * BATCH):
        draft = DraftTree([rng.randrange(cfg.vocab_size) for _ in range(n)], list(range(-1, n - 1))) if n else None
        items.append(ScheduledItem(it.req, it.start, 1 + n, True, draft))
    step = ScheduledBatch(items)
    eager = ModelRunner(model, kv, table, cfg.vocab_size, cfg.eos_token_ids)
    static = DecodeGraphRunner(model, kv, table, cfg.vocab_size, cfg.eos_token_ids, max_batch=BATCH, max_draft_nodes=4)
    ref, got = eager.run(step), static.run(step)  # the step is idempotent: KV rewritten, then compacted
    matches = sum((a.token, a.accepted) == (b.token, b.accepted) for a, b in zip(ref, got))
    label = f"verify step batch {BATCH} (0-4 draft nodes, padded to 4)"
    _compare(benchmark, eager, static, step, label, "eager runner", "static verify key")
    print(f"outputs equal {matches}/{BATCH}")
    # bf16 on random-token prompts: flat logits, so padded vs ragged GEMM rounding flips near-ties
    # (fp32 is bit-identical: tests/runner/test_verify_graph.py checks that path at 2e-5).
    assert matches >= BATCH // 2
