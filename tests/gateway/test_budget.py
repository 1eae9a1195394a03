"""Budgets hold under concurrency: requests in flight reserve their worst-case cost.

Prices: $1 per prompt token, $2 per completion token. The token counter is injected
to count 7 prompt tokens, which is what the stub reports, and the stub answers
`max_tokens` (5) completion tokens, so a request's worst case equals its real cost,
$17, and a budget of K x $17 fits exactly K requests.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from sluice.gateway.limits import LocalLimiter, RedisLimiter
from sluice.gateway.middleware import GatewayMiddleware
from sluice.gateway.pricing import Price, PriceTable
from sluice.gateway.state import GatewayState
from sluice.gateway.store import SQLStore, TenantSettings, UsageQuery, UsageRecord

from .conftest import CHAT, PG_URL, REDIS_URL, client_for, make_state, new_key, serve
from .stub import PROMPT_TOKENS, StubUpstream
from .test_streams import wait_for_records

PRICES = PriceTable({"stub-model": Price(1_000_000.0, 2_000_000.0)})
COST = 17.0  # 7 x $1 + 5 x $2
K = 4


def priced_state(store: SQLStore, limiter: Any = None) -> GatewayState:
    return make_state(store, limiter, prices=PRICES, count=lambda model, body: PROMPT_TOKENS)


async def until(predicate: Any, timeout: float = 10.0) -> None:
    for _ in range(int(timeout / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


def assert_settled(store: SQLStore, admitted: int) -> None:
    """Reservations back to 0; spend equals the ledger's sum (and `admitted` x cost)."""
    tenant = store.get_tenant("acme")
    records = store.query_usage(UsageQuery())
    assert tenant.reserved_usd == pytest.approx(0.0, abs=1e-9)
    assert tenant.spend_usd == pytest.approx(sum(r.cost_usd for r in records))
    assert tenant.spend_usd == pytest.approx(admitted * COST)


async def test_concurrent_requests_never_overrun_the_budget(any_store: SQLStore) -> None:
    key = new_key(any_store, budget_usd=K * COST)
    stub = StubUpstream()
    stub.gate = asyncio.Event()  # hold admitted requests in flight until all have arrived
    gw = GatewayMiddleware(stub, priced_state(any_store))
    async with client_for(gw, key) as c:
        tasks = [asyncio.create_task(c.post("/v1/chat/completions", json=CHAT))
                 for _ in range(3 * K)]
        await until(lambda: len(stub.received) == K and sum(t.done() for t in tasks) == 2 * K)
        assert any_store.get_tenant("acme").reserved_usd == pytest.approx(K * COST)
        stub.gate.set()
        responses = await asyncio.gather(*tasks)
    codes = Counter(r.status_code for r in responses)
    assert codes == {200: K, 429: 2 * K}
    assert {r.json()["error"]["code"] for r in responses if r.status_code == 429} == {
        "insufficient_quota"}
    assert len(stub.received) == K
    statuses = Counter(r.status for r in any_store.query_usage(UsageQuery()))
    assert statuses == {"ok": K, "rejected": 2 * K}
    assert_settled(any_store, K)
    async with client_for(gw, key) as c:  # the budget is spent: refused before reserving
        r = await c.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 429 and r.json()["error"]["code"] == "insufficient_quota"


@pytest.mark.services
async def test_two_replicas_share_one_budget(pg_store: SQLStore, redis_prefix: str) -> None:
    key = new_key(pg_store, budget_usd=K * COST)
    stub = StubUpstream()
    stub.gate = asyncio.Event()
    replicas = []
    for _ in range(2):  # each replica: its own DB engine, its own Redis connection pool
        store = SQLStore(PG_URL, table_prefix=pg_store.tenants.name.removesuffix("tenants"))
        replicas.append(GatewayMiddleware(stub, priced_state(
            store, RedisLimiter(REDIS_URL, prefix=redis_prefix))))
    clients = [client_for(gw, key) for gw in replicas]
    try:
        tasks = [asyncio.create_task(clients[i % 2].post("/v1/chat/completions", json=CHAT))
                 for i in range(3 * K)]
        await until(lambda: len(stub.received) == K and sum(t.done() for t in tasks) == 2 * K)
        stub.gate.set()
        responses = await asyncio.gather(*tasks)
    finally:
        for c in clients:
            await c.aclose()
        for gw in replicas:
            await gw.state.aclose()
    assert Counter(r.status_code for r in responses) == {200: K, 429: 2 * K}
    assert_settled(pg_store, K)


async def test_every_ending_releases_the_reservation(sqlite_store: SQLStore) -> None:
    """Upstream error, rate-limit refusal, client hang-up mid-stream: reserved goes back
    to 0 after each, and spend is what the ledger says."""
    key = new_key(sqlite_store, budget_usd=1000.0, rpm=3)
    stub = StubUpstream(chunk_delay=0.03, max_reply=60)
    gw = GatewayMiddleware(stub, priced_state(sqlite_store, LocalLimiter()))
    async with serve(gw) as url, httpx.AsyncClient(base_url=url, timeout=10) as client:
        headers = {"Authorization": f"Bearer {key}"}
        r = await client.post("/v1/chat/completions", headers=headers,
                              json={**CHAT, "model": "broken"})  # upstream 400
        assert r.status_code == 400
        async with client.stream("POST", "/v1/chat/completions", headers=headers,
                                 json={**CHAT, "max_tokens": 60, "stream": True}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    break  # hang up mid-stream
        await wait_for_records(sqlite_store, 2)
        assert (await client.post("/v1/chat/completions", headers=headers,
                                  json=CHAT)).status_code == 200
        r = await client.post("/v1/chat/completions", headers=headers, json=CHAT)
        assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
    records = sqlite_store.query_usage(UsageQuery())
    assert [r.status for r in records] == ["error", "aborted", "ok", "rejected"]
    tenant = sqlite_store.get_tenant("acme")
    assert tenant.reserved_usd == pytest.approx(0.0, abs=1e-9)
    assert tenant.spend_usd == pytest.approx(sum(r.cost_usd for r in records))
    assert records[1].cost_usd > 0 and records[2].cost_usd == pytest.approx(COST)


async def test_unpriced_or_unbudgeted_requests_reserve_nothing(sqlite_store: SQLStore) -> None:
    calls: list[float] = []
    reserve = sqlite_store.reserve_spend_many

    def spy(requests: list[tuple[str, float, float]], lease_s: float) -> list[str | None]:
        calls.extend(cost for _, cost, _ in requests)
        return reserve(requests, lease_s)

    sqlite_store.reserve_spend_many = spy  # type: ignore[method-assign]
    budgeted = new_key(sqlite_store, "acme", budget_usd=100.0)
    unbudgeted = new_key(sqlite_store, "free")
    gw = GatewayMiddleware(StubUpstream(), priced_state(sqlite_store))
    async with client_for(gw, budgeted) as c:
        assert (await c.post("/v1/chat/completions",
                             json={**CHAT, "model": "unpriced"})).status_code == 200
        assert (await c.get("/v1/models")).status_code == 200
    async with client_for(gw, unbudgeted) as c:
        assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200
    assert calls == []
    async with client_for(gw, budgeted) as c:
        assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200
    assert calls == [COST]


def record(tenant_id: str, cost: float) -> UsageRecord:
    return UsageRecord(request_id="r", tenant_id=tenant_id, key_id="k",
                       endpoint="/v1/completions", model="m", status="ok", http_status=200,
                       cost_usd=cost)


def test_reserve_spend_is_conditional(any_store: SQLStore) -> None:
    t = any_store.create_tenant("acme", TenantSettings(budget_usd=10.0))
    small = any_store.reserve_spend(t.id, 0.1 * 3, 10.0, 60)
    big = any_store.reserve_spend(t.id, 9.7, 10.0, 60)  # 0.3 + 9.7 fits to the cent
    assert small and big and small != big
    assert any_store.reserve_spend(t.id, 0.01, 10.0, 60) is None
    assert any_store.get_tenant(t.id).reserved_usd == pytest.approx(10.0)
    any_store.record_usage_many([record(t.id, 2.5)], [big])
    tenant = any_store.get_tenant(t.id)
    assert (tenant.spend_usd, tenant.reserved_usd) == pytest.approx((2.5, 0.3))
    any_store.record_usage_many([], [big])  # released once only
    assert any_store.get_tenant(t.id).reserved_usd == pytest.approx(0.3)
    assert any_store.reserve_spend(t.id, 7.2, 10.0, 60)
    assert any_store.reserve_spend(t.id, 0.01, 10.0, 60) is None


def test_expired_reservations_are_given_back_once(any_store: SQLStore) -> None:
    t = any_store.create_tenant("acme", TenantSettings(budget_usd=10.0))
    live = any_store.reserve_spend(t.id, 4.0, 10.0, 3600)
    dead = any_store.reserve_spend(t.id, 6.0, 10.0, 1)  # its gateway died
    assert live and dead
    assert any_store.expire_reservations() == 0  # not yet past the lease
    assert any_store.expire_reservations(now=time.time() + 2) == 1
    assert any_store.get_tenant(t.id).reserved_usd == pytest.approx(4.0)
    any_store.record_usage_many([record(t.id, 5.0)], [dead, live])  # dead: already back
    tenant = any_store.get_tenant(t.id)
    assert (tenant.spend_usd, tenant.reserved_usd) == pytest.approx((5.0, 0.0), abs=1e-9)
    assert any_store.expire_reservations(now=time.time() + 10_000) == 0


def test_old_tenants_table_gains_the_reserved_column(tmp_path: Any) -> None:
    url = f"sqlite:///{tmp_path / 'old.db'}"
    engine = sa.create_engine(url)
    with engine.begin() as conn:  # the tenants table as it was before reservations
        conn.execute(sa.text("CREATE TABLE sluice_tenants (id VARCHAR(40) PRIMARY KEY, "
                             "name VARCHAR(200) NOT NULL UNIQUE, settings TEXT NOT NULL, "
                             "spend_usd FLOAT NOT NULL, created_at FLOAT NOT NULL)"))
        conn.execute(sa.text("INSERT INTO sluice_tenants VALUES ('tn_1', 'old', "
                             "'{\"budget_usd\": 5.0}', 1.5, 0)"))
    engine.dispose()
    store = SQLStore(url)
    try:
        tenant = store.get_tenant("old")
        assert (tenant.spend_usd, tenant.reserved_usd) == (1.5, 0.0)
        assert store.reserve_spend("tn_1", 3.5, 5.0, 60)
        assert store.reserve_spend("tn_1", 0.5, 5.0, 60) is None
    finally:
        store.close()


class StallingLimiter(LocalLimiter):
    """Admission stalls in the limiter until `go` is set (a slow Redis, say)."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = asyncio.Event()
        self.go = asyncio.Event()

    async def acquire(self, scopes: Any, tokens: int) -> Any:
        self.entered.set()
        await self.go.wait()
        return await super().acquire(scopes, tokens)


async def test_cancelled_admission_releases_the_reservation(sqlite_store: SQLStore) -> None:
    key = new_key(sqlite_store, budget_usd=100.0)
    limiter = StallingLimiter()
    gw = GatewayMiddleware(StubUpstream(), priced_state(sqlite_store, limiter))
    async with client_for(gw, key) as c:
        task = asyncio.create_task(c.post("/v1/chat/completions", json=CHAT))
        await asyncio.wait_for(limiter.entered.wait(), 10)
        assert sqlite_store.get_tenant("acme").reserved_usd == pytest.approx(COST)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    [record] = sqlite_store.query_usage(UsageQuery())
    assert (record.status, record.cost_usd) == ("error", 0.0)
    assert sqlite_store.get_tenant("acme").reserved_usd == pytest.approx(0.0, abs=1e-9)


async def test_a_dead_gateways_reservations_come_back_after_their_lease(
        sqlite_store: SQLStore) -> None:
    key = new_key(sqlite_store, budget_usd=2 * COST)
    tenant = sqlite_store.get_tenant("acme")
    for _ in range(2):  # a replica reserved the whole budget, then was killed
        assert sqlite_store.reserve_spend(tenant.id, COST, 2 * COST, lease_s=-1.0)
    gw = GatewayMiddleware(StubUpstream(), priced_state(sqlite_store))
    async with client_for(gw, key) as c:
        r = await c.post("/v1/chat/completions", json=CHAT)  # sweeps, then fits
        assert r.status_code == 200
        # the next sweep is at most every 10 s: a full budget refuses without sweeping
        assert sqlite_store.reserve_spend(tenant.id, COST, 2 * COST, lease_s=-1.0)
        r = await c.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 429 and r.json()["error"]["code"] == "insufficient_quota"
    tenant = sqlite_store.get_tenant("acme")
    assert tenant.spend_usd == pytest.approx(COST)
    assert tenant.reserved_usd == pytest.approx(COST)  # the second dead one, not yet swept


async def test_cancelled_while_reserving_gives_the_reservation_back(
        sqlite_store: SQLStore) -> None:
    key = new_key(sqlite_store, budget_usd=100.0)
    entered, go = threading.Event(), threading.Event()
    reserve = sqlite_store.reserve_spend_many

    def slow(requests: list[tuple[str, float, float]], lease_s: float) -> list[str | None]:
        entered.set()
        go.wait(10)  # the commit is slow; the client is cancelled meanwhile
        return reserve(requests, lease_s)

    sqlite_store.reserve_spend_many = slow  # type: ignore[method-assign]
    gw = GatewayMiddleware(StubUpstream(), priced_state(sqlite_store))
    async with client_for(gw, key) as c:
        task = asyncio.create_task(c.post("/v1/chat/completions", json=CHAT))
        assert await asyncio.to_thread(entered.wait, 10)
        task.cancel()
        go.set()
        with pytest.raises(asyncio.CancelledError):
            await task
    [record] = sqlite_store.query_usage(UsageQuery())
    assert record.status == "error"
    assert sqlite_store.get_tenant("acme").reserved_usd == pytest.approx(0.0, abs=1e-9)


async def test_a_worst_case_only_a_new_budget_fits_is_told_not_to_retry(
        sqlite_store: SQLStore) -> None:
    """A request whose worst case does not fit what its tenant has left, with nothing
    in flight that could give budget back, can only pass after a reset or a larger
    budget, as a spent budget: `x-should-retry: false` (the SDKs retried it twice, three
    refused records per call). Where requests in flight hold the rest, they may give it
    back, so a retry may pass: that refusal keeps no such header."""
    key = new_key(sqlite_store, budget_usd=1.5 * COST)
    stub = StubUpstream()
    gw = GatewayMiddleware(stub, priced_state(sqlite_store))
    async with client_for(gw, key) as c:
        assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200
        r = await c.post("/v1/chat/completions", json=CHAT)  # $8.50 left, $17 asked
        assert r.status_code == 429 and r.json()["error"]["code"] == "insufficient_quota"
        assert r.headers["x-should-retry"] == "false"
        sqlite_store.reset_spend("acme")
        stub.gate = asyncio.Event()  # one request in flight holds $17 of $25.50
        held = asyncio.create_task(c.post("/v1/chat/completions", json=CHAT))
        await until(lambda: len(stub.received) == 2)
        r = await c.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 429 and "x-should-retry" not in r.headers
        stub.gate.set()
        assert (await held).status_code == 200


async def test_a_budget_over_an_unpriced_model_is_logged_once(
        sqlite_store: SQLStore, caplog: pytest.LogCaptureFixture) -> None:
    """A tenant's budget over a model the price table does not price (no `--prices` at
    all, the common first setup) never bites: every request costs $0. That was silent;
    the gateway says so in its log, once per model."""
    key = new_key(sqlite_store, budget_usd=1.0)
    gw = GatewayMiddleware(StubUpstream(), make_state(sqlite_store))  # no price table
    with caplog.at_level("WARNING", logger="sluice.gateway.middleware"):
        async with client_for(gw, key) as c:
            for _ in range(3):
                assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200
    warned = [r.getMessage() for r in caplog.records if "no price" in r.getMessage()]
    assert len(warned) == 1 and "'stub-model'" in warned[0] and "acme" in warned[0]
