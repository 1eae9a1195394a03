"""Releases (router/release.py): canary split and pins, shadow copies, automatic rollback
and promotion, over real HTTP with stub workers; the statistics on known inputs.

Window and step times run on a fake clock (`Releases.clock`); latencies are real (the
stubs' injected delays, tens of milliseconds)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from router_stubs import StubState, make_stub, serve, serve_router

from sluice.protocol.errors import InvalidRequestError
from sluice.router.app import build_app
from sluice.router.breaker import Breakers
from sluice.router.config import (
    BASELINE,
    CANARY,
    SHADOW,
    BreakerConfig,
    PoolConfig,
    ReleaseConfig,
    RouterConfig,
    WorkerSpec,
)
from sluice.router.pool import Pool
from sluice.router.release import ROLLED_BACK, RUNNING, Releases
from sluice.router.release_stats import (
    compare_errors,
    compare_hit_rates,
    compare_latency,
    mann_whitney_greater,
    quantile,
    two_proportion_z,
)
from sluice.router.scrape import WorkerLoad
from sluice.router.state import RouterState
from sluice.router.upstream import UpstreamPool

ADMIN_KEY = "test-admin"
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
MODEL = "stub-model"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}]}


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class Cluster:
    client: httpx.AsyncClient
    state: RouterState
    clock: FakeClock

    async def chat(self, headers: dict[str, str] | None = None, **body: Any) -> httpx.Response:
        return await self.client.post("/v1/chat/completions", json={**CHAT, **body},
                                      headers=headers or {})

    async def many(self, n: int, concurrency: int = 8, **kw: Any) -> list[httpx.Response]:
        gate = asyncio.Semaphore(concurrency)

        async def one() -> httpx.Response:
            async with gate:
                return await self.chat(**kw)

        return list(await asyncio.gather(*(one() for _ in range(n))))

    async def settle(self) -> None:
        """Let relays that the client has fully read finish closing (their records)."""
        await asyncio.sleep(0.05)

    async def release(self) -> dict[str, Any]:
        resp = await self.client.get(f"/admin/pools/{MODEL}/release", headers=ADMIN)
        assert resp.status_code == 200, resp.text
        return dict(resp.json())

    async def metric(self, name: str, **labels: str) -> float | None:
        """The sample of `name` with exactly these labels in the router's /metrics."""
        text = (await self.client.get("/metrics")).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and sample.labels == labels:
                    return float(sample.value)
        return None


@asynccontextmanager
async def cluster(stubs: list[tuple[StubState, str]], release: ReleaseConfig, front: Any = None,
                  **router_kw: Any) -> AsyncIterator[Cluster]:
    """Stub workers of the given versions behind a router; its releases on a fake clock."""
    async with AsyncExitStack() as stack:
        urls = [await stack.enter_async_context(serve(make_stub(s))) for s, _ in stubs]
        workers = tuple(WorkerSpec(u, version=v) for u, (_, v) in zip(urls, stubs, strict=True))
        pool = PoolConfig(model=MODEL, workers=workers, policy="round_robin", release=release)
        config = RouterConfig(pools=(pool,), admin_key=ADMIN_KEY, seed=7, **router_kw)
        app = build_app(config)
        url = await stack.enter_async_context((front or serve_router)(app))
        state: RouterState = app.state.router
        clock = FakeClock()
        state.releases.clock = clock
        client = await stack.enter_async_context(httpx.AsyncClient(base_url=url, timeout=10))
        yield Cluster(client, state, clock)


def served_by(resp: httpx.Response) -> str:
    assert resp.status_code == 200, resp.text
    return str(resp.json()["worker"])


# --- split, stickiness, pins ------------------------------------------------------------------


async def test_weight_splits_requests_within_tolerance() -> None:
    base, canary = StubState("base"), StubState("canary")
    async with cluster([(base, BASELINE), (canary, CANARY)],
                       ReleaseConfig(canary_weight=30, auto=False)) as c:
        replies = await c.many(400)
    to_canary = sum(served_by(r) == "canary" for r in replies)
    assert 80 <= to_canary <= 160  # 120 expected, binomial sd 9.2: about 4 sd either way
    assert all(r.headers["x-sluice-version"] == ("canary" if served_by(r) == "canary"
                                                 else "baseline") for r in replies)


async def test_a_session_stays_on_one_version() -> None:
    base, canary = StubState("base"), StubState("canary")
    async with cluster([(base, BASELINE), (canary, CANARY)],
                       ReleaseConfig(canary_weight=50, auto=False)) as c:
        seen: dict[str, set[str]] = {}
        for i in range(40):
            for _ in range(3):
                resp = await c.chat({"x-session-id": f"s{i}"})
                seen.setdefault(f"s{i}", set()).add(served_by(resp))
    assert all(len(v) == 1 for v in seen.values())
    assert 8 <= sum(v == {"canary"} for v in seen.values()) <= 32  # both versions get some


async def test_pinning_by_header_and_by_tenant() -> None:
    base, canary = StubState("base"), StubState("canary")
    release = ReleaseConfig(canary_weight=0, pin_tenants={"acme": CANARY})
    async with cluster([(base, BASELINE), (canary, CANARY)], release) as c:
        assert served_by(await c.chat({"x-sluice-version": "canary"})) == "canary"
        assert served_by(await c.chat({"x-sluice-version": "baseline"})) == "base"
        assert served_by(await c.chat({"x-sluice-tenant": "acme"})) == "canary"
        assert served_by(await c.chat({"x-sluice-tenant": "other"})) == "base"
        assert served_by(await c.chat()) == "base"
        bad = await c.chat({"x-sluice-version": "shadow"})
        assert bad.status_code == 400
        assert bad.json()["error"]["param"] == "x-sluice-version"
        # after a rollback the tenant's pin yields; an explicit header still reaches it
        put = await c.client.put(f"/admin/pools/{MODEL}/release", headers=ADMIN,
                                 json={"action": "rollback"})
        assert put.json()["state"] == ROLLED_BACK
        assert served_by(await c.chat({"x-sluice-tenant": "acme"})) == "base"
        assert served_by(await c.chat({"x-sluice-version": "canary"})) == "canary"


# --- automatic rollback and promotion ------------------------------------------------------


async def test_failing_canary_is_rolled_back_and_its_clients_get_the_baseline() -> None:
    base, canary = StubState("base"), StubState("canary", fail_status=500)
    release = ReleaseConfig(canary_weight=50, min_samples=10, window_s=60)
    # neither ejection nor the circuit breaker may take the canary out: the judge must
    async with cluster([(base, BASELINE), (canary, CANARY)], release,
                       eject_after_failures=1000, breaker=BreakerConfig(failures=0)) as c:
        replies = await c.many(60)
        assert {served_by(r) for r in replies} == {"base"}  # canary failures fell back
        assert len(canary.requests) >= 10
        c.clock.advance(1)
        await c.settle()
        c.state.releases.evaluate()
        view = await c.release()
        assert (view["state"], view["weight"]) == ("rolled_back", 0)
        decision = view["last_decision"]
        assert decision["action"] == "rollback" and "errors" in decision["reason"]
        errors = next(s for s in decision["statistics"] if s["metric"] == "errors")
        assert errors["regressed"] and errors["p_value"] < release.alpha
        assert errors["canary"] == 1.0 and errors["baseline"] == 0.0
        assert view["window"]["canary"]["errors"] >= 10
        assert await c.metric("sluice_router_release_rollbacks_total", pool=MODEL,
                              reason="errors") == 1.0
        assert await c.metric("sluice_router_canary_weight", pool=MODEL) == 0.0
        canary.fail_status = None
        after = await c.many(20)
        assert {served_by(r) for r in after} == {"base"}


async def test_canary_whose_breakers_open_is_rolled_back_within_the_window() -> None:
    """Breakers on (the default): the canary's breaker opens after 5 failures and its
    traffic goes to the baseline as no sample, so the error test never gets its samples;
    every canary worker failing for 2 x `open_s` (60 s) rolls it back by itself."""
    base, canary = StubState("base"), StubState("canary", fail_status=500)
    release = ReleaseConfig(canary_weight=50, min_samples=20, window_s=120)
    async with cluster([(base, BASELINE), (canary, CANARY)], release) as c:
        replies = await c.many(60)
        assert {served_by(r) for r in replies} == {"base"}
        assert 5 <= len(canary.requests) < 20  # the breaker opened; the rest were refused
        await c.settle()
        c.state.releases.evaluate()  # every canary worker failing: the grace starts
        view = await c.release()
        assert view["window"]["canary"]["errors"] == len(canary.requests)  # attempts only
        assert not view["comparison"][0]["enough_samples"]
        c.clock.advance(59)
        c.state.releases.evaluate()
        assert (await c.release())["state"] == "running"
        c.clock.advance(1)
        c.state.releases.evaluate()
        view = await c.release()
        assert (view["state"], view["weight"]) == ("rolled_back", 0)
        assert view["last_decision"]["reason"].startswith("canary circuit open for 60s")
        assert await c.metric("sluice_router_release_rollbacks_total", pool=MODEL,
                              reason="circuit_open") == 1.0


async def test_slow_first_byte_canary_is_rolled_back() -> None:
    base, canary = StubState("base"), StubState("canary", ttft_s=0.04)
    release = ReleaseConfig(canary_weight=50, min_samples=15, window_s=60)
    async with cluster([(base, BASELINE), (canary, CANARY)], release) as c:
        await c.many(70)
        await c.settle()
        c.state.releases.evaluate()
        view = await c.release()
    assert view["state"] == "rolled_back"
    ttft = next(s for s in view["last_decision"]["statistics"] if s["metric"] == "ttft_p90")
    assert ttft["regressed"] and ttft["canary"] > 1.2 * ttft["baseline"]
    assert view["last_decision"]["reason"].startswith("canary regressed on")


async def test_slow_streaming_canary_is_rolled_back_on_tpot() -> None:
    base = StubState("base", num_tokens=5)
    canary = StubState("canary", num_tokens=5, token_delay_s=0.02)
    release = ReleaseConfig(canary_weight=50, min_samples=15, window_s=60)
    async with cluster([(base, BASELINE), (canary, CANARY)], release) as c:
        replies = await c.many(70, stream=True)
        assert all(r.status_code == 200 and "data: [DONE]" in r.text for r in replies)
        await c.settle()
        c.state.releases.evaluate()
        view = await c.release()
    assert view["state"] == "rolled_back"
    tpot = next(s for s in view["last_decision"]["statistics"] if s["metric"] == "tpot_p90")
    assert tpot["regressed"] and tpot["canary"] >= 0.015


async def test_healthy_canary_is_promoted_in_steps() -> None:
    base, canary = StubState("base"), StubState("canary")
    release = ReleaseConfig(canary_weight=25, steps=(25, 50, 100), min_samples=10, window_s=10)
    async with cluster([(base, BASELINE), (canary, CANARY)], release) as c:
        c.state.releases.evaluate()  # the release starts now, on the fake clock
        weights = []
        for _ in range(2):
            c.clock.advance(5)  # samples inside the window, the step's dwell complete after
            await c.many(80)
            await c.settle()
            c.clock.advance(5)
            c.state.releases.evaluate()
            weights.append((await c.release())["weight"])
        view = await c.release()
        to_canary = sum(served_by(r) == "canary" for r in await c.many(10))
        promotions = await c.metric("sluice_router_release_promotions_total", pool=MODEL)
    assert weights == [50, 100]
    assert view["state"] == "promoted" and view["last_decision"]["action"] == "promote"
    assert to_canary == 10 and promotions == 2.0


async def test_not_promoted_before_enough_samples() -> None:
    base, canary = StubState("base"), StubState("canary")
    release = ReleaseConfig(canary_weight=25, min_samples=50, window_s=10)
    async with cluster([(base, BASELINE), (canary, CANARY)], release) as c:
        await c.many(20)
        c.clock.advance(10)
        await c.settle()
        c.state.releases.evaluate()
        view = await c.release()
    assert (view["state"], view["weight"]) == ("running", 25)
    assert not view["comparison"][0]["enough_samples"]


def _release_of(pool_config: PoolConfig) -> tuple[Releases, Pool, FakeClock]:
    """A release without HTTP; its judge and the breakers share the fake clock."""
    clock = FakeClock()
    pool = Pool(pool_config, random.Random(1))
    breakers = Breakers(BreakerConfig(), lambda url, a, b: None, clock, random.Random(1))
    releases = Releases(lambda: [pool], UpstreamPool(), breakers, CollectorRegistry(),
                        random.Random(1), clock)
    return releases, pool, clock


def test_prefix_hit_rate_regression_from_scrapes_rolls_back() -> None:
    """Per-scrape hit rates come from the workers' counters; a canary that hits its
    prefix cache far less (a changed block size, a broken hash) is rolled back."""
    workers = (WorkerSpec("http://b:1"), WorkerSpec("http://c:1", version=CANARY))
    config = PoolConfig(model=MODEL, workers=workers,
                        release=ReleaseConfig(canary_weight=50, min_samples=20))
    releases, pool, clock = _release_of(config)
    base, canary = pool.endpoints["http://b:1"], pool.endpoints["http://c:1"]
    for i in range(1, 40):
        clock.advance(1)
        base.load = WorkerLoad(prefix_queries=100 * i, prefix_hits=80 * i - i % 3)
        canary.load = WorkerLoad(prefix_queries=100 * i, prefix_hits=30 * i + i % 4)
        releases.evaluate()
    release = releases.get(pool)
    assert release.state == ROLLED_BACK
    assert release.decisions[-1].reason == "canary regressed on prefix_hit_rate"
    verdict = release.decisions[-1].verdicts[3]
    assert verdict.samples == (20, 20) and verdict.canary is not None
    assert abs(verdict.canary - 0.3) < 0.02


CANARY_POOL = PoolConfig(model=MODEL, workers=(WorkerSpec("http://b:1"),
                                               WorkerSpec("http://c:1", version=CANARY)),
                         release=ReleaseConfig(canary_weight=5))


def test_ejected_canary_is_rolled_back_after_the_grace() -> None:
    releases, pool, clock = _release_of(CANARY_POOL)
    pool.endpoints["http://c:1"].healthy = False
    assert releases.evaluate() == []  # the grace (2 x open_s = 60 s) starts
    clock.advance(59)
    assert releases.evaluate() == []
    clock.advance(1)
    (decision,) = releases.evaluate()
    assert decision.action == "rollback" and releases.get(pool).weight == 0
    assert decision.reason.startswith("canary circuit open")


def test_canary_breaker_that_closes_within_the_grace_is_not_rolled_back() -> None:
    """A burst of failures opens the breaker; its half-open trials succeed: no rollback."""
    releases, pool, clock = _release_of(CANARY_POOL)
    breakers = releases.breakers
    for _ in range(5):
        breakers.failure(pool, "http://c:1")
    assert breakers.state("http://c:1") == "open"
    releases.evaluate()
    clock.advance(30)
    assert releases.get(pool).has_available(CANARY)  # half-open: it takes trials
    assert breakers.state("http://c:1") == "half_open"
    breakers.attempt("http://c:1")
    breakers.success("http://c:1")
    breakers.success("http://c:1")
    assert breakers.state("http://c:1") == "closed"
    for _ in range(120):
        clock.advance(1)
        assert releases.evaluate() == []
    assert releases.get(pool).state == RUNNING


@pytest.mark.parametrize("absent", ["drained", "not_deployed"])
def test_canary_without_workers_is_not_rolled_back(absent: str) -> None:
    """No canary worker at all (all draining, or none added yet beside a shadow) is not
    a regression: the judge waits, and neither rolls back nor promotes."""
    version = CANARY if absent == "drained" else SHADOW
    releases, pool, clock = _release_of(PoolConfig(
        model=MODEL, workers=(WorkerSpec("http://b:1"), WorkerSpec("http://c:1", version=version)),
        release=ReleaseConfig(canary_weight=5, window_s=60)))
    pool.endpoints["http://c:1"].draining = absent == "drained"
    for _ in range(300):  # five windows, five graces
        clock.advance(1)
        assert releases.evaluate() == []
    release = releases.get(pool)
    assert (release.state, release.weight, list(release.decisions)) == (RUNNING, 5, [])


# --- shadow ---------------------------------------------------------------------------------


@pytest.mark.parametrize("front", [serve_router, serve], ids=["server", "uvicorn"])
async def test_shadow_copies_never_reach_the_client_and_are_bounded(front: Any) -> None:
    base, shadow = StubState("base"), StubState("shadow", ttft_s=0.3)
    release = ReleaseConfig(shadow_percent=100, shadow_max_concurrency=2)
    async with cluster([(base, BASELINE), (shadow, SHADOW)], release, front=front) as c:
        replies = await c.many(6, concurrency=6)
        assert shadow.completed == 0  # the clients had their answers before any shadow's
        assert {served_by(r) for r in replies} == {"base"}
        assert all("x-sluice-shadow" not in r.headers for r in replies)
        assert len(shadow.requests) == 2
        assert all(h["x-sluice-shadow"] == "1" for h in shadow.headers)
        for _ in range(100):  # bounded: the two copies take 0.3 s
            if shadow.completed == 2:
                break
            await asyncio.sleep(0.02)
        await c.settle()
        dropped = await c.metric("sluice_router_shadow_dropped_total", pool=MODEL,
                                 reason="concurrency")
        sent = await c.metric("sluice_router_shadow_requests_total", pool=MODEL, outcome="ok")
        view = await c.release()
    assert (dropped, sent) == (4.0, 2.0)
    assert view["window"]["shadow"]["requests"] == 2
    assert view["window"]["shadow"]["ttft_p50_s"] >= 0.3
    assert len(base.requests) == 6


async def test_shadow_stream_leaves_the_primary_stream_alone() -> None:
    base, shadow = StubState("base", num_tokens=4), StubState("shadow", num_tokens=9)
    release = ReleaseConfig(shadow_percent=100)
    async with cluster([(base, BASELINE), (shadow, SHADOW)], release) as c:
        resp = await c.chat(stream=True)
        for _ in range(100):
            if shadow.completed:
                break
            await asyncio.sleep(0.02)
    assert resp.status_code == 200
    assert "base-3" in resp.text and "shadow" not in resp.text
    assert shadow.completed == 1 and shadow.requests[0]["stream"] is True


# --- admin ----------------------------------------------------------------------------------


async def test_admin_release_api() -> None:
    base, canary = StubState("base"), StubState("canary")
    async with cluster([(base, BASELINE), (canary, CANARY)], ReleaseConfig()) as c:
        url = f"/admin/pools/{MODEL}/release"
        assert (await c.client.get(url)).status_code == 401
        view = await c.release()
        assert (view["state"], view["weight"]) == ("idle", 0)
        assert view["workers"]["canary"] and view["workers"]["baseline"]
        started = (await c.client.put(url, headers=ADMIN, json={"action": "start"})).json()
        assert (started["state"], started["weight"]) == ("running", 5)
        promoted = (await c.client.put(url, headers=ADMIN, json={"action": "promote"})).json()
        assert promoted["weight"] == 25
        paused = (await c.client.put(url, headers=ADMIN,
                                     json={"action": "pause", "weight": 40})).json()
        assert (paused["state"], paused["weight"]) == ("paused", 40)
        assert await c.metric("sluice_router_canary_weight", pool=MODEL) == 40.0
        bad = await c.client.put(url, headers=ADMIN, json={"action": "explode"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "action"
        bad = await c.client.put(url, headers=ADMIN, json={"weight": 101})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "weight"
        missing = await c.client.get("/admin/pools/nope/release", headers=ADMIN)
        assert missing.status_code == 404
        added = await c.client.post("/admin/workers", headers=ADMIN,
                                    json={"url": "http://127.0.0.1:9", "version": "shadow"})
        assert added.status_code == 201 and added.json()["version"] == "shadow"
        assert (await c.release())["workers"]["shadow"] == ["http://127.0.0.1:9"]


async def test_the_version_header_is_checked_in_a_pool_without_a_release() -> None:
    """`x-sluice-version` in a pool with no canary or shadow worker: a bad value is the
    same 400 as in a pool with a release, and `canary` a 503 (as a release whose canary
    workers are all gone answers a request pinned to it). Both were ignored, and the
    baseline answered a request pinned to the canary."""
    async with cluster([(StubState("base"), BASELINE)], ReleaseConfig()) as c:
        r = await c.chat(headers={"x-sluice-version": "cnary"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "x-sluice-version"
        r = await c.chat(headers={"x-sluice-version": "canary"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_canary_worker"
        assert served_by(await c.chat(headers={"x-sluice-version": "baseline"})) == "base"


async def test_a_pool_named_with_a_slash_has_its_release_api() -> None:
    """Hugging Face names have a slash (`org/model`): GET and PUT
    /admin/pools/org/model/release reach that pool's release, as the admission routes do;
    they were a 404 'no route' (the path parameter took one segment)."""
    a, canary = StubState("a", model="org/model"), StubState("c", model="org/model")
    async with AsyncExitStack() as stack:
        urls = [await stack.enter_async_context(serve(make_stub(s))) for s in (a, canary)]
        pool = PoolConfig(workers=(WorkerSpec(urls[0]), WorkerSpec(urls[1], version=CANARY)))
        app = build_app(RouterConfig(pools=(pool,), admin_key=ADMIN_KEY, seed=0))
        url = await stack.enter_async_context(serve_router(app))
        c = await stack.enter_async_context(httpx.AsyncClient(base_url=url, headers=ADMIN))
        r = await c.get("/admin/pools/org/model/release")
        assert r.status_code == 200 and r.json()["workers"]["canary"] == [urls[1]], r.text
        r = await c.put("/admin/pools/org/model/release", json={"weight": 30})
        assert r.status_code == 200 and r.json()["weight"] == 30, r.text


# --- statistics on known inputs ---------------------------------------------------------------


def test_two_proportion_z_on_known_values() -> None:
    z, p = two_proportion_z(30, 100, 15, 100)  # R: prop.test(correct=FALSE): X² = 6.4516
    assert z == pytest.approx(6.4516 ** 0.5, abs=1e-3)
    assert p == pytest.approx(0.00554, abs=1e-4)
    assert two_proportion_z(0, 50, 0, 50) == (0.0, 1.0)
    assert two_proportion_z(5, 100, 10, 100)[1] > 0.5  # the canary is better: not "worse"


def test_mann_whitney_on_known_values() -> None:
    # R: wilcox.test(c(4,5,6), c(1,2,3), alternative="greater", exact=FALSE): p = 0.04043
    u, p = mann_whitney_greater([4, 5, 6], [1, 2, 3])
    assert u == 9 and p == pytest.approx(0.04043, abs=1e-4)
    # ties: ranks 1, 3, 3, 3, 6, 6, 6, 8; U(b) = 13, var = 16/12 * (9 - 48/56) = 10.857,
    # z = (13 - 8 - 0.5) / sqrt(10.857) = 1.3657
    u, p = mann_whitney_greater([2, 3, 3, 4], [1, 2, 2, 3])
    assert u == 13 and p == pytest.approx(0.0860, abs=1e-3)
    assert mann_whitney_greater([1, 1], [1, 1]) == (2.0, 1.0)


def test_quantile_is_linear_between_order_statistics() -> None:
    assert quantile([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 0.9) == pytest.approx(9.1)
    assert quantile([5], 0.9) == 5


def test_verdicts_need_significance_margin_and_samples() -> None:
    # significant but small: 3% vs 1% on 5,000 each, margin 5% absolute -> not a regression
    canary = [True] * 150 + [False] * 4850
    baseline = [True] * 50 + [False] * 4950
    small = compare_errors(canary, baseline, margin=0.05, alpha=0.001, min_samples=50)
    assert small.p_value is not None and small.p_value < 1e-6 and not small.regressed
    assert compare_errors(canary, baseline, 0.01, 0.001, 50).regressed
    few = compare_errors([True] * 10, [False] * 10, 0.0, 0.5, 50)
    assert not few.enough and not few.regressed and few.p_value is None
    slow = [0.1 + i * 0.001 for i in range(60)]
    fast = [0.05 + i * 0.001 for i in range(60)]
    assert compare_latency("ttft_p90", slow, fast, 0.2, 0.001, 30).regressed
    assert not compare_latency("ttft_p90", fast, slow, 0.2, 0.001, 30).regressed  # faster
    assert not compare_latency("ttft_p90", slow, fast, 2.0, 0.001, 30).regressed  # margin
    assert compare_hit_rates([0.2] * 30, [0.8] * 30, 0.1, 0.001, 30).regressed
    assert not compare_hit_rates([0.75] * 30, [0.8] * 30, 0.1, 0.001, 30).regressed


def test_release_config_is_validated() -> None:
    with pytest.raises(InvalidRequestError) as err:
        ReleaseConfig(canary_weight=120)
    assert err.value.param == "canary_weight"
    with pytest.raises(InvalidRequestError) as err:
        ReleaseConfig(steps=(50, 25))
    assert err.value.param == "steps"
    with pytest.raises(InvalidRequestError) as err:
        ReleaseConfig(pin_tenants={"acme": "shadow"})
    assert err.value.param == "pin_tenants"
    with pytest.raises(InvalidRequestError) as err:
        WorkerSpec("http://a:1", version="beta")
    assert err.value.param == "version"
