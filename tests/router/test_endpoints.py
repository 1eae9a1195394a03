"""Endpoint accounting: in-flight counts through a stream's life, learned prefill cost,
ejection and re-admission counters."""

from __future__ import annotations

import math
import random
import time

import pytest

from sluice.router.config import PoolConfig, WorkerSpec
from sluice.router.endpoints import (
    BASE_UNITS,
    EWMA_ALPHA,
    MAX_OVERHEAD_SHARE,
    MAX_SPEED_RATIO,
    Endpoint,
    EndpointStats,
    TTFTFit,
)
from sluice.router.policies import RequestMeta, make_policy
from sluice.router.pool import Pool
from sluice.router.scrape import WorkerLoad


def test_request_counts_from_dispatch_to_end_of_stream() -> None:
    e = Endpoint(WorkerSpec("http://a"))
    t = e.begin(prompt_tokens=300, uncached_tokens=200, units=200)
    s = e.stats()
    assert (s.inflight, s.inflight_tokens, s.waiting, s.running, s.queued_prefill_tokens) == (
        1, 300, 1.0, 0.0, 200)
    e.on_first_byte(t, learn=False)
    s = e.stats()
    assert (s.waiting, s.running, s.queued_prefill_tokens, s.inflight) == (0.0, 1.0, 0, 1)
    e.finish(t)
    e.finish(t)  # idempotent
    assert (e.inflight, e.inflight_tokens, e.prefilling) == (0, 0, 0)


def test_scraped_load_counts_other_traffic_only_as_of_the_scrape() -> None:
    e = Endpoint(WorkerSpec("http://a"))
    mine = [e.begin(10, 10, 10) for _ in range(3)]
    e.on_first_byte(mine[0], learn=False)  # 1 decoding, 2 prefilling
    # the worker counts 5 running and 2 waiting: 4 requests beyond the router's own 3
    e.load = WorkerLoad(running=5, waiting=2, kv_usage=0.5)
    s = e.stats()
    assert (e.external_running, e.external_waiting) == (4.0, 0.0)
    assert (s.running, s.waiting, s.external_waiting, s.kv_usage) == (5.0, 2.0, 0.0, 0.5)
    # the router's own requests end before the next scrape: the stale gauge no longer
    # counts them (it used to: max(scraped, own) kept 7 requests there until the next scrape)
    for t in mine:
        e.finish(t)
    s = e.stats()
    assert (s.running, s.waiting, s.load) == (4.0, 0.0, 4.0)
    # waiting beyond the router's own prefilling requests is others' queue
    e.load = WorkerLoad(running=0, waiting=3)
    assert (e.stats().waiting, e.stats().external_waiting) == (3.0, 3.0)


def observe(e: Endpoint, units: float, seconds: float, learn: bool = True) -> None:
    t = e.begin(int(units), int(units), units=units)
    t.started = time.monotonic() - seconds
    e.on_first_byte(t, learn=learn)
    e.finish(t)


def test_prefill_cost_is_learned_from_streamed_ttft() -> None:
    e = Endpoint(WorkerSpec("http://a"))
    prior = e.seconds_per_token
    for _ in range(200):  # always the same work: a line through the origin
        observe(e, 1000, 0.01 * (1000 + BASE_UNITS))
    assert prior < 1e-3
    assert e.seconds_per_token == pytest.approx(0.01, rel=0.05)
    assert e.stats().overhead_s == 0.0
    before = e.fit.predict(500)
    observe(e, 10, 99.0, learn=False)  # non-streamed: first byte is the whole answer
    assert e.fit.predict(500) == before
    assert EWMA_ALPHA < 1


def test_fixed_overhead_and_slope_are_told_apart_when_work_varies() -> None:
    e = Endpoint(WorkerSpec("http://a"))
    for i in range(200):  # the truth: 50 ms fixed + 1 ms per token-equivalent
        units = 100.0 if i % 2 else 2000.0
        observe(e, units, 0.05 + 1e-3 * (units + BASE_UNITS))
    s = e.stats()
    assert s.seconds_per_token == pytest.approx(1e-3, rel=0.02)
    assert s.overhead_s == pytest.approx(0.05, rel=0.05)


def test_ejection_after_consecutive_failures_and_readmission() -> None:
    e = Endpoint(WorkerSpec("http://a"))
    assert not e.record_failure(3) and not e.record_failure(3)
    assert e.record_failure(3) and not e.healthy
    assert not e.record_failure(3)  # already out
    assert not e.record_success(2) and not e.healthy
    assert e.record_success(2) and e.healthy and e.consecutive_failures == 0


def test_pool_times_ttfts_and_predicted_entries_on_its_clock() -> None:
    now = [100.0]
    spec = WorkerSpec("http://a", kv_events="tcp://127.0.0.1:1")
    pool = Pool(PoolConfig(workers=(spec,)), random.Random(0), predicted_ttl_s=10.0,
                clock=lambda: now[0])
    meta = RequestMeta(model="m", num_prompt_tokens=64, block_hashes=(1, 2, 3, 4))
    decision = pool.decide(meta)
    assert decision is not None
    ticket = pool.dispatch(meta, decision)
    assert ticket.started == 100.0
    assert pool.precise.match(meta.block_hashes, [spec.url]) == {spec.url: 4}  # predicted
    now[0] = 100.5
    fit = decision.endpoint.fit
    my = fit.my
    decision.endpoint.on_first_byte(ticket, learn=True)  # a 0.5 s TTFT
    assert fit.n == 1 and fit.my == pytest.approx(my + (0.5 - my) / 2)  # the prior counts once
    assert decision.endpoint.log_speed == pytest.approx(
        EWMA_ALPHA * math.log(0.5 / fit.predict(ticket.units)))
    now[0] = 110.1  # the prediction expired without a KV event confirming it
    assert pool.precise.match(meta.block_hashes, [spec.url]) == {spec.url: 0}


def test_pool_learns_one_line_and_a_speed_per_worker() -> None:
    """Three workers, the truth 50 ms + 1 ms/token, C twice as slow; TTFTs noisy (x e^N(0, 0.5)).
    Identical workers come out close (a line per worker came out 2-3x apart), C at 2x."""
    rng = random.Random(3)
    now = [0.0]
    specs = tuple(WorkerSpec(u) for u in ("http://a", "http://b", "http://c"))
    pool = Pool(PoolConfig(workers=specs), random.Random(0), clock=lambda: now[0])
    a, b, c = (pool.endpoints[s.url] for s in specs)
    for i in range(600):
        e = (a, b, c)[i % 3]
        units = rng.choice((100.0, 700.0, 1500.0))
        t = e.begin(int(units), int(units), units=units)
        slow = 2.0 if e is c else 1.0
        now[0] += slow * (0.05 + 1e-3 * (units + BASE_UNITS)) * rng.lognormvariate(0.0, 0.5)
        e.on_first_byte(t, learn=True)
        e.finish(t)
    assert a.fit is b.fit is c.fit is pool.fit
    assert a.seconds_per_token / b.seconds_per_token == pytest.approx(1.0, abs=0.25)
    assert c.speed / math.sqrt(a.speed * b.speed) == pytest.approx(2.0, rel=0.25)
    ratio = pool.fit.predict(700) / (0.05 + 1e-3 * (700 + BASE_UNITS))
    assert a.speed * ratio == pytest.approx(math.exp(0.5 ** 2 / 2), rel=0.3)  # noise's mean


def test_identical_workers_tie_on_speed_despite_noisy_ttfts() -> None:
    """Differences within the EWMA's own standard error are shrunk away (James-Stein toward
    the pool's mean), so equal workers get exactly equal estimates and exact ties."""
    rng = random.Random(11)
    now = [0.0]
    specs = tuple(WorkerSpec(u) for u in ("http://a", "http://b"))
    pool = Pool(PoolConfig(workers=specs), random.Random(0), clock=lambda: now[0])
    a, b = (pool.endpoints[s.url] for s in specs)
    for i in range(400):
        e = (a, b)[i % 2]
        units = rng.choice((100.0, 700.0, 1500.0))
        t = e.begin(int(units), int(units), units=units)
        now[0] += (0.05 + 1e-3 * (units + BASE_UNITS)) * rng.lognormvariate(0.0, 0.5)
        e.on_first_byte(t, learn=True)
        e.finish(t)
    assert a.log_speed != b.log_speed  # the raw EWMAs differ by noise...
    assert a.speed == b.speed  # ...which the estimate does not act on
    assert a.stats().seconds_per_token == b.stats().seconds_per_token
    pool.remove(b.url)
    assert set(pool.fit.log_speeds) == {a.url}


def test_ttfts_that_stop_tracking_queued_work_still_price_a_queue() -> None:
    """An overloaded worker's TTFTs (20-30 s, mostly waits for a sequence slot that its
    queued prefill tokens do not measure) once fitted a line of ~25 s overhead and a
    slope near 0; `cost` then sent requests to a worker with 300k queued tokens and a
    lucky speed factor over an idle one. The overhead is held to a share of the mean TTFT
    and the line goes through the mean point, so queued work keeps its price."""
    rng = random.Random(7)
    fit = TTFTFit()
    for _ in range(400):
        units = rng.uniform(0.0, 200_000.0)
        fit.observe(units, 25.0 + 2e-6 * units + rng.uniform(-5.0, 5.0))
    overhead, slope = fit.line()
    assert overhead <= MAX_OVERHEAD_SHARE * fit.my + 1e-9
    assert fit.predict(fit.mx - BASE_UNITS) == pytest.approx(fit.my)  # through the mean
    request = RequestMeta(model="m", num_prompt_tokens=1000, block_hashes=(), block_size=16)
    queued = EndpointStats("http://queued", queued_prefill_tokens=300_000.0,
                           seconds_per_token=slope * 0.5, overhead_s=overhead * 0.5)
    idle = EndpointStats("http://idle", seconds_per_token=slope, overhead_s=overhead)
    assert make_policy("cost", random.Random(0)).choose(request, [queued, idle]).url == idle.url


def test_a_speed_factor_stays_within_twice_the_pools_either_way() -> None:
    """A worker whose TTFTs run 10x under the line counts as at most 2x faster than the
    pool's mean, a 10x slower one as at most 2x slower. In the simulator such factors
    were artefacts (a line fitted to one overloaded worker and idle ones), and `cost`
    queued requests behind a "fast" worker's 200k tokens; bounded, the next request goes
    to the mid worker's 30k instead (here at a price the bound accepts: this test's 10x
    is real, and unbounded `cost` picks the fast worker)."""
    now = [0.0]
    specs = tuple(WorkerSpec(u) for u in ("http://fast", "http://mid", "http://slow"))
    pool = Pool(PoolConfig(workers=specs), random.Random(0), clock=lambda: now[0])
    fast, mid, slow = (pool.endpoints[s.url] for s in specs)
    rng = random.Random(2)
    for i in range(900):
        e, factor = ((fast, 0.1), (mid, 1.0), (slow, 10.0))[i % 3]
        units = rng.choice((1000.0, 20_000.0, 60_000.0))
        t = e.begin(int(units), int(units), units=units)
        truth = 1e-4 * (units + BASE_UNITS) * factor
        now[0] += truth * rng.lognormvariate(0.0, 0.1)
        e.on_first_byte(t, learn=True)
        e.finish(t)
    assert fast.speed == pytest.approx(1.0 / MAX_SPEED_RATIO)
    assert slow.speed == pytest.approx(MAX_SPEED_RATIO)
    request = RequestMeta(model="m", num_prompt_tokens=1000, block_hashes=(), block_size=16)
    for _ in range(20):  # the fast worker's queue grows: 20 x 10k tokens
        fast.begin(10_000, 10_000, units=10_000.0)
    for _ in range(3):  # the mid one's: 3 x 10k; the slow one's: 2 x 10k
        mid.begin(10_000, 10_000, units=10_000.0)
    for _ in range(2):
        slow.begin(10_000, 10_000, units=10_000.0)
    decision = pool.decide(request)
    assert decision is not None and decision.endpoint is mid


def test_a_lone_worker_learning_noisy_ttfts_does_not_drift() -> None:
    """One worker, a long run of noisy TTFTs: the line keeps the pool's level and the
    worker's factor stays 1 (the factor once carried the level too and fed back into the
    line it is measured against, drifting to 0 and a math domain error)."""
    rng = random.Random(5)
    now = [0.0]
    pool = Pool(PoolConfig(workers=(WorkerSpec("http://a"),)), random.Random(0),
                clock=lambda: now[0])
    (a,) = pool.endpoints.values()
    for _ in range(20_000):
        t = a.begin(500, 500, units=500.0)
        now[0] += 0.2 * rng.lognormvariate(0.0, 1.5)
        a.on_first_byte(t, learn=True)
        a.finish(t)
    assert a.speed == 1.0
    assert 0.05 < pool.fit.predict(500.0) < 2.0  # E[TTFT] = 0.2 * e^(1.5²/2) ≈ 0.62 s
