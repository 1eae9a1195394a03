"""The router over real HTTP: stub workers and the router on 127.0.0.1, every test run
against both front ends: `sluice router`'s own server (`RouterServer`) and the ASGI app
under uvicorn (how the gateway and `sluice serve` compose it)."""

from __future__ import annotations

import asyncio
import functools
import json
import random
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from router_stubs import (
    StubState,
    chat_text,
    free_port,
    make_stub,
    serve,
    serve_router,
    word_ids,
)
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

import sluice
from sluice.engine.kv_events import KVEventPublisher
from sluice.protocol.block_hash import hash_blocks
from sluice.protocol.kv_events import BlockRemoved, BlockStored
from sluice.protocol.prompt import RESUME_HEADER, TOKENIZER_HEADER, ResumeIds
from sluice.router.app import build_app
from sluice.router.config import PoolConfig, RouterConfig, WorkerSpec
from sluice.router.server import RouterServer

Front = Callable[[Any], AbstractAsyncContextManager[str]]
Cluster = Callable[..., AbstractAsyncContextManager[tuple[str, dict[str, str]]]]
FRONTS: dict[str, Front] = {"server": serve_router, "uvicorn": serve}
ADMIN_KEY = "test-admin"
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}


@pytest.fixture(params=sorted(FRONTS))
def cluster(request: pytest.FixtureRequest) -> Cluster:
    """`cluster(states, ...)` with the router behind one front end or the other."""
    return functools.partial(_cluster, FRONTS[request.param])


@asynccontextmanager
async def _cluster(front: Front, states: list[StubState], policy: str = "round_robin",
                  extra_urls: tuple[str, ...] = (), kv: dict[str, str] | None = None,
                  groups: dict[str, str] | None = None, pool_kw: dict[str, Any] | None = None,
                  **router_kw: Any) -> AsyncIterator[tuple[str, dict[str, str]]]:
    """Stub workers + a router in front; yields the router URL and {stub name: URL}."""
    async with AsyncExitStack() as stack:
        urls = [await stack.enter_async_context(serve(make_stub(s))) for s in states]
        names = {s.name: u for s, u in zip(states, urls, strict=True)}
        kv = kv or {}
        groups = groups or {}
        workers = tuple(WorkerSpec(u, kv_events=kv.get(s.name), group=groups.get(s.name, "short"))
                        for s, u in zip(states, urls, strict=True))
        workers += tuple(WorkerSpec(u) for u in extra_urls)
        config = RouterConfig(pools=(PoolConfig(model="stub-model", aliases=("alias",),
                                                workers=workers, policy=policy,
                                                **(pool_kw or {})),),
                              **{"health_interval_s": 0.1, "scrape_interval_s": 0.1, "seed": 0,
                                 "admin_key": ADMIN_KEY, **router_kw})
        app = build_app(config, rng=random.Random(0))
        router_url = await stack.enter_async_context(front(app))
        yield router_url, names


def chat(content: str, stream: bool = False, **kw: Any) -> dict[str, Any]:
    return {"model": "stub-model", "messages": [{"role": "user", "content": content}],
            "stream": stream, **kw}


async def test_proxies_plain_and_streamed_responses_and_models(cluster: Cluster) -> None:
    a = StubState("a", num_tokens=4)
    async with cluster([a]) as (router, _), httpx.AsyncClient(base_url=router) as c:
        r = await c.post("/v1/chat/completions", json=chat("hi"))
        assert r.status_code == 200
        assert r.json()["choices"][0]["message"]["content"] == "a-0 a-1 a-2 a-3"
        async with c.stream("POST", "/v1/completions",
                            json={"model": "stub-model", "prompt": "x", "stream": True}) as s:
            assert s.headers["content-type"].startswith("text/event-stream")
            lines = [ln async for ln in s.aiter_lines() if ln.startswith("data:")]
        assert lines[-1] == "data: [DONE]" and len(lines) == 5
        assert json.loads(lines[0][5:])["choices"][0]["text"] == "a-0 "
        models = (await c.get("/v1/models")).json()
        assert [m["id"] for m in models["data"]] == ["stub-model", "alias"]
        assert (await c.get("/liveness")).json() == {"status": "alive"}
        one = await c.get("/v1/models/alias")  # the OpenAI SDK's models.retrieve
        assert one.status_code == 200 and one.json() == models["data"][1]
        missing = await c.get("/v1/models/nope")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
        # an alias is rewritten to the model the worker serves
        r = await c.post("/v1/chat/completions", json={**chat("hi"), "model": "alias"})
        assert r.status_code == 200 and a.requests[-1]["model"] == "stub-model"
        # the worker sees the client's headers (an API key, say)
        await c.post("/v1/chat/completions", json=chat("hi"), headers={"authorization": "Bearer k"})
        assert a.headers[-1]["authorization"] == "Bearer k"


async def test_errors_are_openai_json(cluster: Cluster) -> None:
    async with cluster([StubState("a")]) as (router, _), httpx.AsyncClient(base_url=router) as c:
        r = await c.post("/v1/chat/completions", json={**chat("hi"), "model": "nope"})
        assert r.status_code == 404
        assert r.json()["error"]["param"] == "model"
        assert r.json()["error"]["code"] == "model_not_found"
        r = await c.post("/v1/chat/completions", content=b"{not json")
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        r = await c.post("/v1/chat/completions", json={"messages": []})
        assert r.status_code == 400 and r.json()["error"]["param"] == "model"
        for method, path in (("GET", "/v1/responses/resp_1"), ("DELETE", "/v1/responses/resp_1"),
                             ("POST", "/v1/responses/resp_1/cancel"),
                             ("GET", "/v1/responses/resp_1/input_items")):
            r = await c.request(method, path)  # the router keeps none (the gateway does)
            assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found"


async def test_no_healthy_worker_is_503_with_retry_after(cluster: Cluster) -> None:
    a = StubState("a", fail_status=503)
    async with cluster([a], max_retries=1) as (router, _), httpx.AsyncClient(base_url=router) as c:
        r = await c.post("/v1/chat/completions", json=chat("hi"))
        assert r.status_code == 503
        assert r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "no_healthy_worker"
        assert len(a.requests) == 1  # the only worker is not retried twice


async def test_a_request_no_worker_reached_is_held_for_a_replacement(cluster: Cluster) -> None:
    """With buffering on, a request whose only worker is unreachable (it just died, and
    still looks ready until the probes eject it) waits for a worker to be ready again
    (here one the admin API adds, as the backend's replacement) instead of a 503 at once
    (found by a new-user pass: `kill -9` of a one-worker pool's worker gave 503s for the
    ~2 s its replacement took). A worker that answers with an error is not waited for."""
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: connect errors
    async with serve(make_stub(StubState("b"))) as replacement, \
            cluster([], extra_urls=(dead,), buffer_timeout_s=10.0, health_interval_s=60) \
            as (router, _), httpx.AsyncClient(base_url=router, timeout=20) as c:
        async def replace() -> None:
            await asyncio.sleep(0.3)
            r = await c.post("/admin/workers", json={"url": replacement},
                             headers={"authorization": f"Bearer {ADMIN_KEY}"})
            assert r.status_code == 201, r.text

        adding = asyncio.ensure_future(replace())
        r = await c.post("/v1/chat/completions", json=chat("hi"))
        await adding
        assert r.status_code == 200 and r.json()["worker"] == "b", r.text
        # one request, one count: each try while held (every poll, the dead worker still
        # looking ready) counted a 503 of its own in sluice_router_requests_total
        metrics = (await c.get("/metrics")).text
        assert 'sluice_router_requests_total{model="stub-model",status="200"} 1.0' in metrics
        assert 'status="503"' not in metrics, metrics
    busy = StubState("a", fail_status=503)
    async with cluster([busy], max_retries=1, buffer_timeout_s=10.0) as (router, _), \
            httpx.AsyncClient(base_url=router) as c:
        r = await c.post("/v1/chat/completions", json=chat("hi"))
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_healthy_worker"
        assert len(busy.requests) == 1  # answered at once, not held


async def test_a_request_no_worker_reached_is_sent_once_when_not_held(cluster: Cluster) -> None:
    """Buffering off (`sluice router`'s default): a request whose only worker is
    unreachable is tried there once and answered 503. It was forwarded twice back to back
    (the buffer's hold made an attempt of its own right after the router's first one),
    so the dead worker took two connect errors per request toward its breaker, and
    `sluice_router_requests_total{status="503"}` counted one request twice. Held (timeout
    on), the second attempt waits a poll."""
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: connect errors
    async with cluster([], extra_urls=(dead,), health_interval_s=60) as (router, _), \
            httpx.AsyncClient(base_url=router) as c:
        r = await c.post("/v1/chat/completions", json=chat("hi"))
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_healthy_worker"
        metrics = (await c.get("/metrics")).text
    assert f'sluice_router_retries_total{{reason="ConnectError",worker="{dead}"}} 1.0' \
        in metrics, metrics
    assert 'sluice_router_requests_total{model="stub-model",status="503"} 1.0' in metrics


async def test_retries_before_first_byte_on_another_worker(cluster: Cluster) -> None:
    bad = StubState("bad", fail_status=500)
    good = StubState("good")
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: connect error
    async with cluster([bad, good], extra_urls=(dead,), eject_after_failures=100,
                       health_interval_s=60) as (router, _), \
            httpx.AsyncClient(base_url=router) as c:
        for _ in range(6):
            r = await c.post("/v1/chat/completions", json=chat("hi", stream=True))
            assert r.status_code == 200 and "good-0" in r.text
        assert len(good.requests) == 6 and len(bad.requests) >= 1
        metrics = (await c.get("/metrics")).text
        assert 'sluice_router_retries_total{reason="status 500"' in metrics
        assert 'reason="ConnectError"' in metrics


async def test_ejection_and_readmission(cluster: Cluster) -> None:
    flaky, steady = StubState("flaky"), StubState("steady")
    async with cluster([flaky, steady], eject_after_failures=2, readmit_after_successes=2,
                       health_interval_s=0.05) as (router, urls), \
            httpx.AsyncClient(base_url=router) as c:
        flaky.healthy = False
        await wait_for(lambda: worker(c, urls["flaky"]), lambda w: not w["healthy"])
        before = len(flaky.requests)
        for _ in range(6):
            assert (await c.post("/v1/chat/completions", json=chat("x"))).status_code == 200
        assert len(flaky.requests) == before  # ejected: no traffic
        assert len(steady.requests) >= 6
        flaky.healthy = True
        await wait_for(lambda: worker(c, urls["flaky"]), lambda w: w["healthy"])
        for _ in range(6):
            await c.post("/v1/chat/completions", json=chat("x"))
        assert len(flaky.requests) == before + 3  # round robin again
        m = (await c.get("/metrics")).text
        assert "sluice_router_ejections_total" in m and "sluice_router_readmissions_total" in m


async def worker(c: httpx.AsyncClient, url: str) -> dict[str, Any]:
    """The router's view of one worker (GET /admin/workers)."""
    pools = (await c.get("/admin/workers", headers=ADMIN)).json()["pools"]
    return next(w for p in pools for w in p["workers"] if w["url"] == url)


async def wait_for(get: Any, pred: Any, timeout: float = 5.0) -> Any:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        value = await get()
        if pred(value):
            return value
        assert asyncio.get_running_loop().time() < deadline, f"timed out: {value}"
        await asyncio.sleep(0.02)


async def test_client_disconnect_cancels_upstream_and_frees_the_slot(cluster: Cluster) -> None:
    slow = StubState("slow", num_tokens=200, token_delay_s=0.05)
    async with cluster([slow]) as (router, urls), httpx.AsyncClient(base_url=router) as c:
        async with c.stream("POST", "/v1/chat/completions", json=chat("hi", stream=True)) as s:
            async for line in s.aiter_lines():
                if line.startswith("data:"):
                    break  # got the first token: hang up
            assert (await worker(c, urls["slow"]))["inflight"] == 1
        await asyncio.wait_for(slow.cancel_event.wait(), 5)
        assert slow.cancelled == 1 and slow.completed == 0
        await wait_for(lambda: worker(c, urls["slow"]), lambda w: w["inflight"] == 0)


async def test_streaming_requests_count_until_their_stream_ends(cluster: Cluster) -> None:
    a = StubState("a", num_tokens=30, token_delay_s=0.02)
    b = StubState("b", num_tokens=30, token_delay_s=0.02)
    async with cluster([a, b], policy="least_load", scrape_interval_s=60) as (router, _), \
            httpx.AsyncClient(base_url=router) as c:
        async def one() -> str:
            async with c.stream("POST", "/v1/chat/completions", json=chat("x", stream=True)) as s:
                return await s.aread()  # type: ignore[return-value]

        first = asyncio.create_task(one())

        async def dispatched() -> int:
            return len(a.requests) + len(b.requests)

        await wait_for(dispatched, lambda n: n == 1)  # the stream is open (30 × 20 ms)
        await one()  # must go to the other worker: the open stream still counts
        await first
        assert len(a.requests) == 1 and len(b.requests) == 1


async def test_session_affinity_by_header_and_user_field(cluster: Cluster) -> None:
    states = [StubState(n) for n in ("a", "b", "c")]
    async with cluster(states, policy="session") as (router, _), \
            httpx.AsyncClient(base_url=router) as c:
        homes: dict[str, set[str]] = {}
        for turn in range(3):
            for s in range(8):
                r = await c.post("/v1/chat/completions", json=chat(f"turn {turn}"),
                                 headers={"x-session-id": f"s{s}"})
                homes.setdefault(f"s{s}", set()).add(r.json()["worker"])
        assert all(len(h) == 1 for h in homes.values())  # sticky
        assert len({next(iter(h)) for h in homes.values()}) >= 2  # spread
        users = {(await c.post("/v1/chat/completions", json=chat("q", user="u1"))).json()["worker"]
                 for _ in range(4)}
        assert len(users) == 1


async def test_kv_events_steer_requests_to_the_worker_holding_the_prefix(cluster: Cluster) -> None:
    ports = {"a": free_port(), "b": free_port()}
    kv = {n: f"tcp://127.0.0.1:{p}" for n, p in ports.items()}
    pubs = {n: KVEventPublisher(ep) for n, ep in kv.items()}
    a, b = StubState("a"), StubState("b")
    prompt = "a long shared system prompt " * 20  # 100 words -> 6 full blocks
    msgs = [{"role": "user", "content": prompt}]
    hashes = hash_blocks(word_ids(chat_text(msgs)), 16)
    try:
        async with cluster([a, b], policy="kv", kv=kv) as (router, urls), \
                httpx.AsyncClient(base_url=router) as c:
            # the engines' events arrive over ZMQ; repeat until the subscriber is connected
            async def stored_on(name: str) -> None:
                for _ in range(100):
                    pubs[name].publish([BlockStored(hashes, None, [], 16)])
                    await asyncio.sleep(0.02)
                    m = (await c.get("/metrics")).text
                    if f'sluice_router_kv_events_total{{type="BlockStored",worker="{urls[name]}"}}' in m:
                        return
                raise AssertionError("KV events never arrived")

            await stored_on("b")
            for _ in range(4):
                r = await c.post("/v1/chat/completions", json={**chat(prompt)})
                assert r.json()["worker"] == "b"
            pubs["b"].publish([BlockRemoved(hashes)])
            await stored_on("a")
            removed = f'sluice_router_kv_events_total{{type="BlockRemoved",worker="{urls["b"]}"}}'

            async def metrics() -> str:
                return (await c.get("/metrics")).text

            await wait_for(metrics, lambda m: removed in m)
            r = await c.post("/v1/chat/completions", json={**chat(prompt)})
            assert r.json()["worker"] == "a"
    finally:
        for p in pubs.values():
            p.close()


async def test_cost_policy_keeps_shared_prefixes_together_and_spreads_cold_ones(cluster: Cluster) -> None:
    states = [StubState(n) for n in ("a", "b", "c")]
    async with cluster(states, policy="cost") as (router, _), \
            httpx.AsyncClient(base_url=router) as c:
        systems = [f"system prompt number {i} " * 12 for i in range(3)]
        homes: dict[int, set[str]] = {}
        for turn in range(4):
            for i, sys_prompt in enumerate(systems):
                body = {"model": "stub-model", "messages": [
                    {"role": "system", "content": sys_prompt},
                    {"role": "user", "content": f"question {turn}"}]}
                homes.setdefault(i, set()).add(
                    (await c.post("/v1/chat/completions", json=body)).json()["worker"])
        assert all(len(h) == 1 for h in homes.values())  # each prefix stays on one worker
        assert len({next(iter(h)) for h in homes.values()}) == 3  # cold prefixes spread
        m = (await c.get("/metrics")).text
        hit = [ln for ln in m.splitlines()
               if ln.startswith('sluice_router_estimated_prefix_hit_tokens_total{policy="cost"}')]
        assert float(hit[0].split()[-1]) > 0


async def test_long_prompts_go_to_the_long_group(cluster: Cluster) -> None:
    short, long_ = StubState("short"), StubState("long")
    async with cluster([short, long_], policy="least_load", groups={"long": "long"},
                       pool_kw={"long_prompt_tokens": 20}) as (router, _), \
            httpx.AsyncClient(base_url=router) as c:
        for _ in range(3):
            assert (await c.post("/v1/chat/completions", json=chat("brief"))).json()["worker"] == "short"
            r = await c.post("/v1/chat/completions", json=chat("word " * 40))
            assert r.json()["worker"] == "long"


async def test_admin_add_drain_remove_with_key(cluster: Cluster) -> None:
    a, b = StubState("a"), StubState("b")
    async with serve(make_stub(b)) as b_url, \
            cluster([a], admin_key="sekrit") as (router, urls), \
            httpx.AsyncClient(base_url=router) as c:
        key = {"authorization": "Bearer sekrit"}
        assert (await c.get("/admin/workers")).status_code == 401
        r = await c.post("/admin/workers", json={"url": b_url}, headers={"x-admin-key": "wrong"})
        assert r.status_code == 401
        r = await c.post("/admin/workers", json={"url": b_url, "bogus": 1}, headers=key)
        assert r.status_code == 400 and r.json()["error"]["param"] == "bogus"
        # the pool has no long_prompt_tokens: a long worker would never be chosen
        r = await c.post("/admin/workers", json={"url": b_url, "group": "long"}, headers=key)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "long_prompt_tokens"
        # nor is it disaggregated: a prefill worker's role was ignored (it got whole
        # requests)
        r = await c.post("/admin/workers", json={"url": b_url, "role": "prefill"}, headers=key)
        assert r.status_code == 400 and r.json()["error"]["param"] == "role", r.text
        r = await c.post("/admin/workers", json={"url": b_url}, headers=key)
        assert r.status_code == 201 and r.json()["models"] == ["stub-model"]
        for _ in range(4):
            await c.post("/v1/chat/completions", json=chat("x"))
        assert len(b.requests) == 2
        r = await c.post("/admin/workers/drain", json={"url": urls["a"]}, headers=key)
        assert r.json()["draining"] is True
        for _ in range(3):
            assert (await c.post("/v1/chat/completions", json=chat("x"))).json()["worker"] == "b"
        r = await c.request("DELETE", "/admin/workers", json={"url": b_url}, headers=key)
        assert r.status_code == 200
        r = await c.post("/v1/chat/completions", json=chat("x"))
        assert r.status_code == 503  # a drains, b is gone
        await c.post("/admin/workers/drain", json={"url": urls["a"], "drain": False}, headers=key)
        assert (await c.post("/v1/chat/completions", json=chat("x"))).json()["worker"] == "a"
        r = await c.request("DELETE", "/admin/workers", params={"url": b_url}, headers=key)
        assert r.status_code == 404


async def test_a_worker_added_at_runtime_takes_requests_only_once_a_probe_answered(
        cluster: Cluster) -> None:
    """`POST /admin/workers` for a worker whose /health does not answer 200 yet (still
    loading its model): it is listed, not healthy, and gets no request until a probe
    passes; that first pass is an admission, not a re-admission. It was healthy from the
    moment it was added, so requests went to it until three probes had failed."""
    a, b = StubState("a"), StubState("b", healthy=False)
    async with serve(make_stub(b)) as b_url, cluster([a]) as (router, _), \
            httpx.AsyncClient(base_url=router) as c:
        r = await c.post("/admin/workers", json={"url": b_url}, headers=ADMIN)
        assert r.status_code == 201 and r.json()["healthy"] is False, r.text
        for _ in range(6):
            r = await c.post("/v1/chat/completions", json=chat("x"))
            assert r.status_code == 200 and r.json()["worker"] == "a"
        assert b.requests == []
        b.healthy = True
        await wait_for(lambda: worker(c, b_url), lambda w: w["healthy"])
        for _ in range(4):
            assert (await c.post("/v1/chat/completions", json=chat("x"))).status_code == 200
        assert len(b.requests) == 2  # round robin, now over both
        metrics = (await c.get("/metrics")).text
        assert f'sluice_router_readmissions_total{{worker="{b_url}"}}' not in metrics
        assert f'sluice_router_ejections_total{{worker="{b_url}"}}' not in metrics


async def test_a_worker_of_another_model_does_not_join_a_pool_unnamed(
        cluster: Cluster) -> None:
    """`POST /admin/workers {"url"}` without `model` joins the only pool; a worker that
    serves none of that pool's models is refused (400 naming `model`) instead of taking
    its requests: its answers were another model's (the router sends a pool's name as
    the model the worker lists). Named, it makes a pool of its own."""
    a, other = StubState("a"), StubState("o", model="other-model")
    async with serve(make_stub(other)) as o_url, cluster([a]) as (router, urls), \
            httpx.AsyncClient(base_url=router, headers=ADMIN) as c:
        r = await c.post("/admin/workers", json={"url": o_url})
        assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
        assert "other-model" in r.json()["error"]["message"]
        pools = (await c.get("/admin/workers")).json()["pools"]
        assert [[w["url"] for w in p["workers"]] for p in pools] == [[urls["a"]]]
        for _ in range(4):
            r = await c.post("/v1/chat/completions", json=chat("x"))
            assert r.status_code == 200 and r.json()["worker"] == "a"
        r = await c.post("/admin/workers", json={"url": o_url, "model": "other-model"})
        assert r.status_code == 201, r.text
        r = await c.post("/v1/chat/completions", json={**chat("x"), "model": "other-model"})
        assert r.status_code == 200 and r.json()["worker"] == "o"
        assert other.requests[0]["model"] == "other-model"


async def test_a_pool_the_admin_api_made_for_a_mistyped_model_goes_with_its_workers(
        cluster: Cluster) -> None:
    """`POST /admin/workers {"model": "stub-modle"}` (a typo) makes a pool of that name;
    once its worker is removed the name is gone again (/v1/models, /admin/workers, a
    request for it is 404 as for any unknown model). The empty pool stayed: listed as a
    served model, and a request for the typo was held, then 503. A worker already in a
    pool is refused under another model's name, and an add that fails leaves no pool."""
    a, b = StubState("a"), StubState("b")
    async with serve(make_stub(b)) as b_url, cluster([a]) as (router, urls), \
            httpx.AsyncClient(base_url=router, headers=ADMIN) as c:
        async def models() -> list[str]:
            return [m["id"] for m in (await c.get("/v1/models")).json()["data"]]

        async def pools() -> list[list[str]]:
            return [p["models"] for p in (await c.get("/admin/workers")).json()["pools"]]

        r = await c.post("/admin/workers", json={"url": b_url, "model": "stub-modle"})
        assert r.status_code == 201, r.text
        assert "stub-modle" in await models()
        r = await c.request("DELETE", "/admin/workers", params={"url": b_url})
        assert r.status_code == 200, r.text
        assert await models() == ["stub-model", "alias"]
        assert await pools() == [["stub-model", "alias"]]
        r = await c.post("/v1/chat/completions", json={**chat("x"), "model": "stub-modle"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        # a worker is in one pool: not added again under a mistyped name
        r = await c.post("/admin/workers", json={"url": urls["a"], "model": "stub-modle"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "url", r.text
        # an add refused by the new pool (a long worker, no long_prompt_tokens)
        r = await c.post("/admin/workers", json={"url": b_url, "model": "other",
                                                 "group": "long"})
        assert r.status_code == 400, r.text
        assert await models() == ["stub-model", "alias"]
        assert await pools() == [["stub-model", "alias"]]
        # a pool named in the configuration stays when its last worker leaves
        r = await c.request("DELETE", "/admin/workers", params={"url": urls["a"]})
        assert r.status_code == 200
        assert await pools() == [["stub-model", "alias"]]


async def test_tokenize_passes_through_and_health_reports_workers(cluster: Cluster) -> None:
    a = StubState("a")
    async with cluster([a]) as (router, _), httpx.AsyncClient(base_url=router) as c:
        r = await c.post("/tokenize", json={"model": "stub-model", "prompt": "one two three"})
        assert r.status_code == 200 and r.json()["count"] == 3
        # a pool alias reaches the worker as the model it serves, as on /v1/chat (it went
        # as the alias, which a worker refuses: 404 for a name the router had accepted)
        r = await c.post("/tokenize", json={"model": "alias", "prompt": "one two"})
        assert r.status_code == 200 and a.tokenized_models[-1] == "stub-model"
        h = await c.get("/health")
        assert h.status_code == 200 and h.json()["healthy_workers"] == 1


async def test_liveness_answers_while_no_worker_is_healthy(cluster: Cluster) -> None:
    """`/health` is 503 without a healthy worker; `/liveness` (what an orchestrator
    probes: the router holds requests while workers start) stays 200."""
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens
    async with cluster([], extra_urls=(dead,)) as (router, _), \
            httpx.AsyncClient(base_url=router) as c:
        for _ in range(200):  # bounded: the first probe marks the worker down
            if (await c.get("/health")).status_code == 503:
                break
            await asyncio.sleep(0.05)
        assert (await c.get("/health")).json()["healthy_workers"] == 0
        r = await c.get("/liveness")
        assert r.status_code == 200 and r.json() == {"status": "alive"}
        r = await c.get("/version")  # vLLM's, the router's own as /liveness
        assert r.status_code == 200 and r.json() == {"version": sluice.__version__}


async def test_anthropic_messages_are_routed_with_the_body_unchanged(cluster: Cluster) -> None:
    a = StubState("a")
    async with cluster([a], policy="cost") as (router, _), httpx.AsyncClient(base_url=router) as c:
        body = {"model": "stub-model", "max_tokens": 5, "system": "Be brief.",
                "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
        r = await c.post("/v1/messages", json=body, headers={"anthropic-version": "2023-06-01"})
        assert r.status_code == 200 and r.json()["worker"] == "a"
        assert a.requests[-1] == body
        assert a.headers[-1]["anthropic-version"] == "2023-06-01"


async def test_token_ids_past_u32_go_to_a_worker_unhashed(cluster: Cluster,
                                                         tiny_llama_dir: Path) -> None:
    """A completion prompt of ids outside [0, 2**32) (the fuzzer's, through `sluice
    serve`): the router's block hash failed on it, a 500 (502 through the gateway). Now
    the one prompt view refuses it, so the router routes it without tokens and the
    worker judges it (a sluice worker's 400 naming `prompt`; this stub answers)."""
    a = StubState("a")
    async with cluster([a], policy="cost", pool_kw={"tokenizer": str(tiny_llama_dir)}) \
            as (router, _), httpx.AsyncClient(base_url=router) as c:
        for prompt in ([-1] + [5] * 40, [[2**40] * 40]):  # in a full block: hashed
            body = {"model": "stub-model", "prompt": prompt, "max_tokens": 2}
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            assert a.requests[-1] == body


async def test_disconnect_before_the_first_token_cancels_upstream(cluster: Cluster) -> None:
    slow = StubState("slow", ttft_s=10.0)  # headers at once, the first token never in time
    async with cluster([slow]) as (router, urls), httpx.AsyncClient(base_url=router) as c:
        async def hang_up() -> None:
            await c.post("/v1/chat/completions", json=chat("hi", stream=True))

        task = asyncio.create_task(hang_up())
        await wait_for(lambda: worker(c, urls["slow"]), lambda w: w["inflight"] == 1)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.wait_for(slow.cancel_event.wait(), 5)
        await wait_for(lambda: worker(c, urls["slow"]), lambda w: w["inflight"] == 0)


async def test_busy_503_is_retried_elsewhere_but_never_ejects(cluster: Cluster) -> None:
    busy, ok = StubState("busy", fail_status=503), StubState("ok")
    async with cluster([busy, ok], eject_after_failures=2) as (router, urls), \
            httpx.AsyncClient(base_url=router) as c:
        for _ in range(6):
            assert (await c.post("/v1/chat/completions", json=chat("x"))).json()["worker"] == "ok"
        assert (await worker(c, urls["busy"]))["healthy"] is True
        assert len(busy.requests) >= 3  # still offered: an ejected worker would stop at 2


async def test_prompt_tokens_come_from_worker_tokenize_cached_and_skipped_when_missing(cluster: Cluster) -> None:
    a = StubState("a")
    async with cluster([a], policy="cost") as (router, _), httpx.AsyncClient(base_url=router) as c:
        for _ in range(3):
            await c.post("/v1/chat/completions", json=chat("the same prompt"))
        await c.post("/v1/chat/completions", json=chat("another prompt"))
        assert a.tokenize_calls == 2  # one per distinct prompt
    b = StubState("b", has_tokenize=False)
    async with cluster([b], policy="cost") as (router, _), httpx.AsyncClient(base_url=router) as c:
        for i in range(3):
            r = await c.post("/v1/chat/completions", json=chat(f"prompt {i}"))
            assert r.status_code == 200
        assert b.tokenize_calls == 1  # a 404 is not asked again for a while


async def test_a_tokenize_that_hangs_leaves_the_request_routed_without_tokens(
        cluster: Cluster) -> None:
    """A worker whose /tokenize answers nothing (frozen, before the probes eject it) held
    each request that asked it for the read timeout (600 s); it waits the probes' timeout
    (`connect_timeout_s`), then the request is routed without its tokens."""
    a = StubState("a", tokenize_delay_s=2.5)  # (the stub's shutdown waits for it)
    async with cluster([a], policy="cost", connect_timeout_s=0.3) as (router, _), \
            httpx.AsyncClient(base_url=router, timeout=10) as c:
        start = time.monotonic()
        r = await c.post("/v1/chat/completions", json=chat("a prompt"))
        took = time.monotonic() - start
    assert r.status_code == 200 and a.tokenize_calls == 1
    assert took < 2.0, took  # the tokenize's timeout, not its answer


# --- `sluice router`'s own server: HTTP/1.1 details the ASGI front leaves to uvicorn ---------


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[bytes, bytes], bytes]:
    """One response off a raw connection: status, headers (lower-case names), body."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    lines = head.split(b"\r\n")
    headers = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(b": ")
            headers[name.lower()] = value
    if b"content-length" in headers:
        body = await reader.readexactly(int(headers[b"content-length"]))
    elif headers.get(b"transfer-encoding") == b"chunked":
        parts = []
        while size := int((await reader.readuntil(b"\r\n")).strip(), 16):
            parts.append((await reader.readexactly(size + 2))[:-2])
        await reader.readexactly(2)
        body = b"".join(parts)
    else:
        body = await asyncio.wait_for(reader.read(), 5)  # until the server closes
    return int(lines[0].split()[1]), headers, body


def raw_post(path: bytes, body: dict[str, Any], *extra: bytes, version: bytes = b"1.1") -> bytes:
    data = json.dumps(body).encode()
    return (b"POST %s HTTP/%s\r\nHost: r\r\nContent-Type: application/json\r\n%s"
            b"Content-Length: %d\r\n\r\n%s" % (path, version, b"".join(extra), len(data), data))


async def connect(url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = url.removeprefix("http://").split(":")
    return await asyncio.open_connection(host, int(port))


async def test_server_pipelining_expect_continue_and_chunked_request_bodies() -> None:
    a = StubState("a")
    async with _cluster(serve_router, [a]) as (router, _):
        reader, writer = await connect(router)
        writer.write(raw_post(b"/v1/chat/completions", chat("one"))
                     + raw_post(b"/v1/chat/completions", chat("two")))  # pipelined
        for _ in range(2):
            status, _, body = await read_response(reader)
            assert status == 200 and json.loads(body)["worker"] == "a"
        assert [r["messages"][0]["content"] for r in a.requests] == ["one", "two"]
        data = json.dumps(chat("three")).encode()
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nExpect: 100-continue\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(data))
        assert await reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(data)
        assert (await read_response(reader))[0] == 200
        half = len(data) // 2
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n%x\r\n%s\r\n0\r\n\r\n"
                     % (half, data[:half], len(data) - half, data[half:]))
        assert (await read_response(reader))[0] == 200
        assert a.requests[-1]["messages"][0]["content"] == "three"
        writer.close()


async def test_server_http10_connection_close_and_malformed_requests() -> None:
    async with _cluster(serve_router, [StubState("a", num_tokens=2)]) as (router, _):
        reader, writer = await connect(router)  # HTTP/1.0: no chunked framing, close at the end
        writer.write(raw_post(b"/v1/chat/completions", chat("x", stream=True), version=b"1.0"))
        status, headers, body = await read_response(reader)
        assert status == 200 and b"transfer-encoding" not in headers
        assert headers[b"connection"] == b"close" and body.endswith(b"data: [DONE]\n\n")
        assert await reader.read() == b""
        reader, writer = await connect(router)
        writer.write(raw_post(b"/v1/chat/completions", chat("x"), b"Connection: close\r\n"))
        status, headers, _ = await read_response(reader)
        assert status == 200 and headers[b"connection"] == b"close"
        assert await asyncio.wait_for(reader.read(), 5) == b""
        reader, writer = await connect(router)
        writer.write(b"NOT HTTP AT ALL\r\n\r\n")
        status, _, body = await read_response(reader)
        assert status == 400 and b"malformed" in body
        assert await asyncio.wait_for(reader.read(), 5) == b""
        reader, writer = await connect(router)
        writer.write(b"GET /health HTTP/1.1\r\nX-Big: " + b"x" * 70_000 + b"\r\n\r\n")
        assert (await read_response(reader))[0] == 431


async def test_server_passes_other_paths_to_the_app() -> None:
    async with _cluster(serve_router, [StubState("a")]) as (router, _):
        reader, writer = await connect(router)
        writer.write(b"HEAD /health HTTP/1.1\r\nHost: r\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 200") and b"content-length" in head.lower()
        writer.write(b"GET /v1/models?x=1 HTTP/1.1\r\nHost: r\r\n\r\n")  # no stray HEAD body
        status, headers, body = await read_response(reader)
        assert status == 200 and json.loads(body)["data"][0]["id"] == "stub-model"
        assert headers[b"content-type"] == b"application/json"
        writer.write(b"GET /v1/chat/completions HTTP/1.1\r\nHost: r\r\n\r\n")
        assert (await read_response(reader))[0] in (404, 405)  # only POSTs are routed
        writer.write(b"GET /metrics HTTP/1.1\r\nHost: r\r\n\r\n")
        status, _, body = await read_response(reader)
        assert status == 200 and b"sluice_router_worker_healthy" in body
        writer.close()


async def test_server_closes_idle_connections_and_stops_gracefully() -> None:
    slow = StubState("slow", num_tokens=200, token_delay_s=0.05)
    async with AsyncExitStack() as stack:
        worker_url = await stack.enter_async_context(serve(make_stub(slow)))
        config = RouterConfig(pools=(PoolConfig(model="stub-model",
                                                workers=(WorkerSpec(worker_url),)),))
        server = RouterServer(build_app(config), "127.0.0.1", 0, keep_alive_s=0.1,
                              shutdown_timeout_s=0.2)
        await server.start()
        reader, writer = await connect(server.url)
        assert await asyncio.wait_for(reader.read(), 5) == b""  # idle past keep_alive_s
        async with httpx.AsyncClient(base_url=server.url) as c, \
                c.stream("POST", "/v1/chat/completions", json=chat("x", stream=True)) as s:
            lines = s.aiter_lines()
            async for line in lines:
                if line.startswith("data:"):
                    break  # streaming; now stop the server
            await server.stop()  # waits 0.2 s for the stream, then cancels it
            with pytest.raises(httpx.HTTPError):
                async for _ in lines:
                    pass
        await asyncio.wait_for(slow.cancel_event.wait(), 5)  # the worker saw the hang-up
        with pytest.raises(OSError):
            await connect(server.url)  # no longer listening


@asynccontextmanager
async def failing_worker() -> AsyncIterator[str]:
    """A worker that answers probes, then sends one SSE chunk of a streamed answer and dies."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                await reader.readexactly(length)
                if head.startswith(b"POST"):
                    writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                                 b"8\r\ndata: 1\n\r\n")
                    await writer.drain()
                    break
                body = (b'{"data": [{"id": "stub-model"}]}' if b"/v1/models" in head else b"")
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s"
                             % (len(body), body))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    async with server:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def test_a_worker_failing_mid_stream_breaks_the_client_response(cluster: Cluster) -> None:
    async with failing_worker() as url, cluster([], extra_urls=(url,)) as (router, _), \
            httpx.AsyncClient(base_url=router) as c:
        with pytest.raises(httpx.RemoteProtocolError):  # not a clean, short stream
            await c.post("/v1/chat/completions", json=chat("x", stream=True))
        pools = (await c.get("/admin/workers", headers=ADMIN)).json()["pools"]
        assert pools[0]["workers"][0]["inflight"] == 0


def resumable_worker(cut: list[bool], adapters: tuple[str, ...] = (),
                     served: list[str] | None = None) -> Starlette:
    """A worker that streams four tokens with their ids (`x-sluice-tokenizer`: it can
    resume a stream), dies after two while `cut` holds a True (one pop per stream), and
    on `x-sluice-resume-ids` continues after the ids it is given. `adapters`: LoRA
    adapters it lists (vLLM's `parent`); `served`: the model of each request it took."""
    async def generate(request: Request) -> Response:
        resumed = ResumeIds.decode(request.headers.get(RESUME_HEADER, ""))
        dies = bool(cut) and cut.pop()
        if served is not None:
            served.append((await request.json())["model"])

        async def events() -> AsyncIterator[bytes]:
            for i in range(len(resumed.ids) if resumed else 0, 4):
                if dies and i == 2:
                    raise RuntimeError("the worker died mid-stream")
                chunk = {"id": "x", "created": 1, "model": "stub-model", "choices": [
                    {"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": None,
                     "token_ids": [i]}]}
                yield f"data: {json.dumps(chunk)}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={TOKENIZER_HEADER: "stub"})

    async def models(_: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "stub-model"}] + [
            {"id": name, "parent": "stub-model"} for name in adapters]})

    async def health(_: Request) -> Response:
        return PlainTextResponse("ok")

    return Starlette(routes=[Route("/v1/chat/completions", generate, methods=["POST"]),
                             Route("/v1/models", models), Route("/health", health)])


async def test_a_migrated_stream_counts_once_in_requests_total(cluster: Cluster) -> None:
    """A stream whose worker dies mid-way resumes on the other worker: the client sees
    one stream, and `sluice_router_requests_total` counts one request (it counted the
    original and the resume: 2 for 1, so dashboards' request rates and error ratios
    counted every migration twice)."""
    cut = [True]
    async with serve(resumable_worker(cut)) as a, serve(resumable_worker(cut)) as b, \
            cluster([], extra_urls=(a, b)) as (router, _), \
            httpx.AsyncClient(base_url=router) as c:
        r = await c.post("/v1/chat/completions", json=chat("x", stream=True))
        assert r.status_code == 200 and not cut
        events = [e[6:] for e in r.text.split("\n\n") if e.startswith("data: ")]
        assert events[-1] == "[DONE]"
        text = "".join(json.loads(e)["choices"][0]["delta"]["content"] for e in events[:-1])
        assert text == "t0 t1 t2 t3 "
        metrics = (await c.get("/metrics")).text
    assert 'sluice_router_migrations_total{reason="read_error"} 1.0' in metrics
    assert 'sluice_router_requests_total{model="stub-model",status="200"} 1.0' in metrics
    # one time to first byte: the resume's was a second sample of the same request
    assert 'sluice_router_first_byte_seconds_count{model="stub-model"} 1.0' in metrics


async def test_an_adapter_stream_never_resumes_where_its_adapter_is_not(
        cluster: Cluster) -> None:
    """A LoRA adapter's stream whose worker dies mid-way resumes only on a worker holding
    the adapter; with none left it ends with migration_failed. The resume went to any
    other worker, and one without the adapter continued the stream with its base model
    (the router sends a name another worker of the pool lists as the model this worker
    serves), so the client got the adapter's first tokens and the base model's rest."""
    cut, held, other = [True], list[str](), list[str]()
    async with serve(resumable_worker(cut, ("sql",), held)) as a, \
            serve(resumable_worker([], (), other)) as b, \
            cluster([], extra_urls=(a, b)) as (router, _), \
            httpx.AsyncClient(base_url=router) as c:
        lines: list[str] = []
        with pytest.raises(httpx.RemoteProtocolError):  # a broken stream, not a short one
            async with c.stream("POST", "/v1/chat/completions",
                                json={**chat("x", stream=True), "model": "sql"}) as r:
                async for line in r.aiter_lines():
                    lines.append(line)
        assert held == ["sql"] and other == []
        assert "migration_failed" in [x for x in lines if x][-1], lines


ADMIN_ROUTES = [("GET", "/admin/workers", None), ("POST", "/admin/workers", {"url": "http://x"}),
                ("DELETE", "/admin/workers", {"url": "http://x"}),
                ("POST", "/admin/workers/drain", {"url": "http://x"})]


async def test_every_admin_route_is_closed_without_a_key_and_needs_it(cluster: Cluster) -> None:
    """The hostile test: through the public port nobody may add or remove a worker."""
    async with cluster([StubState("a")], admin_key=None) as (router, urls), \
            httpx.AsyncClient(base_url=router) as c:
        for method, path, body in ADMIN_ROUTES:
            r = await c.request(method, path, json=body, headers=ADMIN)
            assert r.status_code == 403, (method, path, r.text)
            assert r.json()["error"]["type"] == "permission_error"
            # it names the setting for both ways a router runs
            assert "SLUICE_ROUTER_ADMIN_KEY" in r.text and "SLUICE_ADMIN_KEY " in r.text
    async with cluster([StubState("a")]) as (router, urls), \
            httpx.AsyncClient(base_url=router) as c:
        for method, path, body in ADMIN_ROUTES:
            for headers in ({}, {"authorization": "Bearer nope"}, {"x-admin-key": "nope"}):
                r = await c.request(method, path, json=body, headers=headers)
                assert r.status_code == 401, (method, path, headers, r.text)
                assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert [w["url"] for p in (await c.get("/admin/workers", headers=ADMIN)).json()["pools"]
                for w in p["workers"]] == [urls["a"]]


async def _chunks(data: bytes, size: int = 1000) -> AsyncIterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i:i + size]


async def test_bodies_over_the_limit_are_413(cluster: Cluster) -> None:
    a = StubState("a")
    body = json.dumps(chat("x" * 5000)).encode()
    async with cluster([a], max_body_bytes=4000) as (router, _), \
            httpx.AsyncClient(base_url=router) as c:
        for path in ("/v1/chat/completions", "/v1/messages", "/tokenize"):
            r = await c.post(path, content=body)  # Content-Length declared: before reading
            assert r.status_code == 413, (path, r.text)
            r = await c.post(path, content=_chunks(body))  # chunked: as the bytes arrive
            assert r.status_code == 413, (path, r.text)
        err = r.json()["error"]
        assert (err["type"], err["code"], err["param"]) == (
            "invalid_request_error", "request_too_large", "body")
        assert (await c.post("/v1/chat/completions", json=chat("x"))).status_code == 200
    assert len(a.requests) == 1


async def test_deep_nesting_and_lone_surrogates_are_400(cluster: Cluster) -> None:
    deep = b'{"model": "stub-model", "messages": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
    lone = b'{"model": "stub-model", "messages": [{"role": "user", "content": "a \\udc00"}]}'
    async with cluster([StubState("a")]) as (router, _), httpx.AsyncClient(base_url=router) as c:
        for body in (deep, lone, lone.replace(b"\\udc00", b"\xed\xb0\x80")):
            r = await c.post("/v1/chat/completions", content=body)
            assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


async def test_a_client_s_kv_transfer_params_are_refused(cluster: Cluster) -> None:
    """`kv_transfer_params` names a host and port the worker dials to pull KV: passed on,
    any client could make a worker connect anywhere it can reach (found by the docs pass:
    the worker's kv_transfer_failures_total{reason="connect"} counted a dial to port 1).
    The router refuses it, as the gateway does; its own P/D requests are not parsed."""
    a = StubState("a")
    params = {"do_remote_prefill": True, "remote_engine_id": "x", "remote_block_ids": [0],
              "remote_host": "127.0.0.1", "remote_port": 1, "remote_request_id": "r"}
    async with cluster([a]) as (router, _), httpx.AsyncClient(base_url=router) as c:
        for path, body in (("/v1/chat/completions", chat("x")),
                           ("/v1/completions", {"model": "stub-model", "prompt": "x"})):
            r = await c.post(path, json={**body, "kv_transfer_params": params})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == "kv_transfer_params"
        assert (await c.post("/v1/chat/completions",
                             json={**chat("x"), "kv_transfer_params": None})).status_code == 200
    assert len(a.requests) == 1
