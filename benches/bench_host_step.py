"""Host cost of one engine step, and a real decode step against its GEMMs alone (issue 11).

1. Null model: ``schedule -> runner.run (step inputs, a forward that only allocates the logits,
   sampling, the host read) -> update`` over running decode requests at batch 1, 64 and 256,
   greedy, vocab 256 (so sampling arithmetic is negligible): microseconds per step and per
   request. Target: <= 5 us per request at batch 256. ``--static``: the same through the
   static decode path (``DecodeGraphRunner`` run eagerly: what a CUDA-graph step does on the
   host, its input staging included, the replay aside).
2. SmolLM2-135M decode step through the engine's runner (bf16 and float32) at batch 1 and 64,
   against the time of the same step's GEMMs alone (every projection and the LM head as
   ``F.linear`` on ``[B, hidden]``). Target: batch 1 within 1.3x of its GEMMs.

Run: ``flock /tmp/treeserve-bench.lock python benches/bench_host_step.py [--quick]``. It uses only
names that exist before and after the issue-11 refactor, so the same file measures both trees.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from treeserve.kvcache import KVPool, RadixCache, ReqToTokenTable
from treeserve.runner import DecodeGraphRunner, ModelRunner
from treeserve.sampling import SamplingParams
from treeserve.scheduler import Scheduler, SchedulerConfig, StopChecker

VOCAB = 256


class NullModel:
    """The model forward contract, computing nothing: zero logits with a favourite token."""

    def __call__(self, input_ids, positions, kv, out_slots, meta, logits_indices) -> torch.Tensor:
        out = torch.zeros(logits_indices.numel(), VOCAB)
        out[:, 7] = 1.0
        return out


def engine_parts(model, batch: int, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, vocab: int,
                 static: bool = False):
    max_len = 256
    kv = KVPool(num_layers, batch * max_len + 1, 1, kv_heads, head_dim, dtype, "cpu")
    table = ReqToTokenTable(batch, max_len)
    sched = Scheduler(
        SchedulerConfig(max_batched_tokens=max(512, batch * 16), max_running=batch, max_model_len=max_len),
        kv.allocator,
        RadixCache(kv.allocator, 1),
        table,
        StopChecker([2], None),
    )
    graph = DecodeGraphRunner(model, kv, table, vocab, [2], "cpu", max_batch=batch, use_cuda_graph=False) if static else None
    runner = ModelRunner(model, kv, table, vocab, [2], "cpu", graph)
    params = SamplingParams(temperature=0.0, max_new_tokens=100_000, ignore_eos=True)
    for i in range(batch):
        sched.new_request([3 + i % 50] * 8 + [4 + i % 200], params, seed=i, vocab_size=vocab)
    return sched, runner


def step(sched, runner) -> None:
    batch = sched.schedule()
    sched.update(batch, runner.run(batch))


def warm(sched, runner) -> None:
    while len(sched.running) < sched.config.max_running or any(r.in_prefill for r in sched.running):
        step(sched, runner)
    for _ in range(3):
        step(sched, runner)


def median_step_seconds(sched, runner, steps: int) -> float:
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step(sched, runner)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def host_cost(batches: tuple[int, ...], steps: int, static: bool) -> None:
    path = "static decode path" if static else "eager runner"
    print(f"null model, greedy, vocab 256, {path}: schedule + inputs + sample + update")
    for b in batches:
        sched, runner = engine_parts(NullModel(), b, 1, 1, 8, torch.float32, VOCAB, static)
        warm(sched, runner)
        s = median_step_seconds(sched, runner, steps)
        print(f"  batch {b:4d}: {s * 1e6:9.1f} us/step  {s * 1e6 / b:7.2f} us/request")


def gemm_seconds(model, b: int, reps: int) -> float:
    """Median time of one step's GEMMs alone: every linear layer on ``[b, in_features]``."""
    # Every projection (the model's own Linear modules hold a 2-D ``weight``) and the LM head.
    layers = [m for m in model.modules() if type(m).__name__ == "Linear" or isinstance(m, torch.nn.Linear)]
    xs = [torch.randn(b, m.weight.shape[1], dtype=m.weight.dtype) for m in layers]
    times = []
    with torch.inference_mode():
        for _ in range(reps):
            t0 = time.perf_counter()
            for m, x in zip(layers, xs):
                F.linear(x, m.weight)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def real_step(dtypes: tuple[str, ...], batches: tuple[int, ...], steps: int) -> None:
    """SmolLM2 decode steps through the eager runner vs their GEMMs, same process, same threads."""
    from treeserve.models import load

    for name in dtypes:
        dtype = getattr(torch, name)
        model, _ = load("smollm2-135m-instruct", dtype=dtype)
        cfg = model.config
        for b in batches:
            sched, runner = engine_parts(model, b, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype, cfg.vocab_size)
            warm(sched, runner)
            total = median_step_seconds(sched, runner, steps)
            gemm = gemm_seconds(model, b, steps)
            print(f"  SmolLM2 {name:8s} batch {b:3d}: step {total * 1e3:7.2f} ms, GEMMs {gemm * 1e3:7.2f} ms, "
                  f"ratio {total / gemm:5.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--skip-model", action="store_true")
    ap.add_argument("--skip-host", action="store_true")
    ap.add_argument("--static", action="store_true", help="the host part through the static decode path")
    args = ap.parse_args()
    threads = int(os.environ.get("OMP_NUM_THREADS", "1"))
    torch.set_num_threads(threads)
    with open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), platform.processor())
    print(f"CPU: {cpu}; threads {threads}; load {os.getloadavg()}; torch {torch.__version__}")
    steps = 20 if args.quick else 60
    if not args.skip_host:
        host_cost((1, 64, 256), steps, args.static)
    if not args.skip_model:
        real_step(("bfloat16", "float32"), (1, 64), 5 if args.quick else 15)
    print(f"load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
