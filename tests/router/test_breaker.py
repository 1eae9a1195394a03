"""Circuit breakers, the pool's floor, retry backoff and the retry budget: exact state
machines on plain data with an injected clock, then the same over real HTTP with stub
workers whose health probe passes while their requests fail."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import httpx
from router_stubs import StubState, make_stub, serve, serve_router

from sluice.router.app import build_app
from sluice.router.breaker import CLOSED, HALF_OPEN, OPEN, Breakers, RetryBudget
from sluice.router.config import BreakerConfig, PoolConfig, RouterConfig, WorkerSpec
from sluice.router.pool import Pool


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def board(workers: int = 3, **kw: Any) -> tuple[Pool, Breakers, Clock, list[tuple[str, str, str]]]:
    pool = Pool(PoolConfig(model="m", workers=tuple(WorkerSpec(f"http://w{i}")
                                                    for i in range(workers))), random.Random(0))
    clock = Clock()
    moves: list[tuple[str, str, str]] = []
    breakers = Breakers(BreakerConfig(**kw), lambda *move: moves.append(move), clock=clock,
                        rng=random.Random(0))
    return pool, breakers, clock, moves


def test_opens_after_consecutive_failures_half_opens_after_cool_down_and_closes() -> None:
    pool, b, clock, moves = board()
    w = "http://w0"
    for _ in range(4):
        b.failure(pool, w)
    b.success(w)  # resets the run
    for _ in range(4):
        b.failure(pool, w)
    assert b.state(w) == CLOSED and b.blocked(pool) == set()
    b.failure(pool, w)
    assert b.state(w) == OPEN and b.blocked(pool) == {w}
    clock.now += 29.9
    assert b.blocked(pool) == {w}
    clock.now += 0.1
    assert b.blocked(pool) == set() and b.state(w) == HALF_OPEN
    b.attempt(w)
    b.attempt(w)
    assert b.blocked(pool) == {w}  # two trials out: no third
    b.success(w)
    assert b.blocked(pool) == set() and b.state(w) == HALF_OPEN
    b.attempt(w)
    b.success(w)
    assert b.state(w) == CLOSED
    assert moves == [(w, CLOSED, OPEN), (w, OPEN, HALF_OPEN), (w, HALF_OPEN, CLOSED)]


def test_a_failed_trial_reopens_and_old_failures_fall_out_of_the_window() -> None:
    pool, b, clock, moves = board(failures=3, window_s=60)
    w = "http://w1"
    for _ in range(2):
        b.failure(pool, w)
    clock.now += 61  # the next failure starts a new run
    b.failure(pool, w)
    b.failure(pool, w)
    assert b.state(w) == CLOSED
    b.failure(pool, w)
    assert b.state(w) == OPEN
    clock.now += 30
    b.blocked(pool)
    b.attempt(w)
    b.failure(pool, w)
    assert b.state(w) == OPEN and b.blocked(pool) == {w}
    clock.now += 29
    assert b.blocked(pool) == {w}  # the cool-down restarted at the failed trial
    assert [m[2] for m in moves] == [OPEN, HALF_OPEN, OPEN]


def test_the_floor_keeps_the_last_closed_workers_closed() -> None:
    pool, b, _, moves = board(workers=3, failures=2, min_closed=2)
    for url in pool.endpoints:
        for _ in range(5):
            b.failure(pool, url)
    assert [b.state(u) for u in pool.endpoints] == [OPEN, CLOSED, CLOSED]
    assert len(moves) == 1
    pool, b, _, _ = board(workers=2, failures=1, min_closed=1)
    pool.endpoints["http://w1"].healthy = False  # ejected by probes: not a closed worker
    b.failure(pool, "http://w0")
    assert b.state("http://w0") == CLOSED


def test_a_503_or_a_cancelled_trial_frees_its_slot_without_a_verdict() -> None:
    pool, b, clock, _ = board(failures=1, successes=1)
    w = "http://w0"
    b.failure(pool, w)
    clock.now += 30
    b.blocked(pool)
    b.attempt(w)
    assert b.blocked(pool) == {w}
    b.abandon(w)
    assert b.blocked(pool) == set() and b.state(w) == HALF_OPEN


def test_retry_budget_is_a_ratio_of_the_windows_requests_plus_a_minimum() -> None:
    clock = Clock()
    budget = RetryBudget(BreakerConfig(budget_ratio=0.2, budget_min=1, budget_window_s=10), clock)
    for _ in range(10):
        budget.request()
    assert [budget.take_retry() for _ in range(4)] == [True, True, True, False]  # 0.2*10+1
    clock.now += 5
    assert not budget.take_retry()  # still in the window
    clock.now += 5.01
    assert budget.take_retry()  # the old slots left: 0 requests, minimum 1
    assert not budget.take_retry()


def test_backoff_doubles_from_50_ms_to_the_cap_with_half_of_it_jittered() -> None:
    _, b, _, _ = board()
    for retry, full in [(1, 0.05), (2, 0.1), (3, 0.2), (6, 1.0), (20, 1.0)]:
        delays = [b.backoff(retry) for _ in range(50)]
        assert all(full / 2 <= d <= full for d in delays)
        assert max(delays) - min(delays) > full / 10  # jittered
    _, b, _, _ = board(backoff_s=0.0)
    assert b.backoff(3) == 0.0


# --- over HTTP ----------------------------------------------------------------------------


@asynccontextmanager
async def cluster(states: list[StubState], breaker: BreakerConfig, **router_kw: Any
                  ) -> AsyncIterator[tuple[httpx.AsyncClient, Breakers, dict[str, str]]]:
    async with AsyncExitStack() as stack:
        urls = [await stack.enter_async_context(serve(make_stub(s))) for s in states]
        pool = PoolConfig(model="stub-model", workers=tuple(WorkerSpec(u) for u in urls),
                          policy="round_robin")
        app = build_app(RouterConfig(pools=(pool,), breaker=breaker, admin_key="k",
                                     health_interval_s=0.1, scrape_interval_s=0.1, seed=0,
                                     **router_kw), rng=random.Random(0))
        base = await stack.enter_async_context(serve_router(app))
        client = await stack.enter_async_context(httpx.AsyncClient(base_url=base, timeout=30))
        names = {s.name: u for s, u in zip(states, urls, strict=True)}
        yield client, app.state.router.breakers, names


def chat() -> dict[str, Any]:
    return {"model": "stub-model", "messages": [{"role": "user", "content": "hi"}]}


def gauge(metrics: str, url: str) -> str:
    line = next(x for x in metrics.splitlines()
                if x.startswith(f'sluice_router_breaker_state{{worker="{url}"}}'))
    return line.rsplit(" ", 1)[1]


async def test_a_worker_failing_requests_with_a_passing_probe_is_cut_off_then_let_back() -> None:
    bad, good = StubState("bad", fail_status=500), StubState("good")
    config = BreakerConfig(failures=2, successes=2, open_s=30, backoff_s=0)
    async with cluster([bad, good], config) as (c, breakers, urls):
        clock = Clock()
        breakers.clock = clock
        for _ in range(6):
            assert (await c.post("/v1/chat/completions", json=chat())).status_code == 200
        assert len(bad.requests) == 2  # opened after its second failure
        for _ in range(6):
            assert (await c.post("/v1/chat/completions", json=chat())).status_code == 200
        assert len(bad.requests) == 2
        metrics = (await c.get("/metrics")).text
        assert gauge(metrics, urls["bad"]) == "1.0" and gauge(metrics, urls["good"]) == "0.0"
        bad.fail_status = None
        clock.now += 30
        for _ in range(8):
            assert (await c.post("/v1/chat/completions", json=chat())).status_code == 200
        assert breakers.state(urls["bad"]) == CLOSED and len(bad.requests) >= 4
        metrics = (await c.get("/metrics")).text
        moves = 'sluice_router_breaker_transitions_total{from_state="%s",to_state="%s",worker="%s"}'
        for a, b in [(CLOSED, OPEN), (OPEN, HALF_OPEN), (HALF_OPEN, CLOSED)]:
            assert moves % (a, b, urls["bad"]) + " 1.0" in metrics


async def test_a_transient_fault_on_every_worker_leaves_one_closed_and_serving() -> None:
    a, b = StubState("a", fail_status=500), StubState("b", fail_status=500)
    config = BreakerConfig(failures=2, open_s=30, min_closed=1, backoff_s=0)
    async with cluster([a, b], config, max_retries=1) as (c, breakers, urls):
        for _ in range(6):
            r = await c.post("/v1/chat/completions", json=chat())
            assert r.status_code == 503
        states = sorted(breakers.state(u) for u in urls.values())
        assert states == [CLOSED, OPEN]
        a.fail_status = b.fail_status = None  # the fault passes
        r = await c.post("/v1/chat/completions", json=chat())
        assert r.status_code == 200  # at once, not after the 30 s cool-down


async def test_the_retry_budget_caps_retries_when_every_worker_fails() -> None:
    states = [StubState(f"w{i}", fail_status=500) for i in range(3)]
    config = BreakerConfig(failures=0, budget_ratio=0.0, budget_min=2, backoff_s=0)
    async with cluster(states, config, max_retries=3, eject_after_failures=100) as (c, _, _):
        r = await c.post("/v1/chat/completions", json=chat())
        assert r.status_code == 503 and "retry budget exhausted" in r.json()["error"]["message"]
        assert sum(len(s.requests) for s in states) == 3  # 1 + the budget's 2, not 1 + 3
        r = await c.post("/v1/chat/completions", json=chat())
        assert r.status_code == 503
        assert sum(len(s.requests) for s in states) == 4  # no retry left
        metrics = (await c.get("/metrics")).text
        assert 'sluice_router_retry_budget_exhausted_total{model="stub-model"} 2.0' in metrics
