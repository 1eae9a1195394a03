"""The planner's inputs, read from the router's live state and the workers' /metrics.

    router Pool (per endpoint)   ready, in flight, waiting / running estimates, prefill
                                 tokens queued, KV usage, mean prompt, learned TTFT line
    RequestBuffer                requests held for want of a ready worker
    router RoleTable (pd.py)     a disaggregated pool's sides: prefill queue and busy,
                                 decode running, waiting and KV usage (`pd_signals`)
    workers' /metrics            vllm:time_to_first_token_seconds (histogram) -> p90
                                 vllm:inter_token_latency_seconds (sum, count) -> mean
                                 over the last `window_s`, from each worker's deltas

The latency window keeps each worker's cumulative histogram snapshots and differences
the newest against the oldest inside the window, so a worker that joins or leaves
changes only its own contribution (summing cumulative counts over a changing set of
workers would go backwards). The p90 is interpolated within its bucket, as
Prometheus' `histogram_quantile` does.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from sluice.control.planner import PDSignals, PoolSignals
from sluice.router.buffer import RequestBuffer
from sluice.router.config import PREFILL
from sluice.router.endpoints import Endpoint
from sluice.router.pd import RoleTable
from sluice.router.pool import Pool

TTFT = "vllm:time_to_first_token_seconds"
ITL = "vllm:inter_token_latency_seconds"


@dataclass(frozen=True)
class LatencySnapshot:
    """One worker's cumulative latency counters at one scrape."""

    ttft_buckets: tuple[tuple[float, float], ...] = ()  # (le, cumulative count), sorted
    itl_sum: float = 0.0
    itl_count: float = 0.0

    def minus(self, older: LatencySnapshot) -> LatencySnapshot:
        old = dict(older.ttft_buckets)
        buckets = tuple((le, max(0.0, c - old.get(le, 0.0))) for le, c in self.ttft_buckets)
        return LatencySnapshot(buckets, max(0.0, self.itl_sum - older.itl_sum),
                               max(0.0, self.itl_count - older.itl_count))


def parse_latency(text: str) -> LatencySnapshot:
    """TTFT buckets and ITL sum/count from a worker's Prometheus text (summed over labels)."""
    buckets: dict[float, float] = {}
    itl_sum = itl_count = 0.0
    for family in text_string_to_metric_families(text):
        if family.name not in (TTFT, ITL):
            continue
        for sample in family.samples:
            if family.name == TTFT and sample.name.endswith("_bucket"):
                le = float(sample.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + sample.value
            elif family.name == ITL and sample.name.endswith("_sum"):
                itl_sum += sample.value
            elif family.name == ITL and sample.name.endswith("_count"):
                itl_count += sample.value
    return LatencySnapshot(tuple(sorted(buckets.items())), itl_sum, itl_count)


def histogram_quantile(q: float, buckets: Iterable[tuple[float, float]]) -> float | None:
    """The q-quantile of cumulative `(le, count)` buckets, linear within a bucket; None
    without observations. A quantile in the +Inf bucket reads as the last finite bound."""
    ordered = sorted(buckets)
    total = ordered[-1][1] if ordered else 0.0
    if total <= 0:
        return None
    rank, lower, below = q * total, 0.0, 0.0
    for le, count in ordered:
        if count >= rank:
            if math.isinf(le):
                return lower
            inside = count - below
            return lower + (le - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = le, count
    return lower


@dataclass
class LatencyWindow:
    """Per-worker snapshots over the last `window_s` seconds; owned by one controller."""

    window_s: float = 30.0
    history: dict[str, deque[tuple[float, LatencySnapshot]]] = field(default_factory=dict)

    def observe(self, worker: str, now: float, snap: LatencySnapshot) -> None:
        past = self.history.setdefault(worker, deque())
        past.append((now, snap))
        while len(past) > 2 and past[1][0] <= now - self.window_s:
            past.popleft()

    def forget(self, live: Iterable[str]) -> None:
        keep = set(live)
        for worker in [w for w in self.history if w not in keep]:
            del self.history[worker]

    def delta(self) -> LatencySnapshot:
        """The window's observations, summed over workers."""
        buckets: dict[float, float] = {}
        itl_sum = itl_count = 0.0
        for past in self.history.values():
            d = past[-1][1].minus(past[0][1])
            for le, c in d.ttft_buckets:
                buckets[le] = buckets.get(le, 0.0) + c
            itl_sum, itl_count = itl_sum + d.itl_sum, itl_count + d.itl_count
        return LatencySnapshot(tuple(sorted(buckets.items())), itl_sum, itl_count)

    def ttft_p90(self) -> float | None:
        return histogram_quantile(0.9, self.delta().ttft_buckets)

    def itl_mean(self) -> float | None:
        d = self.delta()
        return d.itl_sum / d.itl_count if d.itl_count > 0 else None


def pool_signals(name: str, pool: Pool, buffer: RequestBuffer, starting: int,
                 latency: LatencyWindow | None = None) -> PoolSignals:
    """One pool's `PoolSignals` now: sums over its endpoints (draining ones count for
    their in-flight work, not as ready), the buffer's queue, the latency window."""
    endpoints = list(pool.endpoints.values())
    ready = [e for e in endpoints if e.available]
    stats = [e.stats() for e in endpoints]
    prompts = [e.prompt_avg for e in endpoints if e.prompt_avg > 0]
    return PoolSignals(
        pool=name, ready=len(ready), starting=starting, queued=buffer.queued(pool),
        inflight=sum(e.inflight for e in endpoints),
        waiting=sum(s.waiting for s in stats), running=sum(s.running for s in stats),
        queued_prefill_tokens=sum(s.queued_prefill_tokens
                                  + s.external_waiting * s.mean_prompt_tokens for s in stats),
        kv_usage=sum(e.scraped.kv_usage for e in ready) / len(ready) if ready else 0.0,
        mean_prompt_tokens=sum(prompts) / len(prompts) if prompts else 0.0,
        seconds_per_token=pool.fit.slope, overhead_s=pool.fit.overhead,
        ttft_p90_s=latency.ttft_p90() if latency else None,
        itl_s=latency.itl_mean() if latency else None,
        prefix_hit_rate=_hit_rate(endpoints))


def _hit_rate(endpoints: Iterable[Endpoint]) -> float | None:
    """Prefix-cache hits over queries, as the workers count them (since they started)."""
    queries = sum(e.scraped.prefix_queries for e in endpoints)
    hits = sum(e.scraped.prefix_hits for e in endpoints)
    return hits / queries if queries > 0 else None


def pd_signals(name: str, pool: Pool, roles: RoleTable) -> PDSignals:
    """A disaggregated pool's per-side load (`PDSignals`) from the router's endpoints and
    the roles it last read (available workers only; `both` counts as decode)."""
    prefill = [e for e in pool.endpoints.values() if e.available and roles.get(e).role == PREFILL]
    decode = [e for e in pool.endpoints.values() if e.available and roles.get(e).role != PREFILL]
    ps, ds = [e.stats() for e in prefill], [e.stats() for e in decode]
    return PDSignals(
        pool=name, prefill_workers=len(prefill), decode_workers=len(decode),
        prefill_inflight=sum(e.inflight for e in prefill),
        prefill_queued_tokens=sum(s.queued_prefill_tokens
                                  + s.external_waiting * s.mean_prompt_tokens for s in ps),
        prefill_seconds_per_token=(sum(s.seconds_per_token for s in ps) / len(ps) if ps
                                   else pool.fit.slope),
        decode_running=sum(s.running for s in ds), decode_waiting=sum(s.waiting for s in ds),
        decode_kv_usage=sum(s.kv_usage for s in ds) / len(ds) if ds else 0.0)
