"""The load client: datasets, statistics, validation, and a run against our app in process."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from treeserve.server.api import build_app
from treeserve.server.bench_client import BenchConfig, _stats, make_prompts, run_bench
from treeserve.server.engine_client import AsyncLLMEngine

from ._helpers import MODEL, assert_engine_drained, running, synthetic_llm


def test_datasets_are_seeded_and_shaped() -> None:
    base = dict(base_url="http://x", num_requests=12, input_len=40, output_len=20, prefix_len=30, num_prefixes=3)
    rnd = make_prompts(BenchConfig(**base))
    assert rnd == make_prompts(BenchConfig(**base)) and rnd != make_prompts(BenchConfig(**base, seed=1))
    assert all(len(p.split()) == 40 and m == 20 for p, m in rnd)
    shared = make_prompts(BenchConfig(**base, dataset="shared-prefix"))
    prefixes = {p.split("\n\nQuestion: ")[0] for p, _ in shared}
    assert len(prefixes) == 3 and all(len(x.split()) == 30 for x in prefixes)
    assert len({p for p, _ in shared}) == 12
    mixed = make_prompts(BenchConfig(**base, dataset="mixed"))
    assert all(10 <= len(p.split()) <= 80 and 5 <= m <= 40 for p, m in mixed)
    assert len({m for _, m in mixed}) > 1 and len({len(p.split()) for p, _ in mixed}) > 1


def test_stats_and_validation() -> None:
    xs = [float(i) for i in range(1, 101)]
    s = _stats(xs)
    assert s["mean"] == pytest.approx(50.5) and s["p50"] in (50.0, 51.0) and s["p99"] == 99.0
    assert _stats([]) == {"mean": 0.0, "p50": 0.0, "p99": 0.0}
    for kw, field in [(dict(endpoint="x"), "endpoint"), (dict(dataset="x"), "dataset"), (dict(concurrency=0), "concurrency"),
                      (dict(request_rate=0.0), "request_rate"), (dict(drop_every=-1), "drop_every")]:  # fmt: skip
        with pytest.raises(ValueError, match=field):
            BenchConfig(base_url="http://x", **kw)


@pytest.mark.parametrize("endpoint, rate", [("chat", None), ("completions", 50.0)])
def test_run_against_our_app(endpoint, rate) -> None:
    eng = AsyncLLMEngine(synthetic_llm())
    with running(eng):
        cfg = BenchConfig(base_url="http://test/v1", endpoint=endpoint, num_requests=6, concurrency=3, request_rate=rate,
                          dataset="mixed", input_len=8, output_len=4, logit_bias={str(t): -100 for t in eng.tokenizer.eos_token_ids})  # fmt: skip
        report = asyncio.run(run_bench(cfg, transport=httpx.ASGITransport(app=build_app(eng, MODEL))))
        expected = sum(m for _, m in make_prompts(cfg))
        assert report.errors == 0 and report.completed == 6 and report.output_tokens == expected
        assert 0 < report.ttft["p50"] <= report.e2e["p99"] and report.output_tok_s > 0
        bad = asyncio.run(run_bench(BenchConfig(base_url="http://test/v1", model="nope", num_requests=2, concurrency=2),
                                    transport=httpx.ASGITransport(app=build_app(eng, MODEL))))  # fmt: skip
        assert bad.errors == 2 and bad.completed == 0 and "HTTP 400" in bad.first_errors[0]
        assert_engine_drained(eng)
