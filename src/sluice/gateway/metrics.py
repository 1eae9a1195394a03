"""Gateway metrics in their own Prometheus registry (one per gateway, no globals).

Names follow Prometheus conventions under `sluice_gateway_`; the middleware appends
this registry's text to the upstream's `/metrics`, so one scrape sees both.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from sluice.observe.buckets import LatencyBuckets


class GatewayMetrics:
    """Counters the middleware updates; each method says what happened, not how."""

    def __init__(self, buckets: LatencyBuckets | None = None) -> None:
        buckets = buckets or LatencyBuckets()
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("sluice_gateway_requests_total",
                                "Requests that passed authentication, by tenant and final status",
                                ["tenant", "status"], registry=r)
        self.rejections = Counter("sluice_gateway_rejections_total",
                                  "Requests refused by the gateway, by reason", ["reason"],
                                  registry=r)
        self.tokens = Counter("sluice_gateway_tokens_total", "Tokens metered, by tenant and kind",
                              ["tenant", "kind"], registry=r)
        self.spend = Counter("sluice_gateway_spend_usd_total", "Spend recorded, in USD",
                             ["tenant"], registry=r)
        self.soft_budget = Counter("sluice_gateway_soft_budget_exceeded_total",
                                   "Requests admitted while the tenant is past its soft budget",
                                   ["tenant"], registry=r)
        self.budget_used = Gauge("sluice_gateway_budget_used_ratio",
                                 "Spend over budget of each budgeted tenant, as of its last "
                                 "request (1 = exhausted)", ["tenant"], registry=r)
        self.limiter_errors = Counter("sluice_gateway_limiter_errors_total",
                                      "Rate-limiter store errors, by failure mode applied",
                                      ["mode"], registry=r)
        self.ledger_errors = Counter("sluice_gateway_ledger_errors_total",
                                     "Usage records dropped: refused by the database, beyond "
                                     "the retry buffer, or still waiting at shutdown",
                                     registry=r)
        self.ledger_waiting = Gauge("sluice_gateway_ledger_waiting",
                                    "Usage records kept in memory until the database is back",
                                    registry=r)
        self.inflight = Gauge("sluice_gateway_requests_in_flight", "Requests in flight",
                              registry=r)
        self.background = Gauge("sluice_gateway_background_responses",
                                "Background responses (the Responses API's `background`) "
                                "this gateway is running", registry=r)
        self.background_lost = Counter(
            "sluice_gateway_background_responses_lost_total",
            "Background responses whose gateway replica stopped renewing them (killed), "
            "ended by this gateway ('failed', or 'cancelled' by a cancel)", registry=r)
        self.overhead = Histogram("sluice_gateway_admission_seconds",
                                  "Time from request arrival to forwarding upstream", registry=r,
                                  buckets=buckets.admission)

        self._children: dict[tuple[Any, ...], Any] = {}

    def child(self, metric: Counter | Gauge, *labels: str) -> Any:
        """`metric.labels(*labels)`, looked up once per label set (the per-request path
        skips prometheus_client's label validation and lock)."""
        key = (id(metric), *labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def settled(self, tenant: str, status: str, prompt: int, completion: int,
                cost_usd: float) -> None:
        """Count one settled request (its ledger row written, waiting or dropped)."""
        self.child(self.requests, tenant, status).inc()
        self.child(self.tokens, tenant, "prompt").inc(prompt)
        self.child(self.tokens, tenant, "completion").inc(completion)
        self.child(self.spend, tenant).inc(cost_usd)

    def render(self) -> bytes:
        return generate_latest(self.registry)
