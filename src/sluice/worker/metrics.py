"""Prometheus metrics of one worker, under vLLM's names so vLLM dashboards and routers work.

Two sources, one per-app `CollectorRegistry` (never the global one, so several workers
can live in one process, as in tests):

- engine state and cumulative counters come from `engine.stats()` at scrape time
  (`EngineStatsCollector`): running/waiting requests, KV usage, prefix-cache queries
  and hits, preemptions, prompt and generation tokens;
- per-request latencies are observed by the worker as outputs stream out
  (`RequestTimer`): time to first token, inter-token latency, end-to-end latency,
  and `vllm:request_success_total{finished_reason}`.

Every series carries the `model_name` label.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sluice.engine.stats import EngineStats

# vLLM's buckets.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

StatsSource = Callable[[], EngineStats | None]


class EngineStatsCollector(Collector):
    """Reads `EngineStats` at scrape time; yields nothing while the model is loading."""

    def __init__(self, source: StatsSource, model_name: Callable[[], str]) -> None:
        self.source = source
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        stats = self.source()
        if stats is None:
            return
        label = [self.model_name()]
        gauges = [
            ("vllm:num_requests_running", "Requests in the running batch.", stats.num_running),
            ("vllm:num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting),
            ("vllm:kv_cache_usage_perc", "Fraction of KV blocks in use (0..1).",
             stats.kv_cache_usage),
            ("sluice:num_kv_blocks", "Size of the KV pool in blocks.", stats.num_kv_blocks),
        ]
        counters = [
            ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
             stats.prefix_cache_queries),
            ("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
             stats.prefix_cache_hits),
            ("vllm:num_preemptions", "Preemptions.", stats.num_preemptions),
            ("vllm:prompt_tokens", "Prompt tokens processed.", stats.prompt_tokens),
            ("vllm:generation_tokens", "Tokens generated.", stats.generation_tokens),
            ("sluice:engine_steps", "Engine steps run.", stats.num_steps),
        ]
        for name, doc, value in gauges:
            gauge = GaugeMetricFamily(name, doc, labels=["model_name"])
            gauge.add_metric(label, float(value))
            yield gauge
        for name, doc, value in counters:
            counter = CounterMetricFamily(name, doc, labels=["model_name"])
            counter.add_metric(label, float(value))
            yield counter


class WorkerMetrics:
    """The registry and the worker-observed series of one app."""

    def __init__(self, source: StatsSource, model_name: Callable[[], str]) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.registry.register(EngineStatsCollector(source, model_name))
        labels = ["model_name"]
        r = self.registry
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.",
                              labels, buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between tokens.",
                             labels, buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Request latency.",
                             labels, buckets=E2E_BUCKETS, registry=r)
        self.success = Counter("vllm:request_success", "Finished requests by reason.",
                               labels + ["finished_reason"], registry=r)
        self.pending = Gauge("sluice:http_requests_pending", "HTTP generation requests in flight.",
                             labels, registry=r)
        self.rejected = Counter("sluice:requests_rejected", "Requests refused, by reason.",
                                labels + ["reason"], registry=r)

    def timer(self) -> RequestTimer:
        return RequestTimer(self, self.model_name())


class RequestTimer:
    """Observes one request's latencies as its outputs arrive (single-threaded use)."""

    def __init__(self, metrics: WorkerMetrics, model_name: str) -> None:
        self.metrics = metrics
        self.model_name = model_name
        self.start = time.perf_counter()
        self.last: float | None = None

    def tokens(self, count: int) -> None:
        """Record that `count` new tokens arrived now."""
        if count <= 0:
            return
        now = time.perf_counter()
        if self.last is None:
            self.metrics.ttft.labels(self.model_name).observe(now - self.start)
            count -= 1
        elif count:
            gap = (now - self.last) / count
            for _ in range(count):
                self.metrics.itl.labels(self.model_name).observe(gap)
        self.last = now

    def finished(self, reasons: list[str]) -> None:
        self.metrics.e2e.labels(self.model_name).observe(time.perf_counter() - self.start)
        for reason in reasons:
            self.metrics.success.labels(self.model_name, reason).inc()
