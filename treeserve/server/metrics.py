"""Prometheus metrics under vLLM's names, so routers and dashboards built for vLLM read them.

Gauges are read at scrape time from :meth:`EngineClient.stats`; histograms and counters are fed
once per finished (or aborted) request from its :class:`RequestStream` timings. Metrics of
treeserve's own (counters ``treeserve:engine_steps_total``, ``treeserve:engine_busy_seconds_total``
and the histogram ``treeserve:engine_step_seconds``, fed by the engine loop) tell engine time from
serving overhead and show slow steps.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from treeserve.server.engine_client import EngineClient, EngineStats, RequestStream

__all__ = ["CONTENT_TYPE", "ServerMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)  # fmt: skip


class _EngineGauges(Collector):
    def __init__(self, client: EngineClient, model_name: str, metrics: ServerMetrics) -> None:
        self.client, self.labels, self.metrics = client, [model_name], metrics

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s = self.client.stats()
        m = self.metrics
        hit_rate = m.cached_tokens / m.queried_tokens if m.queried_tokens else 0.0
        for name, doc, value in (
            ("vllm:num_requests_running", "Requests (samples) in the running batch.", s.num_running),
            ("vllm:num_requests_waiting", "Requests (samples) waiting to be scheduled.", s.num_waiting),
            ("vllm:gpu_cache_usage_perc", "KV-cache usage, 0..1 (1 = full).", s.kv_usage),
            ("vllm:kv_cache_usage_perc", "KV-cache usage, 0..1 (1 = full).", s.kv_usage),
            ("vllm:gpu_prefix_cache_hit_rate", "Prompt tokens served from the prefix cache, 0..1.", hit_rate),
        ):
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(self.labels, float(value))
            yield g
        for name, doc, total in (  # no vLLM equivalent: treeserve's own names
            ("treeserve:engine_steps", "Engine steps run.", s.steps),
            ("treeserve:engine_busy_seconds", "Time spent in engine steps (schedule, forward, sample).",
             s.busy_seconds),
            ("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed by speculative decoding.", s.draft_tokens),
            ("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted by verification.", s.accepted_tokens),
            ("vllm:spec_decode_num_drafts", "Verify passes (a request's draft verified in a step).", s.verify_steps),
            ("treeserve:jump_forward_proposed_tokens", "Jump-forward tokens (forced by a grammar) proposed.",
             s.jump_forward_proposed),
            ("treeserve:jump_forward_tokens", "Jump-forward tokens accepted: forward passes saved.",
             s.jump_forward_tokens),
        ):  # fmt: skip
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(self.labels, float(total))
            yield c
        yield from _tier_metrics(s, self.labels)


def _tier_metrics(s: EngineStats, labels: list[str]) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """The KV tiers' hit rate (promoted / prompt tokens) and hit tokens per tier, and bytes moved
    per direction (all zero when the tiers are off)."""
    rate = GaugeMetricFamily("treeserve:kv_tier_hit_rate", "Prompt tokens whose KV was promoted from a lower tier, 0..1.",
                             labels=["model_name", "tier"])  # fmt: skip
    hits = CounterMetricFamily("treeserve:kv_tier_hit_tokens", "Tokens promoted from a lower KV tier.",
                               labels=["model_name", "tier"])  # fmt: skip
    t = s.kv_tiers
    for tier, n in (("host", t.host_hit_tokens), ("disk", t.disk_hit_tokens)):
        rate.add_metric(labels + [tier], n / s.prompt_tokens if s.prompt_tokens else 0.0)
        hits.add_metric(labels + [tier], float(n))
    moved = CounterMetricFamily("treeserve:kv_tier_bytes", "KV bytes moved between tiers.",
                                labels=["model_name", "direction"])  # fmt: skip
    for direction, n in (("device_to_host", t.bytes_device_to_host), ("host_to_device", t.bytes_host_to_device),
                         ("disk_to_device", t.bytes_disk_to_device), ("to_disk", t.bytes_to_disk)):  # fmt: skip
        moved.add_metric(labels + [direction], float(n))
    yield from (rate, hits, moved)


class ServerMetrics:
    """The server's metrics in a registry of its own (several apps may live in one process)."""

    def __init__(self, client: EngineClient, model_name: str) -> None:
        disable_created_metrics()  # process-wide, as in vLLM: no *_created series
        self.registry = CollectorRegistry()
        self.queried_tokens = 0
        self.cached_tokens = 0
        r, lab = self.registry, ["model_name"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", lab,
                              registry=r, buckets=_LATENCY_BUCKETS)  # fmt: skip
        self.tpot = Histogram("vllm:time_per_output_token_seconds", "Mean time per output token after the first.",
                              lab, registry=r, buckets=_LATENCY_BUCKETS)  # fmt: skip
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between engine steps giving a request tokens.",
                             lab, registry=r, buckets=_LATENCY_BUCKETS)  # fmt: skip
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to last output.", lab, registry=r,
                             buckets=_LATENCY_BUCKETS)  # fmt: skip
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens processed.", lab, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated.", lab, registry=r)
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                      lab, registry=r)  # fmt: skip
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", lab,
                                   registry=r)  # fmt: skip
        self.success = Counter("vllm:request_success", "Finished requests by finish reason.",
                               lab + ["finished_reason"], registry=r)  # fmt: skip
        self.step_time = Histogram("treeserve:engine_step_seconds", "Wall time of one engine step.", lab,
                                   registry=r, buckets=_LATENCY_BUCKETS)  # fmt: skip
        self._name = model_name
        client.step_observer = self.step_time.labels(model_name).observe
        r.register(_EngineGauges(client, model_name, self))

    def observe(self, stream: RequestStream, prompt_tokens: int, cached_tokens: int, output_tokens: int,
                finish_reason: str) -> None:  # fmt: skip
        """Record one request at its end (``finish_reason`` of its first sample, or "abort")."""
        name = self._name
        now = time.perf_counter()
        self.prompt_tokens.labels(name).inc(prompt_tokens)
        self.generation_tokens.labels(name).inc(output_tokens)
        self.prefix_queries.labels(name).inc(prompt_tokens)
        self.prefix_hits.labels(name).inc(cached_tokens)
        self.queried_tokens += prompt_tokens
        self.cached_tokens += cached_tokens
        self.success.labels(name, finish_reason).inc()
        self.e2e.labels(name).observe(now - stream.arrival)
        if stream.first_token_at is not None:
            self.ttft.labels(name).observe(stream.first_token_at - stream.arrival)
            per_sample = output_tokens / max(stream.n, 1)
            if per_sample > 1:
                self.tpot.labels(name).observe(((stream.last_token_at or now) - stream.first_token_at) / (per_sample - 1))
        for gap in stream.step_gaps:
            self.itl.labels(name).observe(gap)

    def render(self) -> bytes:
        return generate_latest(self.registry)
