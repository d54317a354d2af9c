"""``/metrics`` carries the KV tiers' hit rate, hit tokens and bytes moved."""

from __future__ import annotations

import asyncio
import re

from treeserve.server.engine_client import AsyncLLMEngine

from ._helpers import http, running, synthetic_llm


def value(text: str, name: str, label: str) -> float:
    labels = rf'(?=[^}}]*model_name="tiny-synthetic")(?=[^}}]*{label})'
    found = re.search(rf"^{re.escape(name)}{{{labels}[^}}]*}} (\S+)$", text, re.M)
    assert found, (name, label)
    return float(found.group(1))


def test_metrics_report_host_tier_hits_and_bytes() -> None:
    # A pool of 256 tokens: the second prompt pushes the first one's KV down to the host tier.
    engine = AsyncLLMEngine(synthetic_llm(kv_cache_tokens=256, kv_host_tokens=1024))
    first, second = [7 + i % 50 for i in range(200)], [300 + i % 40 for i in range(200)]

    async def go() -> str:
        async with http(engine) as c:
            for prompt in (first, second, first):
                body = {"prompt": prompt, "max_tokens": 2, "ignore_eos": True}
                assert (await c.post("/v1/completions", json=body)).status_code == 200
            return (await c.get("/metrics")).text

    with running(engine):
        text = asyncio.run(asyncio.wait_for(go(), 120))
    assert value(text, "treeserve:kv_tier_hit_tokens_total", 'tier="host"') >= 128
    assert value(text, "treeserve:kv_tier_hit_tokens_total", 'tier="disk"') == 0
    assert 0 < value(text, "treeserve:kv_tier_hit_rate", 'tier="host"') < 1
    assert value(text, "treeserve:kv_tier_bytes_total", 'direction="device_to_host"') > 0
    assert value(text, "treeserve:kv_tier_bytes_total", 'direction="host_to_device"') > 0
