"""The sliding-window log, in process (fake clock, exact) and in Redis (real time)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from sluice.gateway.limits import (
    Limiter,
    LimiterUnavailableError,
    LocalLimiter,
    RedisLimiter,
    Scope,
    format_reset,
    too_large_for,
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


async def check_too_large_wins(lim: Limiter) -> None:
    key, tenant = Scope("key:big", rpm=1, max_concurrent=1), Scope("tenant:big", tpm=50)
    held = await lim.acquire([key, tenant], 50)
    assert held.allowed
    for scopes in ([key, tenant], [tenant, key]):  # the key is out of requests and slots
        d = await lim.acquire(scopes, 51)
        assert (d.allowed, d.reason) == (False, "too_large")
        assert too_large_for(d.scopes, 51) == 50
    assert (await lim.acquire([key, tenant], 1)).reason == "requests"  # a wait cures it
    assert too_large_for([key, tenant], 50) is None
    assert too_large_for([Scope("a", tpm=80), Scope("b", tpm=60)], 90) == 60
    await lim.close()


async def test_too_large_wins_over_a_limit_that_a_wait_would_cure() -> None:
    """A request over a TPM limit on its own is `too_large` even when another limit also
    refuses it (before, that one's reason won and the client was told to wait)."""
    await check_too_large_wins(LocalLimiter(clock=Clock()))


@pytest.mark.services
async def test_too_large_wins_in_redis_too(redis_prefix: str) -> None:
    await check_too_large_wins(RedisLimiter(REDIS_URL, prefix=redis_prefix))


@pytest.mark.services
async def test_redis_burst_admits_exactly_the_limit(redis_prefix: str) -> None:
    # two replicas, each sending its calls in steps on one connection: a burst far
    # wider than a step admits exactly the limit (no spurious "unavailable").
    # Connect timeout 10 s, not 1: 300 coroutines on one loop of a busy 2-core machine
    # once held a loopback connect past 1 s (a CI run, 2026-12-02); timeouts are tested
    # below
    a = RedisLimiter(REDIS_URL, prefix=redis_prefix, timeout_s=10.0)
    b = RedisLimiter(REDIS_URL, prefix=redis_prefix, timeout_s=10.0)
    scope = [Scope("key:burst", rpm=25)]
    results = await asyncio.gather(*[(a if i % 2 else b).acquire(scope, 1) for i in range(300)])
    assert sum(d.allowed for d in results) == 25
    assert sum(d.reason == "requests" for d in results) == 275
    await a.close()
    await b.close()


@pytest.mark.services
async def test_redis_give_back_takes_the_request_off_the_window(redis_prefix: str) -> None:
    """An admission given back (the gateway found its key answer stale) frees its slot
    and tokens and is not counted as a request; a finished one stays counted."""
    lim = RedisLimiter(REDIS_URL, prefix=redis_prefix)
    scope = [Scope("key:back", rpm=2, tpm=100, max_concurrent=1)]
    first = await lim.acquire(scope, 60)
    assert first.allowed and first.lease is not None
    assert (await lim.acquire(scope, 10)).reason == "concurrency"
    await lim.give_back(first.lease)
    second = await lim.acquire(scope, 90)  # slot, tokens and the request count all back
    assert second.allowed and second.lease is not None
    assert second.headers()["x-ratelimit-remaining-requests"] == "1"
    await lim.finish(second.lease, 90)
    third = await lim.acquire(scope, 5)
    assert third.allowed and third.headers()["x-ratelimit-remaining-requests"] == "0"
    await lim.close()


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

    lim.steps.pool = aioredis.ConnectionPool.from_url(REDIS_URL)  # Redis "comes back"
    assert len(lim._unfinished) == 1  # the first, tried acquire may have taken a slot
    clock.now += 1.0
    assert (await lim.acquire([Scope("k", rpm=1)], 0)).allowed
    assert lim.down_since is None and not lim._unfinished  # ...freed once Redis answered
    await lim.close()


@pytest.mark.services
async def test_redis_steps_admit_exactly_the_first_calls_in_arrival_order(
        redis_prefix: str) -> None:
    """A burst goes out in a few steps (one script call each, at most two in flight),
    and Redis applies the calls in the order they arrived: exactly the first 25 of 300
    are admitted. (Before, one call per pooled connection: the 25 admitted were whichever
    connections got to Redis first.)"""
    lim = RedisLimiter(REDIS_URL, prefix=redis_prefix, timeout_s=10.0)
    scope = [Scope("key:order", rpm=25)]
    results = await asyncio.gather(*[lim.acquire(scope, 1) for _ in range(300)])
    assert [i for i, d in enumerate(results) if d.allowed] == list(range(25))
    assert [d.states[0].requests_used for d in results[:25]] == list(range(1, 26))
    assert lim.steps.steps_sent < 20 and lim.steps.most_in_flight <= 2
    await lim.close()


@pytest.mark.services
async def test_redis_finish_and_acquire_apply_in_arrival_order(redis_prefix: str) -> None:
    """A finish that arrived before an acquire frees its slot for it; one that arrived
    after does not (both in the same step)."""
    lim = RedisLimiter(REDIS_URL, prefix=redis_prefix, timeout_s=10.0)
    scope = [Scope("key:conc", max_concurrent=2)]
    held = [await lim.acquire(scope, 0) for _ in range(2)]
    assert all(d.lease is not None for d in held)
    _, after = await asyncio.gather(lim.finish(held[0].lease, 0), lim.acquire(scope, 0))  # type: ignore[arg-type]
    assert after.allowed
    before, _ = await asyncio.gather(lim.acquire(scope, 0), lim.finish(held[1].lease, 0))  # type: ignore[arg-type]
    assert before.reason == "concurrency"
    assert (await lim.acquire(scope, 0)).allowed
    await lim.close()


class SlowProxy:
    """A TCP proxy to Redis that holds what the client sends for `delay_s` before
    passing it on (replies come back at once), and passes it on even after the client
    hung up: a call is then still in flight when its caller is cancelled."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.server: asyncio.Server | None = None
        self.tasks: set[asyncio.Task[None]] = set()
        self.writers: list[asyncio.StreamWriter] = []

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return f"redis://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/0"

    async def __aexit__(self, *_: object) -> None:
        assert self.server is not None
        self.server.close()
        for task in self.tasks:
            task.cancel()

    def cut(self) -> None:
        """Drop every connection at once (what is held is never passed on)."""
        for task in self.tasks:
            task.cancel()
        for writer in self.writers:
            writer.transport.abort()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", 6379)
        self.writers += [writer, up_writer]
        for pipe in (self._pipe(reader, up_writer, self.delay_s),
                     self._pipe(up_reader, writer, 0.0)):
            task = asyncio.create_task(pipe)
            self.tasks.add(task)

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    delay_s: float) -> None:
        try:
            while data := await reader.read(65536):
                await asyncio.sleep(delay_s)
                writer.write(data)
                await writer.drain()
            await asyncio.sleep(delay_s)
        except (OSError, ConnectionError):
            pass
        writer.close()


@pytest.mark.services
async def test_a_caller_cancelled_during_acquire_gets_its_slot_returned(
        redis_prefix: str) -> None:
    """The client goes away while its acquire is on the wire: Redis still admits it,
    and the slot must come back (before, it stayed taken for the whole 1 h lease, so
    with max_concurrent=1 the key was locked out)."""
    scope = [Scope("key:cancel", max_concurrent=1)]
    async with SlowProxy(0.3) as url:
        slow = RedisLimiter(url, prefix=redis_prefix, timeout_s=10.0)
        fast = RedisLimiter(REDIS_URL, prefix=redis_prefix)
        assert (await slow.acquire([Scope("warm")], 0)).allowed  # connected, script loaded
        task = asyncio.create_task(slow.acquire(scope, 10))
        await asyncio.sleep(0.1)  # sent; the proxy holds it until 0.3 s
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(1.0)  # Redis admits it at 0.3 s; the give-back takes 0.3 more
        d = await fast.acquire(scope, 0)
        assert d.allowed, d.reason
        await slow.close()
        await fast.close()


@pytest.mark.services
async def test_a_connection_lost_under_steps_fails_them_and_the_next_call_recovers(
        redis_prefix: str) -> None:
    """The connection breaks with steps in flight: every call in them fails as
    unavailable, their leases are kept (they may have run), and the next call opens a
    new connection and finishes them."""
    scope = [Scope("key:cut", max_concurrent=100)]
    proxy = SlowProxy(0.5)
    async with proxy as url:
        lim = RedisLimiter(url, prefix=redis_prefix, timeout_s=10.0, retry_interval_s=0.0)
        assert (await lim.acquire([Scope("warm")], 0)).allowed
        calls = [asyncio.create_task(lim.acquire(scope, 1)) for _ in range(10)]
        await asyncio.sleep(0.05)  # sent, held by the proxy
        proxy.cut()
        outcomes = await asyncio.gather(*calls, return_exceptions=True)
        assert all(isinstance(o, LimiterUnavailableError) for o in outcomes)
        assert len(lim._unfinished) == 10 and lim.down_since is not None
        d = await lim.acquire(scope, 1)  # a new connection through the proxy
        assert d.allowed and lim.down_since is None
        await until_true(lambda: not lim._unfinished)
        fast = RedisLimiter(REDIS_URL, prefix=redis_prefix)
        d2 = await fast.acquire(scope, 0)
        assert d2.states[0].requests_used == 2  # the held calls never reached Redis
        await lim.close()
        await fast.close()


async def until_true(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


@pytest.mark.services
async def test_redis_slots_of_live_requests_are_renewed_and_a_dead_replicas_expire(
        redis_prefix: str) -> None:
    """A concurrency slot is a lease that its replica renews every third of it while the
    request runs, so the lease can be short: a replica killed with requests in flight
    (kill -9, the OOM killer) held their slots for the whole lease, an hour, and a
    `max_concurrent: 1` key was refused (`Retry-After: 1`) for that hour. Here a lease of
    0.6 s: a live request holds its slot across four leases; a dead replica's slot is
    back within one lease and a renewal."""
    scope = [Scope("key:lease", max_concurrent=1)]
    live = RedisLimiter(REDIS_URL, prefix=redis_prefix, lease_s=0.6)
    other = RedisLimiter(REDIS_URL, prefix=redis_prefix, lease_s=0.6)
    held = await live.acquire(scope, 1)
    assert held.allowed and held.lease is not None
    await asyncio.sleep(2.4)  # four leases: renewed, not expired
    assert (await other.acquire(scope, 1)).reason == "concurrency"
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(REDIS_URL)
    slots = f"{redis_prefix}key:lease:conc"
    await client.delete(slots)  # lost (a Redis restart, a flush): the next renewal retakes it
    for _ in range(100):
        if await client.zscore(slots, held.lease.request_id) is not None:
            break
        await asyncio.sleep(0.02)
    assert await client.zscore(slots, held.lease.request_id) is not None
    await client.aclose()
    await live.close()  # the replica dies: its lease is renewed no more, never finished
    admitted, waited = False, 0.0
    while not admitted and waited < 5.0:
        await asyncio.sleep(0.05)
        waited += 0.05
        decision = await other.acquire(scope, 1)
        admitted = decision.allowed
    assert admitted and waited < 1.5
    await other.close()


def test_the_redis_lease_of_a_slot_is_a_minute_at_most() -> None:
    """What a killed replica's in-flight requests hold (the lease) is bounded by a
    minute by default, not an hour; the in-process limiter (no replica to outlive it)
    keeps its hour."""
    from sluice.gateway.config import LimiterConfig
    from sluice.gateway.state import build_limiter

    redis = build_limiter(LimiterConfig(redis_url=REDIS_URL))
    assert isinstance(redis, RedisLimiter) and redis.lease_s <= 60
    assert isinstance(local := build_limiter(LimiterConfig()), LocalLimiter)
    assert local.lease_s == 3600
