"""Prometheus metrics of one worker, under vLLM's names so vLLM dashboards and routers work.

Two sources, one per-app `CollectorRegistry` (never the global one, so several workers
can live in one process, as in tests):

- engine state and cumulative counters come from `engine.stats()` at scrape time
  (`EngineStatsCollector`): running/waiting requests, KV usage, prefix-cache queries
  and hits, preemptions, prompt and generation tokens, and the engine-step histogram
  `vllm:iteration_tokens_total` (tokens per step, counted in the core);
- per-request latencies are observed by the worker as outputs stream out
  (`RequestTimer`): time to first token, inter-token latency, end-to-end latency,
  and `vllm:request_success_total{finished_reason}`; when a request finishes, the
  engine core's timestamps (arrival, first scheduled, first token, finished) give
  vLLM's queue / prefill / decode / inference time histograms, and its prompt and
  generated token counts vLLM's `vllm:request_prompt_tokens` /
  `vllm:request_generation_tokens`; each request's `n` and `max_tokens` are observed
  as it starts (`vllm:request_params_n`, `vllm:request_params_max_tokens`), as vLLM's
  Grafana dashboard reads them.

Buckets are `observe.buckets.LatencyBuckets` (finer than vLLM's; configurable).

Every series carries the `model_name` label.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from sluice.engine.outputs import RequestMetrics
from sluice.engine.stats import ITERATION_TOKEN_BUCKETS, EngineStats
from sluice.observe.buckets import LatencyBuckets

StatsSource = Callable[[], EngineStats | None]
# token-count buckets: vLLM's 1-2-5 series (it stops at the model's context length)
TOKEN_BUCKETS = tuple(float(m * 10**e) for e in range(6) for m in (1, 2, 5))
N_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0)


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
        yield iteration_tokens_metric(stats, label[0])
        if stats.kv_offload:
            yield from kv_offload_metrics(stats.kv_offload, label[0])
        if stats.spec_decode:
            yield from spec_decode_metrics(stats.spec_decode, label[0])
        yield from kv_transfer_metrics(stats.kv_transfer, label[0])  # zeros until used
        if stats.max_lora:  # vLLM's gauge for LoRA-aware routers; the value is a timestamp
            info = GaugeMetricFamily(
                "vllm:lora_requests_info", "Running stats on lora requests.",
                labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"])
            info.add_metric([stats.running_lora_adapters, stats.waiting_lora_adapters,
                             str(stats.max_lora)], time.time())
            yield info


def iteration_tokens_metric(stats: EngineStats, model_name: str) -> Metric:
    """vLLM's `vllm:iteration_tokens_total` histogram (its buckets; a histogram despite
    the `_total`): tokens per engine step, as `stats.IterationTokens` counts them."""
    counts = stats.iteration_tokens or [0] * (len(ITERATION_TOKEN_BUCKETS) + 1)
    cumulative = [sum(counts[:i + 1]) for i in range(len(counts))]
    bounds = [str(float(b)) for b in ITERATION_TOKEN_BUCKETS] + ["+Inf"]
    hist = HistogramMetricFamily("vllm:iteration_tokens_total",
                                 "Histogram of number of tokens per engine_step.",
                                 labels=["model_name"])
    hist.add_metric([model_name], list(zip(bounds, map(float, cumulative), strict=True)),
                    float(stats.iteration_tokens_sum))
    return hist


SPEC_DECODE_SERIES = [
    ("vllm:spec_decode_num_drafts", "Verified drafts (a sequence's drafted tokens in one step).",
     "num_drafts"),
    ("vllm:spec_decode_num_draft_tokens", "Drafted tokens verified.", "num_draft_tokens"),
    ("vllm:spec_decode_num_accepted_tokens", "Drafted tokens accepted.", "num_accepted_tokens"),
]


def spec_decode_metrics(spec: dict[str, Any], model_name: str) -> Iterator[Metric]:
    """vLLM's speculative-decoding counters (`_total` is added on exposition)."""
    for name, doc, key in SPEC_DECODE_SERIES:
        counter = CounterMetricFamily(name, doc, labels=["model_name"])
        counter.add_metric([model_name], float(spec.get(key, 0)))
        yield counter
    per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                  "Drafted tokens accepted, by position in the draft.",
                                  labels=["model_name", "position"])
    for pos, count in enumerate(spec.get("accepted_per_pos", [])):
        per_pos.add_metric([model_name, str(pos)], float(count))
    yield per_pos


# (metric, kind, doc, key in the engine's per-medium stats)
KV_OFFLOAD_SERIES = [
    ("vllm:external_prefix_cache_queries", "counter",
     "Prompt tokens looked up in the offload tiers after a pool miss.", "query_tokens"),
    ("vllm:external_prefix_cache_hits", "counter",
     "Prompt tokens loaded from the offload tiers instead of recomputed.", "hit_tokens"),
    ("sluice:kv_offload_bytes_loaded", "counter", "KV bytes loaded into the pool.",
     "bytes_loaded"),
    ("sluice:kv_offload_bytes_stored", "counter", "KV bytes stored in the tier.",
     "bytes_stored"),
    ("sluice:kv_offload_load_seconds", "counter",
     "Seconds spent loading blocks from the tier into the pool.", "load_seconds"),
    ("sluice:kv_offload_errors", "counter",
     "Corrupt or truncated blocks and unreachable stores (each fell back to recompute).",
     "errors"),
    ("sluice:kv_offload_skipped_blocks", "counter",
     "Blocks not asked of the tier: its measured load time was slower than recomputing.",
     "skipped"),
    ("sluice:kv_offload_usage_bytes", "gauge", "Bytes held by the tier (this worker's view).",
     "usage_bytes"),
    ("sluice:kv_offload_load_seconds_per_block", "gauge",
     "Measured time to load one block from the tier (moving average).", "load_s_per_block"),
]

KV_OFFLOAD_ENGINE_COUNTERS = [
    ("sluice:kv_offload_write_drops", "Blocks not written through to the disk tier and the "
     "store (the writer was behind).", "write_drops"),
    ("sluice:kv_offload_prefetch_absent", "Pool misses whose next block no disk tier or "
     "store held (recomputed).", "prefetch_absent"),
    ("sluice:kv_offload_prefetch_waits", "Pool misses that waited for a fetch from the disk "
     "tier or the store.", "prefetch_waits"),
    ("sluice:kv_offload_fetch_misses", "Fetches that loaded not even the first block "
     "(unusable, or not asked: slower than recomputing).", "fetch_misses"),
]


def kv_offload_metrics(tiers: dict[str, dict[str, float]], model_name: str) -> Iterator[Metric]:
    """One family per series, one sample per medium (CPU, DISK, REDIS)."""
    media = [m for m in tiers if m != "ENGINE"]
    for name, kind, doc, key in KV_OFFLOAD_SERIES:
        family: GaugeMetricFamily | CounterMetricFamily = (
            CounterMetricFamily(name, doc, labels=["model_name", "medium"]) if kind == "counter"
            else GaugeMetricFamily(name, doc, labels=["model_name", "medium"]))
        for medium in media:
            family.add_metric([model_name, medium], tiers[medium].get(key, 0.0))
        yield family
    engine = tiers.get("ENGINE", {})
    gauge = GaugeMetricFamily("sluice:kv_offload_prefill_seconds_per_block",
                              "Measured time to recompute one block (what a load must beat).",
                              labels=["model_name"])
    gauge.add_metric([model_name], engine.get("prefill_s_per_block", 0.0))
    yield gauge
    for name, doc, key in KV_OFFLOAD_ENGINE_COUNTERS:
        counter = CounterMetricFamily(name, doc, labels=["model_name"])
        counter.add_metric([model_name], engine.get(key, 0.0))
        yield counter


# sluice.engine.kv_transfer's (repeated here: the front end does not import torch)
PULL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
FAILURE_REASONS = ("connect", "timeout", "lease", "mismatch", "corrupt", "protocol",
                   "no_prefix_cache")


def kv_transfer_metrics(t: dict[str, float], model_name: str) -> Iterator[Metric]:
    """P/D KV hand-off (sluice.engine.kv_transfer.TransferStats.as_dict): bytes and
    blocks by direction, held blocks, failures by reason, the pull-time histogram."""
    for what, doc in (("bytes", "KV bytes handed off between engines."),
                      ("blocks", "KV blocks handed off between engines.")):
        family = CounterMetricFamily(f"sluice:kv_transfer_{what}", doc,
                                     labels=["model_name", "direction"])
        for direction in ("sent", "received"):
            family.add_metric([model_name, direction], t.get(f"{what}_{direction}", 0.0))
        yield family
    failures = CounterMetricFamily("sluice:kv_transfer_failures",
                                   "KV pulls that failed, by reason (recomputed or failed).",
                                   labels=["model_name", "reason"])
    for reason in FAILURE_REASONS:
        failures.add_metric([model_name, reason], t.get(f"failure:{reason}", 0.0))
    yield failures
    held = GaugeMetricFamily("sluice:kv_transfer_held_blocks",
                             "KV blocks held under a lease for a decode engine.",
                             labels=["model_name"])
    held.add_metric([model_name], t.get("held_blocks", 0.0))
    yield held
    buckets = [(str(bound), t.get(f"le:{bound}", 0.0)) for bound in PULL_BUCKETS]
    hist = HistogramMetricFamily("sluice:kv_transfer_seconds",
                                 "Decode side: time to pull a prefill's KV blocks.",
                                 labels=["model_name"])
    hist.add_metric([model_name], [*buckets, ("+Inf", t.get("seconds_count", 0.0))],
                    t.get("seconds_sum", 0.0))
    yield hist


class WorkerMetrics:
    """The registry and the worker-observed series of one app."""

    def __init__(self, source: StatsSource, model_name: Callable[[], str],
                 buckets: LatencyBuckets | None = None) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.registry.register(EngineStatsCollector(source, model_name))
        b = buckets or LatencyBuckets()
        labels = ["model_name"]
        r = self.registry

        def hist(name: str, doc: str, bounds: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=bounds, registry=r)

        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to first token.", b.ttft)
        self.itl = hist("vllm:inter_token_latency_seconds", "Time between tokens.", b.itl)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Request latency.", b.e2e)
        self.tpot = hist("vllm:request_time_per_output_token_seconds",
                         "Mean time per output token after the first, per request.", b.tpot)
        self.queue = hist("vllm:request_queue_time_seconds",
                          "Time from arrival in the engine to first being scheduled.", b.queue)
        self.prefill = hist("vllm:request_prefill_time_seconds",
                            "Time from first scheduled to the first token.", b.prefill)
        self.decode = hist("vllm:request_decode_time_seconds",
                           "Time from the first token to the last.", b.decode)
        self.inference = hist("vllm:request_inference_time_seconds",
                              "Time from first scheduled to the last token.", b.inference)
        self.prompt_tokens = hist("vllm:request_prompt_tokens",
                                  "Prompt tokens of each finished request.", TOKEN_BUCKETS)
        self.generation_tokens = hist("vllm:request_generation_tokens",
                                      "Generated tokens of each finished request.",
                                      TOKEN_BUCKETS)
        self.params_n = hist("vllm:request_params_n", "The n of each request.", N_BUCKETS)
        self.params_max_tokens = hist("vllm:request_params_max_tokens",
                                      "The max_tokens of each request.", TOKEN_BUCKETS)
        self.success = Counter("vllm:request_success", "Finished requests by reason.",
                               labels + ["finished_reason"], registry=r)
        self.pending = Gauge("sluice:http_requests_pending", "HTTP generation requests in flight.",
                             labels, registry=r)
        self.rejected = Counter("sluice:requests_rejected",
                                "Generation requests refused before their answer (an error "
                                "status), by reason: the error's code, else its type.",
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

    def params(self, n: int, max_tokens: int | None) -> None:
        """Observe one engine request's `n` and `max_tokens` as it starts."""
        self.metrics.params_n.labels(self.model_name).observe(n)
        if max_tokens is not None:
            self.metrics.params_max_tokens.labels(self.model_name).observe(max_tokens)

    def request_tokens(self, prompt_tokens: int, generated_tokens: int) -> None:
        """Observe one finished engine request's prompt and generated token counts."""
        self.metrics.prompt_tokens.labels(self.model_name).observe(prompt_tokens)
        self.metrics.generation_tokens.labels(self.model_name).observe(generated_tokens)

    def engine_times(self, times: RequestMetrics | None, num_output_tokens: int) -> None:
        """Observe one finished engine request's queue, prefill, decode, inference and
        per-output-token times from its core timestamps (wall clock, seconds)."""
        phases = request_phases(times)
        if phases is None:
            return
        queue, prefill, decode = phases
        m, name = self.metrics, self.model_name
        m.queue.labels(name).observe(queue)
        m.prefill.labels(name).observe(prefill)
        m.decode.labels(name).observe(decode)
        m.inference.labels(name).observe(prefill + decode)
        if num_output_tokens > 1:
            m.tpot.labels(name).observe(decode / (num_output_tokens - 1))


def request_phases(times: RequestMetrics | None) -> tuple[float, float, float] | None:
    """(queue, prefill, decode) seconds of a finished request, or None while a timestamp
    is missing (aborted before its first token). Clock skew never makes one negative."""
    if times is None or times.first_scheduled_time is None or times.first_token_time is None \
            or times.finished_time is None:
        return None
    scheduled, first, done = times.first_scheduled_time, times.first_token_time, times.finished_time
    return (max(scheduled - times.arrival_time, 0.0), max(first - scheduled, 0.0),
            max(done - first, 0.0))
