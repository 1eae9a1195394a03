"""Releases: a pool's canary and shadow, and the judge that rolls a canary back or
promotes it.

A pool's workers each carry a version (`WorkerSpec.version`): the baseline, a canary,
or a shadow. A pool with a canary or shadow worker routes through its `Release`:

    Release.forward(req, meta, headers)
      version   x-sluice-version header > tenant pin (x-sluice-tenant) > weighted split,
                sticky per session key (the same session stays on one version)
      shadow    a sampled copy to the least-busy shadow worker, read and discarded in a
                task of its own; past `shadow_max_concurrency` copies in flight it is
                dropped (counted), so a slow shadow never holds primary traffic
      forward   Proxy.forward with meta.version: the pool's policy among that version's
                workers; a weighted canary request that fails falls back to the baseline
                once (the client gets the baseline's answer; the canary its error)
      record    error or first-byte time at once; inter-chunk time when the stream ends

    every second: Releases.evaluate -> Release.evaluate(now)
      samples of the last `window_s` seconds per version, plus per-scrape prefix-hit
      rates of each worker; canary vs baseline (release_stats.py):
      errors, TTFT p90, TPOT p90, prefix-hit rate
        a regression                 -> roll back: weight 0, reason and statistics kept
        canary workers, each ejected or its breaker not closed, for 2 x the breakers'
        `open_s`                     -> roll back: "canary circuit open"
        no canary worker (none yet, all draining) -> wait: nothing to judge
        healthy for `window_s` at a step, enough samples -> the next step (5, 25, 50, 100)

A request that wanted the canary while none of its workers can take one (ejected, or
its breaker open) goes to the baseline and is no sample: it says nothing new about
the canary, and counting it as an error would let a few failures that opened a breaker
count once per refused request.

Shadow responses never reach the client: the relay the front end writes is the
primary's alone (its body, its usage, its headers), which is all the gateway meters.
Everything here runs on the event loop; nothing locks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
import zlib
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sluice.protocol.errors import InvalidRequestError, NotFoundError, ServiceUnavailableError
from sluice.router.breaker import CLOSED, Breakers
from sluice.router.config import BASELINE, CANARY, SHADOW, ReleaseConfig
from sluice.router.endpoints import Endpoint
from sluice.router.parse import ParsedRequest
from sluice.router.policies import RequestMeta
from sluice.router.pool import Pool
from sluice.router.proxy import Proxy, Relay
from sluice.router.release_stats import (
    Verdict,
    compare_errors,
    compare_hit_rates,
    compare_latency,
    quantile,
)
from sluice.router.upstream import Target, UpstreamError, UpstreamPool

log = logging.getLogger(__name__)

VERSION_HEADER = b"x-sluice-version"
TENANT_HEADER = b"x-sluice-tenant"
SHADOW_HEADER = b"x-sluice-shadow: 1\r\n"
EVALUATE_EVERY_S = 1.0
# Samples kept per version and metric (the most recent in the window): plenty of power
# for the tests, and a bound on the judge's time on the event loop (~4 ms per latency
# comparison at 5,000 a side; 113 ms at 100,000).
MAX_SAMPLES = 5000
KEEP_DECISIONS = 20

IDLE, RUNNING, PAUSED, ROLLED_BACK, PROMOTED = (
    "idle", "running", "paused", "rolled_back", "promoted")


class Series:
    """(time, value) samples, oldest first, pruned to a sliding window; the oldest
    also go once there are MAX_SAMPLES."""

    def __init__(self) -> None:
        self.items: deque[tuple[float, Any]] = deque(maxlen=MAX_SAMPLES)

    def add(self, at: float, value: Any) -> None:
        self.items.append((at, value))

    def prune(self, cutoff: float) -> None:
        while self.items and self.items[0][0] < cutoff:
            self.items.popleft()

    def values(self) -> list[Any]:
        return [v for _, v in self.items]

    def clear(self) -> None:
        self.items.clear()


@dataclass
class VersionWindow:
    """One version's samples in the window."""

    errors: Series = field(default_factory=Series)  # bool per request: failed
    ttft: Series = field(default_factory=Series)  # seconds to the first body bytes
    tpot: Series = field(default_factory=Series)  # seconds between a stream's chunks
    prefix_hits: Series = field(default_factory=Series)  # hit rate per worker and scrape

    def series(self) -> tuple[Series, ...]:
        return (self.errors, self.ttft, self.tpot, self.prefix_hits)

    def summary(self) -> dict[str, Any]:
        errors, ttft, tpot, hits = (s.values() for s in self.series())
        return {
            "requests": len(errors), "errors": sum(errors),
            "error_rate": sum(errors) / len(errors) if errors else None,
            "ttft_p50_s": quantile(ttft, 0.5) if ttft else None,
            "ttft_p90_s": quantile(ttft, 0.9) if ttft else None,
            "tpot_p90_s": quantile(tpot, 0.9) if tpot else None,
            "prefix_hit_rate": sum(hits) / len(hits) if hits else None,
            "prefix_hit_samples": len(hits),
        }


@dataclass(frozen=True)
class Decision:
    """A change of the canary's weight or state, automatic or by hand, and why."""

    action: str  # rollback | promote | start | pause | resume | set_weight
    reason: str
    weight: float
    at: float  # wall-clock seconds
    verdicts: tuple[Verdict, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"action": self.action, "reason": self.reason, "weight": self.weight,
                "at": self.at, "statistics": [v.to_dict() for v in self.verdicts]}


class ReleaseMetrics:
    """The releases' Prometheus metrics, in the router's registry."""

    def __init__(self, registry: CollectorRegistry, releases: Callable[[], Iterable[Release]]
                 ) -> None:
        r = registry
        self.rollbacks = Counter("sluice_router_release_rollbacks",
                                 "canaries rolled back (weight set to 0)", ["pool", "reason"],
                                 registry=r)
        self.promotions = Counter("sluice_router_release_promotions",
                                  "canary weight steps up", ["pool"], registry=r)
        self.requests = Counter("sluice_router_release_requests",
                                "requests per release version and outcome",
                                ["pool", "version", "outcome"], registry=r)
        self.shadow_requests = Counter("sluice_router_shadow_requests",
                                       "copies sent to shadow workers", ["pool", "outcome"],
                                       registry=r)
        self.shadow_dropped = Counter("sluice_router_shadow_dropped",
                                      "copies not sent (concurrency bound, no shadow worker)",
                                      ["pool", "reason"], registry=r)
        r.register(_WeightCollector(releases))


class _WeightCollector(Collector):
    def __init__(self, releases: Callable[[], Iterable[Release]]) -> None:
        self._releases = releases

    def collect(self) -> Iterator[Metric]:
        gauge = GaugeMetricFamily("sluice_router_canary_weight",
                                  "percent of a pool's traffic routed to its canary",
                                  labels=["pool"])
        for release in self._releases():
            gauge.add_metric([release.name], release.weight)
        yield gauge


def version_asked(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The version the request's `x-sluice-version` header pins (None: no header);
    400 for anything but baseline or canary."""
    asked = next((v.decode("latin-1").strip().lower() for n, v in headers
                  if n == VERSION_HEADER), None)
    if asked is not None and asked not in (BASELINE, CANARY):
        raise InvalidRequestError(f"x-sluice-version must be {BASELINE!r} or {CANARY!r}, "
                                  f"got {asked!r}", param="x-sluice-version")
    return asked


def pool_name(pool: Pool) -> str:
    """The name a pool goes by in release metrics and the admin path."""
    return pool.config.model or next(iter(pool.names()), "default")


class Release:
    """One pool's canary weight, pins, shadow and judge. Touched only on the event loop."""

    def __init__(self, pool: Pool, upstream: UpstreamPool, breakers: Breakers,
                 metrics: ReleaseMetrics, rng: random.Random, clock: Callable[[], float],
                 timer: Callable[[], float] = time.perf_counter) -> None:
        """`clock`: event times (the window, step dwell; tests pass their own);
        `timer`: latencies."""
        self.pool = pool
        self.config: ReleaseConfig = pool.config.release
        self.name = pool_name(pool)
        self.upstream = upstream
        self.breakers = breakers
        self.metrics = metrics
        self.rng = rng
        self.clock = clock
        self.timer = timer
        self.weight = self.config.canary_weight
        self.state = RUNNING if 0 < self.weight < 100 else PROMOTED if self.weight else IDLE
        self.step_at = clock()
        self.circuit_open_since: float | None = None  # every canary worker failing, since
        self.windows = {v: VersionWindow() for v in (BASELINE, CANARY, SHADOW)}
        self.decisions: deque[Decision] = deque(maxlen=KEEP_DECISIONS)
        self.verdicts: tuple[Verdict, ...] = ()
        self.shadow_inflight = 0
        self.shadow_tasks: set[asyncio.Task[None]] = set()
        self._hits_seen: dict[str, tuple[float, float]] = {}  # url -> (queries, hits)

    # --- the request path -----------------------------------------------------------------

    def choose_version(self, req: ParsedRequest, headers: list[tuple[bytes, bytes]]
                       ) -> tuple[str, bool]:
        """(version, pinned by header). Header pins are kept even after a rollback (an
        operator testing by hand); tenant pins and the split are not."""
        asked = version_asked(headers)
        if asked is not None:
            return asked, True
        tenant = next((v.decode("latin-1") for n, v in headers if n == TENANT_HEADER), None)
        pinned = self.config.pin_tenants.get(tenant) if tenant is not None else None
        if pinned is not None and self.state != ROLLED_BACK:
            version = pinned
        else:
            version = CANARY if self._in_canary(req.session_key) else BASELINE
        if version == CANARY and not self.has_available(CANARY):
            version = BASELINE
        return version, False

    def _in_canary(self, session_key: str | None) -> bool:
        """The weighted split: a session hashes to a fixed point in [0, 100), so raising
        the weight only moves sessions to the canary, never back and forth."""
        if self.weight <= 0:
            return False
        if self.weight >= 100:
            return True
        if session_key is not None:
            return zlib.crc32(session_key.encode()) % 10_000 < self.weight * 100
        return bool(self.rng.random() * 100 < self.weight)

    def has_available(self, version: str) -> bool:
        """Whether a worker of `version` can take a request now: healthy, not draining,
        its breaker not blocking it (an open breaker past `open_s` turns half-open here,
        as at the proxy's next decision)."""
        blocked = self.breakers.blocked(self.pool)
        return any(e.available and e.spec.version == version and e.url not in blocked
                   for e in self.pool.endpoints.values())

    async def forward(self, proxy: Proxy, req: ParsedRequest, meta: RequestMeta, path: bytes,
                      block: bytes, headers: list[tuple[bytes, bytes]],
                      chosen: tuple[str, bool] | None = None,
                      held: frozenset[str] | None = None) -> Relay:
        """Route one request of this pool (see the module docstring); mutates the window
        and starts a shadow copy when sampled. `chosen`: `choose_version`'s answer if the
        caller asked already; `held`: the workers holding the request's LoRA adapter
        (None: not an adapter), the only ones of a version that holds it it may go to."""
        version, pinned = chosen or self.choose_version(req, headers)
        if self.config.shadow_percent and self.rng.random() * 100 < self.config.shadow_percent:
            self.start_shadow(req, meta, path, block, held)
        reachable = self.has_available(version)  # else a refusal, not a sample
        start = self.timer()
        try:
            relay = await proxy.forward(self.pool, req, replace(meta, version=version), path,
                                        block, self._without_adapter(version, held))
        except ServiceUnavailableError:
            if reachable:
                self._outcome(version, failed=True)
            if pinned or version == BASELINE:
                raise
            version = BASELINE  # the canary failed: the baseline answers, unmeasured
            relay = await proxy.forward(self.pool, req, replace(meta, version=version), path,
                                        block, self._without_adapter(version, held))
            relay.headers.append((VERSION_HEADER, version.encode()))
            return relay
        first_byte = self.timer()
        if relay.status < 400:
            self.windows[version].ttft.add(self.clock(), first_byte - start)
        relay.headers.append((VERSION_HEADER, version.encode()))
        relay.on_close = lambda ended: self._stream_ended(version, ended, first_byte, req.stream)
        return relay

    def _without_adapter(self, version: str, held: frozenset[str] | None) -> tuple[str, ...]:
        """The workers an adapter request must not go to: those without the adapter, when
        a worker of `version` holds it (else none: a worker answers, 404 if it lacks it)."""
        if held is None or not any(self.pool.endpoints[u].spec.version == version
                                   for u in held if u in self.pool.endpoints):
            return ()
        return tuple(u for u in self.pool.endpoints if u not in held)

    def _stream_ended(self, version: str, relay: Relay, first_byte: float, stream: bool) -> None:
        """The relay closed: a worker failure mid-stream is an error; a client that went
        away counts as nothing; a complete stream gives its mean inter-chunk time. (A
        migrated stream's relay is the MigratingRelay: a failure it survived counts.)"""
        if relay.upstream.error is not None or relay.migrations:
            self._outcome(version, failed=True)
        elif relay.complete:
            self._outcome(version, failed=relay.status >= 500)
            if stream and relay.chunks:
                self.windows[version].tpot.add(self.clock(),
                                               (self.timer() - first_byte) / relay.chunks)

    def _outcome(self, version: str, failed: bool) -> None:
        self.windows[version].errors.add(self.clock(), failed)
        self.metrics.requests.labels(self.name, version, "error" if failed else "ok").inc()

    # --- shadow ---------------------------------------------------------------------------

    def start_shadow(self, req: ParsedRequest, meta: RequestMeta, path: bytes,
                     block: bytes, held: frozenset[str] | None = None) -> None:
        """Send a copy to a shadow worker in a task of its own, or count it dropped. A
        copy of an adapter request (`held`: its holders) goes only to a shadow worker
        holding the adapter (one without would answer with the base model or a 404)."""
        shadows = [e for e in self.pool.endpoints.values()
                   if e.available and e.spec.version == SHADOW]
        if not shadows:
            self.metrics.shadow_dropped.labels(self.name, "no_worker").inc()
            return
        if held is not None:
            shadows = [e for e in shadows if e.url in held]
            if not shadows:
                self.metrics.shadow_dropped.labels(self.name, "no_adapter").inc()
                return
        if self.shadow_inflight >= self.config.shadow_max_concurrency:
            self.metrics.shadow_dropped.labels(self.name, "concurrency").inc()
            return
        endpoint = min(shadows, key=lambda e: e.inflight)
        self.shadow_inflight += 1
        task = asyncio.create_task(self._shadow(endpoint, req, meta, path, block))
        self.shadow_tasks.add(task)
        task.add_done_callback(self.shadow_tasks.discard)

    async def _shadow(self, endpoint: Endpoint, req: ParsedRequest, meta: RequestMeta,
                      path: bytes, block: bytes) -> None:
        """One shadow exchange: read the whole response, record it, drop it."""
        model = self.pool.upstream_model(req.model, endpoint)
        body = req.raw if model == req.model else _with_model(req, model)
        target = Target.of(endpoint.url)
        payload = b"".join((b"POST ", target.prefix, path, b" HTTP/1.1\r\n", target.host_line,
                            block, SHADOW_HEADER, b"Content-Length: %d\r\n\r\n" % len(body),
                            body))
        ticket = endpoint.begin(meta.num_prompt_tokens, meta.num_prompt_tokens, 0.0)
        window = self.windows[SHADOW]
        start = self.timer()
        failed = True
        try:
            conn = await self.upstream.send(target, payload)
            try:
                await conn.read()
                if conn.status < 400:
                    window.ttft.add(self.clock(), self.timer() - start)
                while await conn.read():
                    pass
                failed = conn.status >= 500
            finally:
                conn.release()
        except UpstreamError as exc:
            log.debug("shadow copy to %s failed: %s", endpoint.url, exc)
        finally:
            endpoint.finish(ticket)
            self.shadow_inflight -= 1
        window.errors.add(self.clock(), failed)
        self.metrics.shadow_requests.labels(self.name, "error" if failed else "ok").inc()

    # --- the judge ------------------------------------------------------------------------

    def evaluate(self, now: float) -> Decision | None:
        """Sample prefix hits, slide the window, compare; roll back or promote when due."""
        self._sample_prefix_hits(now)
        for window in self.windows.values():
            for series in window.series():
                series.prune(now - self.config.window_s)
        self.verdicts = self.compare()
        if self.state != RUNNING or not self.config.auto:
            self.circuit_open_since = None
            return None
        regressed = [v for v in self.verdicts if v.regressed]
        if regressed:
            names = ", ".join(v.metric for v in regressed)
            return self.rollback(regressed[0].metric, f"canary regressed on {names}")
        workers = [e for e in self.pool.endpoints.values()
                   if e.spec.version == CANARY and not e.draining]
        if not workers:  # not deployed yet, or drained: not a regression, nothing to promote
            self.circuit_open_since = None
            return None
        if not any(e.healthy and self.breakers.state(e.url) == CLOSED for e in workers):
            return self._circuit_open(now)
        self.circuit_open_since = None
        errors = self.verdicts[0]
        if errors.enough and now - self.step_at >= self.config.window_s:
            return self.promote(f"healthy for {self.config.window_s:g}s at {self.weight:g}%")
        return None

    @property
    def circuit_grace_s(self) -> float:
        """How long every canary worker may be failing (breaker open or half-open, or
        ejected) before that alone rolls it back: two breaker cool-downs, so a breaker
        that a burst of failures opened has gone half-open and had its trials."""
        return 2 * self.breakers.config.open_s

    def _circuit_open(self, now: float) -> Decision | None:
        """Every canary worker is failing: roll back once it has lasted the grace."""
        if self.circuit_open_since is None:
            self.circuit_open_since = now
        if now - self.circuit_open_since < self.circuit_grace_s:
            return None
        return self.rollback("circuit_open", f"canary circuit open for "
                             f"{now - self.circuit_open_since:g}s: every canary worker is "
                             f"ejected or its breaker is not closed")

    def compare(self) -> tuple[Verdict, ...]:
        c, b, cfg = self.windows[CANARY], self.windows[BASELINE], self.config
        args = (cfg.alpha, cfg.min_samples)
        return (
            compare_errors(c.errors.values(), b.errors.values(), cfg.error_margin, *args),
            compare_latency("ttft_p90", c.ttft.values(), b.ttft.values(), cfg.latency_margin,
                            *args),
            compare_latency("tpot_p90", c.tpot.values(), b.tpot.values(), cfg.latency_margin,
                            *args),
            compare_hit_rates(c.prefix_hits.values(), b.prefix_hits.values(),
                              cfg.prefix_hit_margin, *args),
        )

    def _sample_prefix_hits(self, now: float) -> None:
        """Each worker's prefix-cache hit rate since the last look, from its scraped
        counters (vllm:prefix_cache_queries/hits); nothing when it served no queries."""
        for endpoint in self.pool.endpoints.values():
            load = endpoint.load
            queries, hits = self._hits_seen.get(endpoint.url, (0.0, 0.0))
            self._hits_seen[endpoint.url] = (load.prefix_queries, load.prefix_hits)
            dq, dh = load.prefix_queries - queries, load.prefix_hits - hits
            if dq > 0 and 0 <= dh <= dq:
                self.windows[endpoint.spec.version].prefix_hits.add(now, dh / dq)

    # --- changes --------------------------------------------------------------------------

    def _decide(self, action: str, reason: str) -> Decision:
        decision = Decision(action, reason, self.weight, time.time(), self.verdicts)
        self.decisions.append(decision)
        return decision

    def rollback(self, metric: str, reason: str) -> Decision:
        """Weight 0 (header pins still reach the canary); kept until started again."""
        self.weight = 0.0
        self.state = ROLLED_BACK
        self.metrics.rollbacks.labels(self.name, metric).inc()
        log.warning("pool %s: canary rolled back: %s", self.name, reason)
        return self._decide("rollback", reason)

    def promote(self, reason: str) -> Decision:
        """The next step above the current weight (100: the canary takes all traffic)."""
        self.weight = next((s for s in self.config.steps if s > self.weight), 100.0)
        self.step_at = self.clock()
        self.state = PROMOTED if self.weight >= 100 else RUNNING
        self.metrics.promotions.labels(self.name).inc()
        log.info("pool %s: canary promoted to %g%%: %s", self.name, self.weight, reason)
        return self._decide("promote", reason)

    def start(self) -> Decision:
        """Start (or restart, after a rollback) at the first step, with an empty window."""
        for window in self.windows.values():
            for series in window.series():
                series.clear()
        self.weight = self.weight if 0 < self.weight < 100 else self.config.steps[0]
        self.state = RUNNING
        self.step_at = self.clock()
        return self._decide("start", "by hand")

    def set_weight(self, weight: float) -> Decision:
        if not 0 <= weight <= 100:
            raise InvalidRequestError(f"weight must be in [0, 100], got {weight}", param="weight")
        self.weight = float(weight)
        self.step_at = self.clock()
        if self.state != PAUSED:
            self.state = RUNNING if 0 < weight < 100 else PROMOTED if weight else IDLE
        return self._decide("set_weight", "by hand")

    def pause(self) -> Decision:
        self.state = PAUSED
        return self._decide("pause", "by hand")

    def resume(self) -> Decision:
        self.state = RUNNING if 0 < self.weight < 100 else PROMOTED if self.weight else IDLE
        self.step_at = self.clock()
        return self._decide("resume", "by hand")

    def describe(self) -> dict[str, Any]:
        """The admin view: weights, workers, window statistics, decisions."""
        workers: dict[str, list[str]] = {BASELINE: [], CANARY: [], SHADOW: []}
        for e in self.pool.endpoints.values():
            workers[e.spec.version].append(e.url)
        last = self.decisions[-1].to_dict() if self.decisions else None
        cfg = self.config
        return {
            "pool": self.name, "state": self.state, "weight": self.weight,
            "steps": list(cfg.steps), "auto": cfg.auto, "window_s": cfg.window_s,
            "min_samples": cfg.min_samples, "alpha": cfg.alpha,
            "margins": {"errors": cfg.error_margin, "latency": cfg.latency_margin,
                        "prefix_hit_rate": cfg.prefix_hit_margin},
            "pin_tenants": dict(cfg.pin_tenants), "workers": workers,
            "shadow": {"percent": cfg.shadow_percent,
                       "max_concurrency": cfg.shadow_max_concurrency,
                       "inflight": self.shadow_inflight},
            "window": {v: w.summary() for v, w in self.windows.items()},
            "comparison": [v.to_dict() for v in self.verdicts],
            "last_decision": last, "decisions": [d.to_dict() for d in self.decisions],
        }


def _with_model(req: ParsedRequest, model: str) -> bytes:
    return json.dumps({**req.body, "model": model}).encode()


class Releases:
    """Every pool's `Release`, made on first use; the judge's loop."""

    def __init__(self, pools: Callable[[], list[Pool]], upstream: UpstreamPool,
                 breakers: Breakers, registry: CollectorRegistry, rng: random.Random,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`clock` may be replaced (tests) before or after releases exist."""
        self.pools = pools
        self.upstream = upstream
        self.breakers = breakers
        self.rng = rng
        self.clock = clock
        self.by_pool: dict[Pool, Release] = {}
        self.metrics = ReleaseMetrics(registry, lambda: list(self.by_pool.values()))

    def get(self, pool: Pool) -> Release:
        release = self.by_pool.get(pool)
        if release is None:
            release = self.by_pool[pool] = Release(pool, self.upstream, self.breakers,
                                                   self.metrics, self.rng, lambda: self.clock())
        return release

    def find(self, name: str) -> Release:
        """The release of the pool called `name` (its model or any name it serves)."""
        for pool in self.pools():
            if pool_name(pool) == name or pool.serves(name):
                return self.get(pool)
        raise NotFoundError(f"no pool serves {name!r}", param="pool", code="pool_not_found")

    def evaluate(self) -> list[Decision]:
        """One round of the judge over the pools that have a canary or shadow worker."""
        now = self.clock()
        decisions = [self.get(pool).evaluate(now) for pool in self.pools()
                     if pool.release_workers]
        return [d for d in decisions if d is not None]

    async def run(self, interval_s: float = EVALUATE_EVERY_S) -> None:
        while True:
            await asyncio.sleep(interval_s)
            self.evaluate()

    async def close(self) -> None:
        tasks = [t for release in self.by_pool.values() for t in release.shadow_tasks]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
