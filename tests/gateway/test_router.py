"""The gateway in front of the real sluice router (one process, as `sluice serve` will
compose it), the router in front of a stub worker on a real server."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator

import httpx
import pytest

from sluice.gateway.middleware import GatewayMiddleware
from sluice.gateway.state import GatewayState
from sluice.gateway.store import SQLStore, UsageQuery
from sluice.protocol.edge import load_json_object

from .conftest import ADMIN_KEY, CHAT, make_state, new_key, serve
from .stub import PROMPT_TOKENS, StubUpstream


@contextlib.asynccontextmanager
async def front_door(worker: StubUpstream, store: SQLStore
                     ) -> AsyncIterator[tuple[httpx.AsyncClient, dict[str, str], GatewayState]]:
    """`sluice serve`'s composition in front of `worker`: the router's own server
    (direct=False), the gateway over `routed_first(app)`; a client of it, a key's
    headers and the gateway's state."""
    from sluice.router.app import build_app, routed_first
    from sluice.router.config import PoolConfig, RouterConfig, WorkerSpec
    from sluice.router.server import RouterServer

    headers = {"Authorization": f"Bearer {new_key(store)}"}
    state = make_state(store)
    async with serve(worker) as worker_url:
        config = RouterConfig(pools=(PoolConfig(model="stub-model",
                                                workers=(WorkerSpec(worker_url),)),), seed=0)
        app = build_app(config)
        async with RouterServer(GatewayMiddleware(routed_first(app), state), port=0,
                                state=lambda: app.state.router, direct=False) as server, \
                httpx.AsyncClient(base_url=server.url, timeout=10) as client:
            yield client, headers, state


async def test_gateway_over_router(sqlite_store: SQLStore) -> None:
    from sluice.router.app import build_app
    from sluice.router.config import PoolConfig, RouterConfig, WorkerSpec

    worker = StubUpstream()
    key = new_key(sqlite_store, rpm=3, priority_class="interactive")
    async with serve(worker) as worker_url:
        config = RouterConfig(pools=(PoolConfig(model="stub-model",
                                                workers=(WorkerSpec(worker_url),)),),
                              health_interval_s=0.1, scrape_interval_s=0.1, seed=0,
                              admin_key=ADMIN_KEY)
        gw = GatewayMiddleware(build_app(config), make_state(sqlite_store))
        async with serve(gw, lifespan="on") as url, httpx.AsyncClient(base_url=url,
                                                                       timeout=10) as c:
            headers = {"Authorization": f"Bearer {key}"}
            r = await c.post("/v1/chat/completions", json=CHAT, headers=headers)
            assert r.status_code == 200, r.text
            assert r.headers["x-ratelimit-remaining-requests"] == "2"
            r = await c.post("/v1/chat/completions", json={**CHAT, "stream": True},
                             headers=headers)
            events = [e for e in r.text.split("\n\n") if e]
            assert events[-1] == "data: [DONE]"
            assert all(json.loads(e[6:])["choices"] for e in events[:-1])
            r = await c.post("/v1/messages", headers={"x-api-key": key}, json={
                "model": "stub-model", "max_tokens": 2,
                "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200, r.text
            r = await c.post("/v1/chat/completions", json=CHAT, headers=headers)
            assert r.status_code == 429
            # the router's own admin API: passed through, guarded by the router's key
            assert (await c.get("/admin/workers")).status_code == 401
            workers = await c.get("/admin/workers", headers={"x-admin-key": ADMIN_KEY})
            assert workers.status_code == 200 and worker_url in workers.text
    assert [b.get("priority") for b in worker.received] == [None, None, None]  # a header:
    assert [h.get("x-sluice-priority") for h in worker.headers] == ["0", "0", "0"]
    assert worker.received[1]["stream_options"] == {"include_usage": True}
    records = sqlite_store.query_usage(UsageQuery())
    assert [(r.endpoint, r.status, r.prompt_tokens, r.completion_tokens) for r in records] == [
        ("/v1/chat/completions", "ok", PROMPT_TOKENS, 5),
        ("/v1/chat/completions", "ok", PROMPT_TOKENS, 5),
        ("/v1/messages", "ok", PROMPT_TOKENS, 2),
        ("/v1/chat/completions", "rejected", 0, 0)]


async def test_shadow_and_canary_behind_the_gateway_bill_the_primary_only(
        sqlite_store: SQLStore) -> None:
    """The ledger counts what the client got: a tenant pinned to the canary is served
    (and billed) by it, and a shadow's copies, which answer with other usage, are billed
    to nobody. A client's own x-sluice-version is dropped by the gateway."""
    import asyncio

    from sluice.router.app import build_app
    from sluice.router.config import PoolConfig, ReleaseConfig, RouterConfig, WorkerSpec

    base, canary, shadow = StubUpstream(), StubUpstream(), StubUpstream(max_reply=2)
    acme, beta = new_key(sqlite_store, "acme"), new_key(sqlite_store, "beta")
    acme_id = sqlite_store.get_tenant("acme").id  # what the gateway sends on
    async with serve(base) as base_url, serve(canary) as canary_url, \
            serve(shadow) as shadow_url:
        workers = (WorkerSpec(base_url), WorkerSpec(canary_url, version="canary"),
                   WorkerSpec(shadow_url, version="shadow"))
        release = ReleaseConfig(pin_tenants={acme_id: "canary"}, shadow_percent=100)
        config = RouterConfig(pools=(PoolConfig(model="stub-model", workers=workers,
                                                release=release),), seed=0)
        gw = GatewayMiddleware(build_app(config), make_state(sqlite_store))
        async with serve(gw, lifespan="on") as url, httpx.AsyncClient(base_url=url,
                                                                       timeout=10) as c:
            r = await c.post("/v1/chat/completions", json=CHAT,
                             headers={"Authorization": f"Bearer {acme}"})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
            r = await c.post("/v1/chat/completions", json={**CHAT, "stream": True},
                             headers={"Authorization": f"Bearer {acme}"})
            assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
            r = await c.post("/v1/chat/completions", json=CHAT,
                             headers={"Authorization": f"Bearer {beta}",
                                      "x-sluice-version": "canary"})
            assert r.status_code == 200 and r.headers["x-sluice-version"] == "baseline"
            for _ in range(100):
                if len(shadow.received) == 3 and shadow.streams_finished == 1:
                    break
                await asyncio.sleep(0.02)
    assert (len(base.received), len(canary.received), len(shadow.received)) == (1, 2, 3)
    assert all(h["x-sluice-shadow"] == "1" for h in shadow.headers)
    records = sqlite_store.query_usage(UsageQuery())
    assert [(r.tenant_id == acme_id, r.status, r.completion_tokens) for r in records] == [
        (True, "ok", 5), (True, "ok", 5), (False, "ok", 5)]


async def test_gateway_over_routed_first_on_the_routers_server(sqlite_store: SQLStore) -> None:
    """`sluice serve`'s composition: the router's own server (direct=False), the gateway
    over `routed_first(app)` (routed POSTs skip FastAPI's layers). Answers, streams, and a
    client that hangs up mid-stream or before a JSON answer's first byte (the server's
    `ON_DISCONNECT`, through the gateway): the worker's request is cancelled and the
    ledger row is written once, as aborted."""
    import asyncio

    worker = StubUpstream(chunk_delay=0.05)
    async with front_door(worker, sqlite_store) as (c, headers, state):
        r = await c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2},
                         headers=headers)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 401
        async with c.stream("POST", "/v1/chat/completions", headers=headers,
                            json={**CHAT, "stream": True}) as r:
            async for _ in r.aiter_bytes():
                break  # the first event, then hang up
        for _ in range(200):
            if worker.streams_cancelled == 1 and not state.background:
                break
            await asyncio.sleep(0.02)
        worker.hold_json = True  # no byte of the answer before the client hangs up
        hanging = asyncio.create_task(c.post("/v1/chat/completions", json=CHAT,
                                             headers=headers))
        for _ in range(200):
            if len(worker.received) == 3:
                break
            await asyncio.sleep(0.02)
        hanging.cancel()
        for _ in range(200):
            if worker.json_cancelled == 1 and len(state.background) == 0 \
                    and len(sqlite_store.query_usage(UsageQuery())) == 3:
                break
            await asyncio.sleep(0.02)
    assert (worker.streams_cancelled, worker.json_cancelled) == (1, 1)
    await state.flush()
    records = sqlite_store.query_usage(UsageQuery())
    assert [r.status for r in records] == ["ok", "aborted", "aborted"]


async def test_the_router_behind_the_gateway_reads_no_body_again(
        sqlite_store: SQLStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """In one process the router takes the gateway's reading of the body (its object and
    prompt view, `ReadRequest`) instead of parsing the same bytes again, and routes what
    the gateway sends: here with the `stream_options` it added to a stream."""
    from sluice.router import parse
    from sluice.router.app import build_app, routed_first
    from sluice.router.config import PoolConfig, RouterConfig, WorkerSpec

    parsed: list[bytes] = []

    def counting(raw: bytes, param: str) -> dict:  # type: ignore[type-arg]
        parsed.append(raw)
        return load_json_object(raw, param=param)

    monkeypatch.setattr(parse, "load_json_object", counting)
    worker = StubUpstream()
    async with front_door(worker, sqlite_store) as (c, headers, state):
        r = await c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2},
                         headers=headers)
        assert r.status_code == 200, r.text
        async with c.stream("POST", "/v1/chat/completions", headers=headers,
                            json={**CHAT, "stream": True}) as s:
            events = [ln async for ln in s.aiter_lines() if ln.startswith("data: ")]
        assert s.status_code == 200 and events[-1] == "data: [DONE]"
    async with serve(worker) as worker_url:  # a router alone reads the body itself
        app = build_app(RouterConfig(pools=(PoolConfig(model="stub-model",
                                                       workers=(WorkerSpec(worker_url),)),)))
        async with serve(routed_first(app), lifespan="on") as router, \
                httpx.AsyncClient() as plain:
            assert (await plain.post(router + "/v1/chat/completions", json=CHAT)).status_code == 200
    await state.aclose()
    assert len(parsed) == 1 and json.loads(parsed[0]) == CHAT
    assert worker.received[1]["stream_options"] == {"include_usage": True}
    assert len(worker.received) == 3
