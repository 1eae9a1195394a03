"""The sliding-window log, in process (fake clock, exact) and in Redis (real time)."""

from __future__ import annotations

import asyncio

import pytest

from sluice.gateway.limits import (
    Limiter,
    LimiterUnavailableError,
    LocalLimiter,
    RedisLimiter,
    Scope,
    format_reset,
)

from .conftest import REDIS_URL


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_format_reset_matches_openai_style() -> None:
    assert format_reset(0.02) == "20ms"
    assert format_reset(1) == "1s"
    assert format_reset(360) == "6m0s"
    assert format_reset(61.5) == "1m1.5s"


async def test_local_window_slides_exactly() -> None:
    clock = Clock()
    lim = LocalLimiter(window_s=60, clock=clock)
    scope = [Scope("k", rpm=3)]
    for t in (0, 10, 20):
        clock.now = 1000 + t
        assert (await lim.acquire(scope, 0)).allowed
    clock.now = 1059.9
    denied = await lim.acquire(scope, 0)
    assert not denied.allowed and denied.reason == "requests"
    assert denied.retry_after_s == pytest.approx(0.1)
    clock.now = 1060.0  # the first entry leaves the window: exactly one slot frees
    assert (await lim.acquire(scope, 0)).allowed
    assert not (await lim.acquire(scope, 0)).allowed
    clock.now = 1070.0  # the second (t=10) leaves; t=20 and t=60 stay
    d = await lim.acquire(scope, 0)
    assert d.allowed and d.headers()["x-ratelimit-remaining-requests"] == "0"


async def test_local_token_reservation_is_reconciled_and_late_tokens_count() -> None:
    clock = Clock()
    lim = LocalLimiter(window_s=60, clock=clock)
    scope = [Scope("k", tpm=100)]
    first = await lim.acquire(scope, 80)
    assert first.headers()["x-ratelimit-remaining-tokens"] == "20"
    assert not (await lim.acquire(scope, 30)).allowed
    assert first.lease is not None
    await lim.finish(first.lease, 50)  # actual usage replaces the reservation
    second = await lim.acquire(scope, 30)
    assert second.allowed and second.headers()["x-ratelimit-remaining-tokens"] == "20"
    too_big = await lim.acquire(scope, 101)
    assert too_big.reason == "too_large"
    # a request whose reservation already left the window is charged its overrun now
    clock.now += 61
    assert second.lease is not None
    await lim.finish(second.lease, 90)
    d = await lim.acquire(scope, 0)
    assert d.headers()["x-ratelimit-remaining-tokens"] == "40"


async def test_all_scopes_or_nothing() -> None:
    lim = LocalLimiter(clock=Clock())
    tenant = Scope("tenant", rpm=1)
    key_a, key_b = Scope("a", rpm=5), Scope("b", rpm=5)
    assert (await lim.acquire([key_a, tenant], 0)).allowed
    refused = await lim.acquire([key_b, tenant], 0)
    assert not refused.allowed
    # b was not charged for the refused request
    d = await lim.acquire([key_b], 0)
    assert d.headers()["x-ratelimit-remaining-requests"] == "4"


def limiters(prefix: str, clock: Clock) -> list[Limiter]:
    return [LocalLimiter(window_s=1.0, clock=clock),
            RedisLimiter(REDIS_URL, prefix=prefix, window_s=1.0)]


async def pass_window(lim: Limiter, clock: Clock) -> None:
    """One window later: the local limiter's clock is injected; Redis keeps its own
    (`TIME`, so replicas agree), so for it the second really has to pass."""
    if isinstance(lim, LocalLimiter):
        clock.now += 1.0
    else:
        await asyncio.sleep(1.05)


@pytest.mark.services
async def test_both_limiters_agree_on_rpm_tpm_concurrency(redis_prefix: str) -> None:
    clock = Clock()
    for lim in limiters(redis_prefix, clock):
        scope = [Scope("key:x", rpm=3, tpm=100, max_concurrent=2), Scope("tenant:y", rpm=10)]
        d1 = await lim.acquire(scope, 40)
        d2 = await lim.acquire(scope, 40)
        assert d1.allowed and d2.allowed
        assert (await lim.acquire(scope, 30)).reason == "tokens"
        assert (await lim.acquire(scope, 10)).reason == "concurrency"
        assert d1.lease is not None
        await lim.finish(d1.lease, 5)
        d3 = await lim.acquire(scope, 40)
        assert d3.allowed
        h = d3.headers()
        assert h["x-ratelimit-remaining-requests"] == "0"
        assert h["x-ratelimit-remaining-tokens"] == "15"
        assert h["x-ratelimit-limit-tokens"] == "100"
        assert (await lim.acquire(scope, 0)).reason == "requests"
        for d in (d2, d3):
            assert d.lease is not None
            await lim.finish(d.lease, 40)
        await pass_window(lim, clock)  # the 1 s window passes: everything frees
        d4 = await lim.acquire(scope, 40)
        assert d4.allowed and d4.headers()["x-ratelimit-remaining-requests"] == "2"
        await lim.close()


@pytest.mark.services
async def test_redis_burst_admits_exactly_the_limit(redis_prefix: str) -> None:
    # two replicas, each with a small connection pool: a burst far wider than the pool
    # waits for connections (no spurious "unavailable") and admits exactly the limit.
    # Connect timeout 10 s, not 1: 300 coroutines on one loop of a busy 2-core machine
    # once held a loopback connect past 1 s (a CI run, 2026-12-02); timeouts are tested
    # below
    a = RedisLimiter(REDIS_URL, prefix=redis_prefix, max_connections=8, timeout_s=10.0)
    b = RedisLimiter(REDIS_URL, prefix=redis_prefix, max_connections=8, timeout_s=10.0)
    scope = [Scope("key:burst", rpm=25)]
    results = await asyncio.gather(*[(a if i % 2 else b).acquire(scope, 1) for i in range(300)])
    assert sum(d.allowed for d in results) == 25
    assert sum(d.reason == "requests" for d in results) == 275
    await a.close()
    await b.close()


@pytest.mark.services
async def test_redis_unreachable_fails_fast_then_retries_and_recovers(redis_prefix: str) -> None:
    clock = Clock()
    lim = RedisLimiter("redis://127.0.0.1:1/0", timeout_s=0.2, clock=clock,
                       prefix=redis_prefix)
    with pytest.raises(LimiterUnavailableError, match="unreachable: "):
        await lim.acquire([Scope("k", rpm=1)], 0)
    assert lim.down_since == clock.now
    with pytest.raises(LimiterUnavailableError, match="retrying shortly"):
        await lim.acquire([Scope("k", rpm=1)], 0)  # no new connection attempt
    await lim.close()
    import redis.asyncio as aioredis

    lim.client = aioredis.Redis.from_url(REDIS_URL)  # Redis "comes back"
    lim._acquire_script = lim.client.register_script(lim._acquire_script.script)
    lim._finish_script = lim.client.register_script(lim._finish_script.script)
    assert len(lim._unfinished) == 1  # the first, tried acquire may have taken a slot
    clock.now += 1.0
    assert (await lim.acquire([Scope("k", rpm=1)], 0)).allowed
    assert lim.down_since is None and not lim._unfinished  # ...freed once Redis answered
    await lim.close()
