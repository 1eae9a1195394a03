"""Several gateway replicas sharing PostgreSQL and Redis: limits hold globally."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from sluice.gateway.limits import RedisLimiter
from sluice.gateway.middleware import GatewayMiddleware
from sluice.gateway.store import SQLStore, UsageQuery

from .conftest import CHAT, PG_URL, REDIS_URL, client_for, make_state, new_key
from .stub import StubUpstream

pytestmark = pytest.mark.services


async def test_two_replicas_admit_exactly_the_rpm_limit(pg_store: SQLStore,
                                                        redis_prefix: str) -> None:
    key = new_key(pg_store, rpm=20)
    stub = StubUpstream()
    replicas = []
    for _ in range(2):  # each replica: its own DB engine, its own Redis connection pool
        store = SQLStore(PG_URL, table_prefix=pg_store.tenants.name.removesuffix("tenants"))
        limiter = RedisLimiter(REDIS_URL, prefix=redis_prefix)
        replicas.append(GatewayMiddleware(stub, make_state(store, limiter)))
    clients = [client_for(gw, key) for gw in replicas]
    try:
        responses = await asyncio.gather(*[
            clients[i % 2].post("/v1/chat/completions", json=CHAT) for i in range(60)])
    finally:
        for c in clients:
            await c.aclose()
        for gw in replicas:
            await gw.state.aclose()
    codes = Counter(r.status_code for r in responses)
    assert codes == {200: 20, 429: 40}
    assert len(stub.received) == 20
    statuses = Counter(r.status for r in pg_store.query_usage(UsageQuery()))
    assert statuses == {"ok": 20, "rejected": 40}


async def test_concurrency_slots_are_global_across_replicas(pg_store: SQLStore,
                                                            redis_prefix: str) -> None:
    key = new_key(pg_store, max_concurrent=3)
    stub = StubUpstream()
    stub.gate = asyncio.Event()
    replicas = [GatewayMiddleware(stub, make_state(pg_store, RedisLimiter(REDIS_URL,
                                                                         prefix=redis_prefix)))
                for _ in range(2)]
    clients = [client_for(gw, key) for gw in replicas]
    try:
        tasks = [asyncio.create_task(clients[i % 2].post("/v1/chat/completions", json=CHAT))
                 for i in range(3)]
        while len(stub.received) < 3:
            await asyncio.sleep(0.01)
        for c in clients:
            assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 429
        stub.gate.set()
        assert [(await t).status_code for t in tasks] == [200] * 3
        assert (await clients[1].post("/v1/chat/completions", json=CHAT)).status_code == 200
    finally:
        for c in clients:
            await c.aclose()
        for gw in replicas:
            await gw.state.limiter.close()


@pytest.mark.parametrize("mode,expected", [("closed", 503), ("open", 200)])
async def test_redis_down_fails_as_configured(sqlite_store: SQLStore, mode: str,
                                              expected: int) -> None:
    key = new_key(sqlite_store, rpm=1)
    limiter = RedisLimiter("redis://127.0.0.1:1/0", timeout_s=0.2)
    state = make_state(sqlite_store, limiter, on_redis_error=mode)
    gw = GatewayMiddleware(StubUpstream(), state)
    async with client_for(gw, key) as c:
        responses = [await c.post("/v1/chat/completions", json=CHAT) for _ in range(2)]
    assert [r.status_code for r in responses] == [expected, expected]
    if mode == "closed":
        error = responses[0].json()["error"]
        assert (error["type"], error["code"]) == ("service_unavailable", "limiter_unavailable")
        assert responses[0].headers["retry-after"] == "1"
    assert state.metrics.limiter_errors.labels(mode=mode)._value.get() == 2
    statuses = [r.status for r in sqlite_store.query_usage(UsageQuery())]
    assert statuses == (["rejected"] * 2 if mode == "closed" else ["ok"] * 2)
    await limiter.close()
