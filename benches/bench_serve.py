"""Issue 13: `treeserve serve` vs llama-cpp-python's OpenAI server, same GGUF, same load client.

    flock /tmp/treeserve-bench.lock python benches/bench_serve.py [--quick]

Full: 32 concurrent streaming chats x 128 tokens; --quick: 16 x 64; each over two datasets:
random prompts, and shared-prefix (two long documents, a distinct question each). EOS is banned
through ``logit_bias`` (an OpenAI field both servers honour) so every request runs its full length.
Then 200 requests (8 tokens) against ours with every 5th client disconnecting after its first
token; the KV usage gauge must return to 0 (no leaked pages). Both servers get ``--threads`` (2)
threads and bind to 127.0.0.1. Prints a JSON summary with the CPU model and load average.

Not a pytest benchmark (it starts servers); run it directly.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from treeserve.models import resolve_model_path
from treeserve.server.bench_client import BenchConfig, run_bench

BAN_EOS = {"0": -100.0, "2": -100.0}  # SmolLM2: <|endoftext|>, <|im_end|>


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _wait_up(url: str, proc: subprocess.Popen, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("server did not come up in time")


def _start(cmd: list[str], log: Path, threads: int) -> subprocess.Popen:
    """Start a server; its output goes to ``log`` (a pipe nobody reads would fill up and stall it)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    with open(log, "w") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _gauge(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    m = re.search(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.M)
    if m is None:
        raise RuntimeError(f"{name} missing from /metrics")
    return float(m.group(1))


DATASETS = ("random", "shared-prefix")


def _engine_time(base: str) -> tuple[float, float, dict[float, float]]:
    """Steps so far, seconds spent in them, and the step-time histogram (cumulative count per
    upper bound in seconds)."""
    text = httpx.get(base + "/metrics", timeout=10).text
    hist = {float(le): float(v) for le, v in
            re.findall(r'^treeserve:engine_step_seconds_bucket{le="([^"]+)"[^}]*} (\S+)$', text, re.M)}  # fmt: skip
    return _gauge(base, "treeserve:engine_steps_total"), _gauge(base, "treeserve:engine_busy_seconds_total"), hist


def _slow_steps(before: dict[float, float], after: dict[float, float]) -> dict:
    """Steps of one run slower than 1 s, and the bucket bound the slowest one fell under."""
    count = {le: after[le] - before.get(le, 0.0) for le in sorted(after)}
    total = count[float("inf")]
    slowest = next(le for le, c in count.items() if c == total)
    return {"over_1s": total - count[1.0], "slowest_under_s": slowest}


def _load_runs(base: str, n: int, out_len: int, ours: bool) -> dict:
    """One run per dataset, keyed by its name; for ours also where the time went (engine steps:
    count, mean time, share of the run's wall time, output tokens per step)."""
    out = {}
    for dataset in DATASETS:
        cfg = BenchConfig(base_url=base + "/v1", num_requests=n, concurrency=n, output_len=out_len, input_len=32,
                          dataset=dataset, prefix_len=128, num_prefixes=2, logit_bias=BAN_EOS, timeout=1800)  # fmt: skip
        before = _engine_time(base) if ours else None
        rep = out[dataset] = asyncio.run(run_bench(cfg)).as_dict()
        rep["load_after"] = _load()
        if before is not None:
            after = _engine_time(base)
            steps, busy = after[0] - before[0], after[1] - before[1]
            rep["engine"] = {"steps": steps, "mean_step_ms": 1e3 * busy / max(steps, 1),
                             "busy_share": busy / rep["duration"], "tokens_per_step": rep["output_tokens"] / max(steps, 1),
                             "slow_steps": _slow_steps(before[2], after[2])}  # fmt: skip
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="16 concurrent x 64 tokens instead of 32 x 128")
    ap.add_argument("--leak-requests", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2, help="CPU threads of each server (the issue: 2)")
    args = ap.parse_args()
    n, out_len = (16, 64) if args.quick else (32, 128)
    gguf = str(resolve_model_path("smollm2-135m-instruct"))
    result: dict = {"cpu": _cpu_model(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                    "load_before": _load(), "threads": args.threads, "concurrency": n, "output_len": out_len}  # fmt: skip

    port = _free_port()
    peer = _start([sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--n_threads", str(args.threads),
                   "--n_threads_batch", str(args.threads), "--interrupt_requests", "False", "--host", "127.0.0.1",
                   "--port", str(port), "--n_ctx", "2048"], Path("/tmp/bench_serve_peer.log"), args.threads)  # fmt: skip
    try:
        _wait_up(f"http://127.0.0.1:{port}", peer)
        result["peer"] = _load_runs(f"http://127.0.0.1:{port}", n, out_len, ours=False)
    finally:
        _stop(peer)

    port = _free_port()
    ours = _start([sys.executable, "-m", "treeserve", "serve", "--threads", str(args.threads), "--host", "127.0.0.1",
                   "--port", str(port)], Path("/tmp/bench_serve_ours.log"), args.threads)  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_up(base, ours)
        result["ours"] = _load_runs(base, n, out_len, ours=True)
        leak = BenchConfig(base_url=base + "/v1", num_requests=args.leak_requests, concurrency=n, output_len=8,
                           input_len=16, logit_bias=BAN_EOS, drop_every=5, timeout=1800)  # fmt: skip
        lr = asyncio.run(run_bench(leak))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (_gauge(base, "vllm:kv_cache_usage_perc") > 0
                                                or _gauge(base, "vllm:num_requests_running") > 0):  # fmt: skip
            time.sleep(0.5)
        result["disconnects"] = {"requests": args.leak_requests, "dropped": lr.dropped, "errors": lr.errors,
                                 "completed": lr.completed,
                                 "kv_usage_after": _gauge(base, "vllm:kv_cache_usage_perc"),
                                 "running_after": _gauge(base, "vllm:num_requests_running"),
                                 "waiting_after": _gauge(base, "vllm:num_requests_waiting")}  # fmt: skip
    finally:
        _stop(ours)
    result["ratios"] = {}
    for dataset in DATASETS:
        p, o = result["peer"][dataset], result["ours"][dataset]
        result["ratios"][dataset] = {
            "output_tok_s": o["output_tok_s"] / p["output_tok_s"] if p["output_tok_s"] else None,
            "p99_ttft": o["ttft"]["p99"] / p["ttft"]["p99"] if p["ttft"]["p99"] else None,
        }
    result["load_after"] = _load()
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
