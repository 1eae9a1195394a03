"""Streams over a real server: a client that hangs up still gets exactly one record."""

from __future__ import annotations

import asyncio

import httpx

from sluice.gateway.middleware import GatewayMiddleware
from sluice.gateway.store import SQLStore, UsageQuery

from .conftest import CHAT, make_state, new_key, serve
from .stub import StubUpstream


async def wait_for_records(store: SQLStore, n: int, timeout: float = 5.0) -> None:
    for _ in range(int(timeout / 0.02)):
        if len(store.query_usage(UsageQuery())) >= n:
            return
        await asyncio.sleep(0.02)


async def test_client_abort_mid_stream_records_once_with_tokens_so_far(
        sqlite_store: SQLStore) -> None:
    stub = StubUpstream(chunk_delay=0.03, max_reply=60)
    key = new_key(sqlite_store, max_concurrent=1)
    state = make_state(sqlite_store)
    gw = GatewayMiddleware(stub, state)
    body = {**CHAT, "max_tokens": 60, "stream": True}
    async with serve(gw) as url, httpx.AsyncClient(base_url=url, timeout=10) as client:
        headers = {"Authorization": f"Bearer {key}"}
        async with client.stream("POST", "/v1/chat/completions", json=body,
                                 headers=headers) as r:
            assert r.status_code == 200
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data: {")
                if seen == 4:
                    break  # hang up mid-stream
        await wait_for_records(sqlite_store, 1)
        [rec] = sqlite_store.query_usage(UsageQuery())
        assert rec.status == "aborted"
        assert 4 <= rec.completion_tokens < 60
        assert rec.prompt_tokens > 0  # counted at admission; upstream never sent usage
        # the concurrency slot came back: the next request is admitted
        r2 = await client.post("/v1/chat/completions", json={**CHAT, "stream": True},
                               headers=headers)
        assert r2.status_code == 200 and r2.text.endswith("data: [DONE]\n\n")
        await wait_for_records(sqlite_store, 2)  # settled before its last bytes were sent
    statuses = [r.status for r in sqlite_store.query_usage(UsageQuery())]
    assert statuses == ["aborted", "ok"]
    assert state.metrics.inflight._value.get() == 0
