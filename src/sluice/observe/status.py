"""The live status page's data: workers, latency percentiles, rates, tenants, errors.

    GET /status        status.html: one static page, no build step, polls the JSON
    GET /status.json   StatusBoard.snapshot(): what the page and `sluice top` show

The board reads what already exists, nothing on the request path changes:

    workers         the router's endpoints (health, in flight, draining) via `workers()`
    worker metrics  each worker's own /metrics, fetched when a snapshot is asked for (at
                    most once per `min_interval_s`): running, waiting, KV usage, prefix
                    hits, TTFT / inter-token latency histograms, finished requests, tokens
    local metrics   the router's (and, under `sluice serve`, the gateway's) registries:
                    responses by status (the router's; the gateway's ok/error/rejected
                    where no router runs), per-tenant requests, tokens and spend
    recent errors   WARNING and above logged by `sluice.*` (a bounded ring, attached
                    while the board is open)

Percentiles and rates are "live": computed over the difference between the newest
scrape and the oldest one inside `window_s` (as Prometheus' `rate` would), falling
back to everything since start while the window holds a single scrape. A window in
which a worker produced no token has no percentiles (None, "–" on the page), as it has
no hit rate, rather than those of requests long gone. Percentiles are interpolated
inside histogram buckets the way `histogram_quantile` does.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

TTFT = "vllm:time_to_first_token_seconds"
ITL = "vllm:inter_token_latency_seconds"
_COUNTERS = {"requests": "vllm:request_success", "generation_tokens": "vllm:generation_tokens",
             "prompt_tokens": "vllm:prompt_tokens", "prefix_queries": "vllm:prefix_cache_queries",
             "prefix_hits": "vllm:prefix_cache_hits"}
_GAUGES = {"running": "vllm:num_requests_running", "waiting": "vllm:num_requests_waiting",
           "kv_usage": "vllm:kv_cache_usage_perc"}

Fetch = Callable[[str], Awaitable[str]]


def page_html() -> str:
    """The status page (static HTML + JS, shipped beside this module)."""
    return resources.files("sluice.observe").joinpath("status.html").read_text("utf-8")


# --------------------------------------------------------------------------- parsing


@dataclass
class Scrape:
    """What one worker's /metrics said, reduced to the few series the board shows."""

    at: float
    counters: dict[str, float] = field(default_factory=dict)
    gauges: dict[str, float] = field(default_factory=dict)
    histograms: dict[str, dict[float, float]] = field(default_factory=dict)  # name: {le: n}


def parse_scrape(text: str, at: float) -> Scrape:
    """Counters and gauges summed over label sets; histogram buckets summed per `le`."""
    scrape = Scrape(at)
    counters = {v: k for k, v in _COUNTERS.items()}
    gauges = {v: k for k, v in _GAUGES.items()}
    for family in text_string_to_metric_families(text):
        if family.name in counters:
            key = counters[family.name]
            scrape.counters[key] = sum(s.value for s in family.samples
                                       if s.name.endswith("_total") or s.name == family.name)
        elif family.name in gauges:
            scrape.gauges[gauges[family.name]] = sum(s.value for s in family.samples)
        elif family.name in (TTFT, ITL):
            buckets: dict[float, float] = {}
            for s in family.samples:
                if s.name.endswith("_bucket"):
                    le = float(s.labels["le"])
                    buckets[le] = buckets.get(le, 0.0) + s.value
            scrape.histograms[family.name] = buckets
    return scrape


def quantile(q: float, buckets: Mapping[float, float]) -> float | None:
    """`histogram_quantile(q, ...)` over cumulative bucket counts {upper bound: count};
    None when there are no observations."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    rank = q * buckets[bounds[-1]]
    lower, below = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if bound == float("inf"):
                return lower  # Prometheus answers the highest finite bound
            inside = count - below
            return lower + (bound - lower) * ((rank - below) / inside if inside else 0.0)
        lower, below = bound, count
    return lower


def _diff(new: Mapping[float, float], old: Mapping[float, float] | None) -> dict[float, float]:
    return {k: v - (old or {}).get(k, 0.0) for k, v in new.items()}


def samples_by_label(texts: Iterable[str], metric: str, label: str) -> dict[str, float]:
    """{label value: summed samples} of one metric family over several exposition texts."""
    out: dict[str, float] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            if family.name != metric:
                continue
            for s in family.samples:
                if s.name == metric or s.name == metric + "_total":
                    key = s.labels.get(label, "")
                    out[key] = out.get(key, 0.0) + s.value
    return out


# --------------------------------------------------------------------------- errors


class RecentErrors(logging.Handler):
    """The last `capacity` WARNING+ records of a logger tree, newest last."""

    def __init__(self, capacity: int = 50) -> None:
        super().__init__(logging.WARNING)
        self.records: deque[dict[str, Any]] = deque(maxlen=capacity)

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append({"time": record.created, "level": record.levelname,
                             "logger": record.name, "message": record.getMessage()[:500]})


# --------------------------------------------------------------------------- the board


class StatusBoard:
    """Snapshots for /status.json; owns the worker scrape history and the error ring.

    `workers()` describes each worker (dicts with at least `url`; the router's
    `admin.describe`); `fetch(url)` returns a worker's /metrics text; `local()` the
    process's own metrics texts (router, gateway). Call `open()` / `close()` around its
    life (they attach and detach the log handler). Event-loop use only.
    """

    def __init__(self, workers: Callable[[], list[dict[str, Any]]], fetch: Fetch,
                 local: Callable[[], list[str]], *, window_s: float = 60.0,
                 min_interval_s: float = 1.0, logger: str = "sluice") -> None:
        self.workers, self.fetch, self.local = workers, fetch, local
        self.window_s, self.min_interval_s = window_s, min_interval_s
        self.history: dict[str, deque[Scrape]] = {}
        self.errors = RecentErrors()
        self.logger = logging.getLogger(logger)
        self.started = time.time()
        self._last: dict[str, Any] | None = None
        self._lock = asyncio.Lock()

    def open(self) -> None:
        self.logger.addHandler(self.errors)

    def close(self) -> None:
        self.logger.removeHandler(self.errors)

    async def snapshot(self, admin: bool = False) -> dict[str, Any]:
        """The board's JSON; workers are scraped again only after `min_interval_s`."""
        async with self._lock:
            if self._last is None or time.time() - self._last["time"] >= self.min_interval_s:
                self._last = await self._build()
        snap = dict(self._last)
        if admin:
            snap["tenants"] = self._tenants()
        return snap

    async def _build(self) -> dict[str, Any]:
        now = time.time()
        described = self.workers()
        texts = await asyncio.gather(*(self._fetch(w["url"]) for w in described))
        rows = [self._worker_row(w, text, now) for w, text in zip(described, texts, strict=True)]
        for url in set(self.history) - {w["url"] for w in described}:
            del self.history[url]  # removed workers
        local = self.local()
        responses = samples_by_label(local, "sluice_router_requests", "status") \
            or samples_by_label(local, "sluice_gateway_requests", "status")  # no router
        return {"time": now, "uptime_s": now - self.started, "workers": rows,
                "totals": self._totals(rows), "responses": responses,
                "errors": list(self.errors.records)[-20:]}

    async def _fetch(self, url: str) -> str | None:
        try:
            return await self.fetch(url.rstrip("/") + "/metrics")
        except Exception as exc:  # a dead worker is a row with no numbers, not a failure
            logging.getLogger(__name__).debug("status scrape of %s failed: %s", url, exc)
            return None

    def _worker_row(self, described: dict[str, Any], text: str | None,
                    now: float) -> dict[str, Any]:
        row = dict(described, reachable=text is not None)
        if text is None:
            return row
        history = self.history.setdefault(described["url"], deque())
        history.append(parse_scrape(text, now))
        while len(history) > 2 and now - history[1].at >= self.window_s:
            history.popleft()
        new, old = history[-1], history[0] if len(history) > 1 else None
        row.update(new.gauges)
        row.update(_window(new, old))
        return row

    @staticmethod
    def _totals(rows: list[dict[str, Any]]) -> dict[str, Any]:
        def total(key: str) -> float:
            return sum(float(r.get(key) or 0.0) for r in rows)

        return {"workers": len(rows), "healthy": sum(bool(r.get("healthy")) for r in rows),
                "running": total("running"), "waiting": total("waiting"),
                "requests_per_s": total("requests_per_s"), "tokens_per_s": total("tokens_per_s")}

    def _tenants(self) -> list[dict[str, Any]]:
        local = self.local()
        requests = samples_by_label(local, "sluice_gateway_requests", "tenant")
        spend = samples_by_label(local, "sluice_gateway_spend_usd", "tenant")
        tokens = samples_by_label(local, "sluice_gateway_tokens", "tenant")
        return [{"tenant": t, "requests": requests.get(t, 0.0), "tokens": tokens.get(t, 0.0),
                 "spend_usd": spend.get(t, 0.0)} for t in sorted(requests)]


def _window(new: Scrape, old: Scrape | None) -> dict[str, Any]:
    """Rates, hit rate and percentiles between two scrapes (since start without `old`)."""
    span = new.at - old.at if old is not None else 0.0
    delta = {k: v - (old.counters.get(k, 0.0) if old else 0.0) for k, v in new.counters.items()}
    out: dict[str, Any] = {"window_s": span}
    if span > 0:
        out["requests_per_s"] = delta.get("requests", 0.0) / span
        out["tokens_per_s"] = delta.get("generation_tokens", 0.0) / span
    queries = delta.get("prefix_queries", 0.0)
    out["hit_rate"] = delta.get("prefix_hits", 0.0) / queries if queries > 0 else None
    for key, name in (("ttft", TTFT), ("itl", ITL)):  # None when the window saw nothing
        buckets = _diff(new.histograms.get(name, {}), old.histograms.get(name) if old else None)
        out[f"{key}_p50"] = quantile(0.5, buckets)
        out[f"{key}_p99"] = quantile(0.99, buckets)
    return out
