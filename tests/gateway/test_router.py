"""The gateway in front of the real sluice router (one process, as `sluice serve` will
compose it), the router in front of a stub worker on a real server."""

from __future__ import annotations

import json

import httpx

from sluice.gateway.middleware import GatewayMiddleware
from sluice.gateway.store import SQLStore, UsageQuery

from .conftest import ADMIN_KEY, CHAT, make_state, new_key, serve
from .stub import PROMPT_TOKENS, StubUpstream


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
    assert [b.get("priority") for b in worker.received] == [0, 0, None]
    assert worker.received[1]["stream_options"] == {"include_usage": True}
    records = sqlite_store.query_usage(UsageQuery())
    assert [(r.endpoint, r.status, r.prompt_tokens, r.completion_tokens) for r in records] == [
        ("/v1/chat/completions", "ok", PROMPT_TOKENS, 5),
        ("/v1/chat/completions", "ok", PROMPT_TOKENS, 5),
        ("/v1/messages", "ok", PROMPT_TOKENS, 2),
        ("/v1/chat/completions", "rejected", 0, 0)]
