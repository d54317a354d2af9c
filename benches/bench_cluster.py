"""Issue 30: 2 engine replicas on Ray Serve, prefix-cache-aware routing vs Ray Serve's default
power-of-two router, vs one replica alone; same load client, same run.

    flock /work/bench.lock python benches/bench_cluster.py [--quick] [--sweep]

Workload (``bench_serve``'s shared-prefix dataset): 8 shared system prompts of ``--prefix-words`` (500)
random words (1-2k tokens) x ``--users`` users each, a distinct question per request, streamed
completions of ``--output-len`` tokens (EOS banned), ``--concurrency`` clients in flight. Each
configuration is a fresh ``treeserve serve --replicas N`` on 127.0.0.1 (its own local Ray cluster):

- ``prefix``:       2 replicas x 1 thread, PrefixAffinityRouter (default thresholds)
- ``power-of-two``: 2 replicas x 1 thread, Ray Serve's default router
- ``single``:       1 replica x 2 threads (the hit-rate reference, and the threads comparison)
- ``--sweep`` adds ``prefix`` with ``--balance-abs`` 0, 16 and 32 (the load-skew threshold).

Reported per run (one JSON line each): prefix hit rate (the servers' ``vllm:prefix_cache_hits /
queries``), output tok/s, requests/s, TTFT mean / p99; then the ratios behind the targets (hit
rate >= 90% of ``single``'s, throughput >= 1.3x ``power-of-two``'s). ``--only a,b`` runs a subset.
Not a pytest benchmark (it starts servers).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from treeserve.server.bench_client import BenchConfig, run_bench

BAN_EOS = {"0": -100.0, "2": -100.0}  # SmolLM2: <|endoftext|>, <|im_end|>
ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _counter(base: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", httpx.get(base + "/metrics", timeout=10).text, re.M)
    if m is None:
        raise RuntimeError(f"{name} missing from /metrics")
    return float(m.group(1))


def _serve(args: argparse.Namespace, replicas: int, threads: int, extra: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "treeserve", "serve", "--model", args.model, "--replicas", str(replicas),
           "--threads", str(threads), "--port", str(port), "--max-running", "64", *extra]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_USAGE_STATS_ENABLED": "0"}
    proc = subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: see {log}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"server did not start: see {log}")


def _stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, 2)  # Ctrl-C: the server takes its Ray cluster down
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()


def _run(args: argparse.Namespace, name: str, replicas: int, threads: int, extra: list[str]) -> dict:
    proc, base = _serve(args, replicas, threads, extra, Path(args.log_dir) / f"cluster-{name}.log")
    try:
        warm = BenchConfig(base_url=base + "/v1", endpoint="completions", num_requests=2, concurrency=2,
                           input_len=8, output_len=4, logit_bias=BAN_EOS)  # fmt: skip
        asyncio.run(run_bench(warm))  # first forward of each replica, outside the measurement
        q0, h0, p0 = (_counter(base, f"vllm:{n}") for n in ("prefix_cache_queries_total", "prefix_cache_hits_total",
                                                           "prompt_tokens_total"))  # fmt: skip
        cfg = BenchConfig(base_url=base + "/v1", endpoint="completions", num_requests=8 * args.users,
                          concurrency=args.concurrency, dataset="shared-prefix", prefix_len=args.prefix_words,
                          num_prefixes=8, input_len=16, output_len=args.output_len, logit_bias=BAN_EOS,
                          timeout=3600)  # fmt: skip
        rep = asyncio.run(run_bench(cfg))
        q1, h1, p1 = (_counter(base, f"vllm:{n}") for n in ("prefix_cache_queries_total", "prefix_cache_hits_total",
                                                           "prompt_tokens_total"))  # fmt: skip
    finally:
        _stop(proc)
    routed = re.search(r"treeserve: routed (.*)", (Path(args.log_dir) / f"cluster-{name}.log").read_text())
    row = {"name": name, "replicas": replicas, "threads": threads, "args": extra, "errors": rep.errors,
           "hit_rate": (h1 - h0) / max(q1 - q0, 1), "mean_prompt_tokens": (p1 - p0) / max(rep.completed, 1),
           "output_tok_s": rep.output_tok_s, "requests_s": rep.completed / rep.duration, "seconds": rep.duration,
           "ttft_mean_s": rep.ttft["mean"], "ttft_p99_s": rep.ttft["p99"], "e2e_p99_s": rep.e2e["p99"],
           "routed": routed.group(1) if routed else None}  # fmt: skip
    print(json.dumps(row), flush=True)
    return row


def simulate(balance_abs: int, cache_threshold: float, *, users: int = 4, concurrency: int = 16,
             prefix_tokens: int = 1500, question_tokens: int = 20, prefill_s: float = 1.0 / 150,
             decode_s: float = 0.2, output_len: int = 16, noise: float = 0.5, seed: int = 0) -> dict:  # fmt: skip
    """The router's decisions on this workload without servers or timing: 2 replicas, each a FIFO
    server whose request takes ``prefill_s`` per uncached prompt token plus ``decode_s`` per output
    token, times a seeded log-normal factor of sigma ``noise`` (a model of a loaded 1-thread
    replica: without noise the loads never drift apart), ``concurrency`` closed-loop clients. A
    replica's cache holds every prompt prefix it computed (unbounded). Returns the hit rate and
    makespan (model seconds)."""
    import heapq
    import random

    from treeserve.cluster import PrefixIndex, RoutingThresholds, choose_replica

    t = RoutingThresholds(cache_threshold=cache_threshold, balance_abs=balance_abs)
    index = PrefixIndex(t.block_tokens, 1 << 22)
    prompts = [[10_000 + i % 8] * prefix_tokens + [i] * question_tokens for i in range(8 * users)]
    cached: dict[int, set[int]] = {0: set(), 1: set()}
    free_at, inflight = {0: 0.0, 1: 0.0}, {0: 0, 1: 0}
    events: list[tuple[float, int, int]] = []  # (finish time, replica, client)
    hits = total = 0
    now, nxt = 0.0, 0
    rng = random.Random(seed)
    for client in range(min(concurrency, len(prompts))):
        heapq.heappush(events, (0.0, -1, client))
    while events:
        now, replica, _ = heapq.heappop(events)
        if replica >= 0:
            inflight[replica] -= 1
        if nxt == len(prompts):
            continue
        ids = prompts[nxt]
        nxt += 1
        r = choose_replica(ids, inflight, index, t).replica
        index.insert(ids, r)
        hit = prefix_tokens if ids[0] in cached[r] else 0
        cached[r].add(ids[0])
        hits, total = hits + hit, total + len(ids)
        start = max(now, free_at[r])
        free_at[r] = start + ((len(ids) - hit) * prefill_s + output_len * decode_s) * rng.lognormvariate(0.0, noise)
        inflight[r] += 1
        heapq.heappush(events, (free_at[r], r, 0))
    return {"balance_abs": balance_abs, "cache_threshold": cache_threshold, "hit_rate": hits / total,
            "makespan_s": now}  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="4 users per prompt, 16 output tokens")
    p.add_argument("--sweep", action="store_true", help="also the prefix router at --balance-abs 0, 16 and 32")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--users", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--prefix-words", type=int, default=500, help="~1.5k SmolLM2 tokens")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--log-dir", default="/tmp")
    p.add_argument("--only", default=None, help="comma-separated configurations (default: the three above)")
    p.add_argument("--simulate", action="store_true", help="only the router's decisions on a model of the load")
    args = p.parse_args()
    if args.simulate:  # mean over 20 seeds per threshold pair
        for ct in (0.1, 0.5, 0.9):
            for b in (0, 2, 4, 8, 16):
                rows = [simulate(b, ct, seed=k) for k in range(20)]
                print(json.dumps({"balance_abs": b, "cache_threshold": ct,
                                  **{f: sum(r[f] for r in rows) / len(rows) for f in ("hit_rate", "makespan_s")}}))  # fmt: skip
        return 0
    if args.quick:
        args.users, args.output_len = 4, 16
    configs = {
        "prefix": (2, 1, ["--router", "prefix"]),
        "power-of-two": (2, 1, ["--router", "power-of-two"]),
        "single": (1, 2, []),
        **{f"prefix-balance-abs-{b}": (2, 1, ["--router", "prefix", "--balance-abs", str(b)]) for b in (0, 16, 32)},
    }
    names = args.only.split(",") if args.only else ["prefix", "power-of-two", "single"]
    if args.sweep:
        names += ["prefix-balance-abs-0", "prefix-balance-abs-16", "prefix-balance-abs-32"]
    unknown = sorted(set(names) - set(configs))
    if unknown:
        p.error(f"--only: unknown configurations {unknown}; known: {sorted(configs)}")
    by = {name: _run(args, name, *configs[name]) for name in names}
    summary: dict = {
        "cpu": next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                     if ln.startswith("model name")), "unknown"),  # fmt: skip
        "load_avg": os.getloadavg(),
        "runs": list(by.values()),
    }
    if {"prefix", "single"} <= set(by):
        summary["hit_rate_vs_single"] = by["prefix"]["hit_rate"] / max(by["single"]["hit_rate"], 1e-9)
        summary["two_replicas_vs_one_2_threads"] = by["prefix"]["output_tok_s"] / by["single"]["output_tok_s"]
    if {"prefix", "power-of-two"} <= set(by):
        summary["throughput_vs_power_of_two"] = by["prefix"]["output_tok_s"] / by["power-of-two"]["output_tok_s"]
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
