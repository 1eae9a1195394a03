"""The router's own Prometheus metrics, in a registry created per app (no globals).

Counters and histograms are updated on the request path; per-worker gauges (health,
in flight, learned prefill speed, scraped load) are read from the pools when /metrics
is scraped, by a custom collector, so they can never go stale or leak removed workers.

On the request path the labelled children are looked up through the `*_for` methods,
which keep them in a dict: `Counter.labels()` takes a lock and validates its arguments
on every call, a few microseconds each, several times per request.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sluice.observe.buckets import LatencyBuckets
from sluice.router.pool import Pool


class _WorkerCollector(Collector):
    def __init__(self, pools: Callable[[], Iterable[Pool]]) -> None:
        self._pools = pools

    def collect(self) -> Iterator[Metric]:
        fams = {
            "healthy": GaugeMetricFamily("sluice_router_worker_healthy",
                                         "1 if the worker takes requests", labels=["worker"]),
            "inflight": GaugeMetricFamily("sluice_router_worker_inflight",
                                          "requests the router has in flight there", labels=["worker"]),
            "spt": GaugeMetricFamily("sluice_router_worker_seconds_per_token",
                                     "learned prefill cost per token-equivalent", labels=["worker"]),
            "overhead": GaugeMetricFamily("sluice_router_worker_overhead_seconds",
                                          "learned fixed part of the worker's TTFT",
                                          labels=["worker"]),
            "running": GaugeMetricFamily("sluice_router_worker_running",
                                         "estimated running requests", labels=["worker"]),
            "waiting": GaugeMetricFamily("sluice_router_worker_waiting",
                                         "estimated waiting requests", labels=["worker"]),
        }
        for pool in self._pools():
            for e in pool.endpoints.values():
                s = e.stats()
                fams["healthy"].add_metric([e.url], float(e.available))
                fams["inflight"].add_metric([e.url], float(e.inflight))
                fams["spt"].add_metric([e.url], s.seconds_per_token)
                fams["overhead"].add_metric([e.url], s.overhead_s)
                fams["running"].add_metric([e.url], s.running)
                fams["waiting"].add_metric([e.url], s.waiting)
        yield from fams.values()


class RouterMetrics:
    def __init__(self, pools: Callable[[], Iterable[Pool]],
                 buckets: LatencyBuckets | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        b = buckets or LatencyBuckets()
        self.requests = Counter("sluice_router_requests", "requests routed",
                                ["model", "status"], registry=r)
        self.decisions = Counter("sluice_router_decisions", "routing decisions",
                                 ["policy", "worker"], registry=r)
        self.decision_seconds = Histogram("sluice_router_decision_seconds",
                                          "time to choose a worker", ["policy"],
                                          buckets=b.decision, registry=r)
        self.first_byte_seconds = Histogram(
            "sluice_router_first_byte_seconds",
            "time from routing a request to the worker's first body bytes (retries included)",
            ["model"], buckets=b.first_byte, registry=r)
        self.retries = Counter("sluice_router_retries", "attempts retried on another worker",
                               ["worker", "reason"], registry=r)
        self.prompt_tokens = Counter("sluice_router_prompt_tokens", "prompt tokens routed",
                                     ["policy"], registry=r)
        self.prefix_hit_tokens = Counter("sluice_router_estimated_prefix_hit_tokens",
                                         "prompt tokens the router expected cached",
                                         ["policy"], registry=r)
        self.migrations = Counter("sluice_router_migrations",
                                  "streams resumed on another worker after a mid-stream failure",
                                  ["reason"], registry=r)
        self.ejections = Counter("sluice_router_ejections", "workers ejected", ["worker"], registry=r)
        self.readmissions = Counter("sluice_router_readmissions", "workers re-admitted",
                                    ["worker"], registry=r)
        self.kv_events = Counter("sluice_router_kv_events", "KV events applied",
                                 ["worker", "type"], registry=r)
        # flow control (admission.py, breaker.py); their gauges are collectors of their own
        self.admission_wait_seconds = Histogram(
            "sluice_router_admission_wait_seconds",
            "time in the router's admission queue (0 for requests sent at once)",
            ["model", "priority"], buckets=b.queue, registry=r)
        self.admission_shed = Counter("sluice_router_admission_shed",
                                      "requests refused by the admission queue",
                                      ["model", "priority", "reason"], registry=r)
        self.breaker_transitions = Counter("sluice_router_breaker_transitions",
                                           "circuit breaker state changes",
                                           ["worker", "from_state", "to_state"], registry=r)
        self.retry_budget_exhausted = Counter("sluice_router_retry_budget_exhausted",
                                              "retries not made: the pool's budget was spent",
                                              ["model"], registry=r)
        r.register(_WorkerCollector(pools))
        self._children: dict[tuple[Any, ...], Any] = {}

    def _child(self, metric: Any, *labels: str) -> Any:
        key = (id(metric), *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def requests_for(self, model: str, status: int) -> Counter:
        return self._child(self.requests, model, str(status))  # type: ignore[no-any-return]

    def decisions_for(self, policy: str, worker: str) -> Counter:
        return self._child(self.decisions, policy, worker)  # type: ignore[no-any-return]

    def decision_seconds_for(self, policy: str) -> Histogram:
        return self._child(self.decision_seconds, policy)  # type: ignore[no-any-return]

    def first_byte_seconds_for(self, model: str) -> Histogram:
        return self._child(self.first_byte_seconds, model)  # type: ignore[no-any-return]

    def prompt_tokens_for(self, policy: str) -> Counter:
        return self._child(self.prompt_tokens, policy)  # type: ignore[no-any-return]

    def prefix_hit_tokens_for(self, policy: str) -> Counter:
        return self._child(self.prefix_hit_tokens, policy)  # type: ignore[no-any-return]

    def render(self) -> bytes:
        return generate_latest(self.registry)
