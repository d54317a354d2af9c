"""``treeserve bench serve``: a load client for any OpenAI-compatible server.

Sends streaming chat (or completion) requests with async httpx at a fixed concurrency or at a
Poisson request rate, over a random, shared-prefix or mixed-length dataset, and reports TTFT,
TPOT (per request: time after the first token / further tokens), ITL (gaps between content
chunks), end-to-end latency (mean / p50 / p99), output tokens per second and errors.

Output tokens are the server's ``usage.completion_tokens`` when it streams usage, else the count
of content chunks. ``drop_every=k`` makes every k-th request close its connection after its first
token (a disconnect test: those are counted as ``dropped``, not errors).
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

__all__ = ["BenchConfig", "BenchReport", "make_prompts", "run_bench"]

DATASETS = ("random", "shared-prefix", "mixed")


@dataclass(slots=True)
class BenchConfig:
    """One load run. ``concurrency`` (clients in flight) or ``request_rate`` (Poisson arrivals
    per second; then ``concurrency`` still caps requests in flight) decide the arrival pattern.
    ``input_len`` / ``prefix_len`` are in words (about a token each). ``logit_bias`` is sent as
    is (e.g. ``{"2": -100}`` bans EOS so every request runs ``output_len`` tokens on any server)."""

    base_url: str
    model: str | None = None
    endpoint: str = "chat"
    num_requests: int = 32
    concurrency: int = 32
    request_rate: float | None = None
    dataset: str = "random"
    input_len: int = 64
    output_len: int = 128
    prefix_len: int = 256
    num_prefixes: int = 4
    seed: int = 0
    temperature: float = 0.0
    logit_bias: dict[str, float] | None = None
    drop_every: int = 0
    timeout: float = 600.0

    def __post_init__(self) -> None:
        if self.endpoint not in ("chat", "completions"):
            raise ValueError(f"endpoint must be 'chat' or 'completions', got {self.endpoint!r}")
        if self.dataset not in DATASETS:
            raise ValueError(f"dataset must be one of {DATASETS}, got {self.dataset!r}")
        for name in ("num_requests", "concurrency", "input_len", "output_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.request_rate is not None and not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 or None, got {self.request_rate}")
        if self.drop_every < 0:
            raise ValueError(f"drop_every must be >= 0, got {self.drop_every}")


@dataclass(slots=True)
class _Result:
    ok: bool = False
    dropped: bool = False
    error: str | None = None
    ttft: float | None = None
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0


@dataclass(slots=True)
class BenchReport:
    """Latencies in seconds: ``{"mean", "p50", "p99"}`` per metric."""

    completed: int
    errors: int
    dropped: int
    duration: float
    output_tokens: int
    output_tok_s: float
    ttft: dict[str, float]
    tpot: dict[str, float]
    itl: dict[str, float]
    e2e: dict[str, float]
    first_errors: list[str]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def format(self) -> str:
        def row(name: str, d: dict[str, float]) -> str:
            return f"{name:<6} mean {d['mean'] * 1e3:9.1f} ms   p50 {d['p50'] * 1e3:9.1f} ms   p99 {d['p99'] * 1e3:9.1f} ms"

        lines = [
            f"completed {self.completed}  errors {self.errors}  dropped {self.dropped}  in {self.duration:.1f} s",
            f"output tokens {self.output_tokens}  ->  {self.output_tok_s:.1f} tok/s",
            row("TTFT", self.ttft), row("TPOT", self.tpot), row("ITL", self.itl), row("E2E", self.e2e),
        ]  # fmt: skip
        lines += [f"error: {e}" for e in self.first_errors]
        return "\n".join(lines)


def _stats(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {"mean": 0.0, "p50": 0.0, "p99": 0.0}
    s = sorted(xs)

    def pct(q: float) -> float:
        return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]

    return {"mean": statistics.fmean(s), "p50": pct(0.5), "p99": pct(0.99)}


def make_prompts(cfg: BenchConfig) -> list[tuple[str, int]]:
    """``(prompt, max_tokens)`` per request, seeded: random words; a few long shared prefixes
    with distinct questions; or mixed lengths (a quarter to twice ``input_len``/``output_len``)."""
    rng = random.Random(cfg.seed)
    letters = "abcdefghijklmnopqrstuvwxyz"

    def words(n: int) -> str:
        return " ".join("".join(rng.choice(letters) for _ in range(rng.randint(2, 7))) for _ in range(n))

    prefixes = [words(cfg.prefix_len) for _ in range(cfg.num_prefixes)]
    out = []
    for i in range(cfg.num_requests):
        if cfg.dataset == "shared-prefix":
            out.append((prefixes[i % cfg.num_prefixes] + "\n\nQuestion: " + words(cfg.input_len // 4 + 1), cfg.output_len))
        elif cfg.dataset == "mixed":
            n_in = rng.randint(max(1, cfg.input_len // 4), cfg.input_len * 2)
            out.append((words(n_in), rng.randint(max(1, cfg.output_len // 4), cfg.output_len * 2)))
        else:
            out.append((words(cfg.input_len), cfg.output_len))
    return out


def _body(cfg: BenchConfig, model: str, prompt: str, max_tokens: int) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": cfg.temperature,
                            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    if cfg.logit_bias:
        body["logit_bias"] = cfg.logit_bias
    if cfg.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
        return "/v1/chat/completions", body
    body["prompt"] = prompt
    return "/v1/completions", body


def _content(chunk: dict[str, Any]) -> bool:
    for c in chunk.get("choices") or []:
        if (c.get("delta") or {}).get("content") or c.get("text"):
            return True
    return False


async def _one(client: httpx.AsyncClient, cfg: BenchConfig, model: str, prompt: str, max_tokens: int,
               drop: bool) -> _Result:  # fmt: skip
    res = _Result()
    path, body = _body(cfg, model, prompt, max_tokens)
    t0 = time.perf_counter()
    last = t0
    chunks = 0
    usage_tokens = None
    try:
        async with client.stream("POST", path, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                res.error = f"HTTP {resp.status_code}: {text[:200]}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = f"stream error: {chunk['error']}"
                    return res
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens")
                if _content(chunk):
                    now = time.perf_counter()
                    if res.ttft is None:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last = now
                    chunks += 1
                    if drop:
                        res.dropped = True
                        return res  # leaving the block closes the connection mid-stream
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
        return res
    res.e2e = time.perf_counter() - t0
    res.output_tokens = usage_tokens if usage_tokens is not None else chunks
    res.ok = res.ttft is not None
    if not res.ok:
        res.error = "no content received"
    return res


async def _resolve_model(client: httpx.AsyncClient, cfg: BenchConfig) -> str:
    if cfg.model:
        return cfg.model
    r = await client.get("/v1/models")
    r.raise_for_status()
    return r.json()["data"][0]["id"]


async def run_bench(cfg: BenchConfig, transport: httpx.AsyncBaseTransport | None = None) -> BenchReport:
    """Run ``cfg`` against ``cfg.base_url`` (through ``transport`` if given, e.g. an in-process
    ASGI app) and summarize."""
    prompts = make_prompts(cfg)
    rng = random.Random(cfg.seed + 1)
    limits = httpx.Limits(max_connections=cfg.concurrency + 4, max_keepalive_connections=cfg.concurrency + 4)
    async with httpx.AsyncClient(base_url=cfg.base_url.rstrip("/").removesuffix("/v1"), timeout=cfg.timeout,
                                 limits=limits, transport=transport) as client:  # fmt: skip
        model = await _resolve_model(client, cfg)
        gate = asyncio.Semaphore(cfg.concurrency)

        async def task(i: int, prompt: str, max_tokens: int) -> _Result:
            async with gate:
                drop = cfg.drop_every > 0 and (i + 1) % cfg.drop_every == 0
                return await _one(client, cfg, model, prompt, max_tokens, drop)

        t0 = time.perf_counter()
        tasks = []
        for i, (prompt, max_tokens) in enumerate(prompts):
            if cfg.request_rate is not None and i:
                await asyncio.sleep(rng.expovariate(cfg.request_rate))
            tasks.append(asyncio.create_task(task(i, prompt, max_tokens)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    done = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in done if r.ttft is not None and r.output_tokens > 1]
    errors = [r.error for r in results if r.error and not r.dropped]
    return BenchReport(
        completed=len(done), errors=len(errors), dropped=sum(r.dropped for r in results), duration=duration,
        output_tokens=out_tokens, output_tok_s=out_tokens / duration if duration else 0.0,
        ttft=_stats([r.ttft for r in results if r.ttft is not None and not r.dropped]), tpot=_stats(tpot),
        itl=_stats([g for r in done for g in r.itl]), e2e=_stats([r.e2e for r in done]),
        first_errors=[e for e in errors if e][:3],
    )  # fmt: skip
