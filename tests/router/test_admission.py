"""The admission queue over real HTTP: a stub worker whose requests are held behind a
gate, so "no room" is exact (`max_inflight_per_worker` requests held there), and the
order the stub receives the queued requests in is the order the queue granted them."""

from __future__ import annotations

import argparse
import asyncio
import inspect
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from router_stubs import StubState, make_stub, serve, serve_router

from sluice.cli import build_parser
from sluice.protocol.errors import InvalidRequestError
from sluice.router import admission
from sluice.router.app import build_app
from sluice.router.cli import config_from_args
from sluice.router.config import (
    AdmissionConfig,
    BandLimits,
    PoolConfig,
    RouterConfig,
    WorkerSpec,
    router_from_dict,
)

ADMIN = {"authorization": "Bearer k"}
URL = "/admin/pools/stub-model/admission"
Front = Callable[[Any], AbstractAsyncContextManager[str]]
FRONTS: dict[str, Front] = {"server": serve_router, "uvicorn": serve}


@asynccontextmanager
async def router(stub: StubState, config: AdmissionConfig, front: Front = serve_router,
                 **router_kw: Any) -> AsyncIterator[httpx.AsyncClient]:
    """One stub worker behind a router with `config`; yields a client of the router."""
    async with AsyncExitStack() as stack:
        url = await stack.enter_async_context(serve(make_stub(stub)))
        pool = PoolConfig(model="stub-model", workers=(WorkerSpec(url),), policy="round_robin")
        app = build_app(RouterConfig(pools=(pool,), admission=config, admin_key="k",
                                     health_interval_s=0.1, scrape_interval_s=0.1, **router_kw),
                        rng=random.Random(0))
        base = await stack.enter_async_context(front(app))
        yield await stack.enter_async_context(httpx.AsyncClient(base_url=base, timeout=30))


def chat(content: str) -> dict[str, Any]:
    return {"model": "stub-model", "messages": [{"role": "user", "content": content}]}


def post(c: httpx.AsyncClient, content: str, priority: int | None = None,
         tenant: str | None = None) -> asyncio.Task[httpx.Response]:
    headers = {}
    if priority is not None:
        headers["x-sluice-priority"] = str(priority)
    if tenant is not None:
        headers["x-sluice-tenant"] = tenant
    return asyncio.create_task(c.post("/v1/chat/completions", json=chat(content),
                                      headers=headers))


async def until(check: Callable[[], Awaitable[bool] | bool], limit_s: float = 10) -> None:
    """Poll `check` (plain or async) every 10 ms until it holds; fail after `limit_s`."""
    for _ in range(int(limit_s / 0.01)):
        result = check()
        if await result if inspect.isawaitable(result) else result:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


async def queued(c: httpx.AsyncClient) -> int:
    return sum((await c.get(URL, headers=ADMIN)).json()["queued"].values())


def served(stub: StubState) -> list[str]:
    return [r["messages"][0]["content"] for r in stub.requests]


async def test_queued_requests_go_in_band_order_and_fifo_within_a_band() -> None:
    stub = StubState("a", gate=asyncio.Event())
    async with router(stub, AdmissionConfig(max_inflight_per_worker=1)) as c:
        blocker = post(c, "blocker", priority=9)
        await until(lambda: len(stub.requests) == 1)
        order = [("p2-a", 2), ("p1-a", 1), ("p0-a", 0), ("p2-b", 2), ("p0-b", 0), ("p1-b", 1)]
        tasks = []
        for i, (name, priority) in enumerate(order):
            tasks.append(post(c, name, priority=priority))
            await until(lambda i=i: _queued_is(c, i + 1))  # type: ignore[misc]
        stub.gate.set()  # type: ignore[union-attr]
        replies = await asyncio.gather(blocker, *tasks)
        assert all(r.status_code == 200 for r in replies)
        assert served(stub) == ["blocker", "p0-a", "p0-b", "p1-a", "p1-b", "p2-a", "p2-b"]
        metrics = (await c.get("/metrics")).text
        assert 'sluice_router_admission_wait_seconds_count{model="stub-model",priority="2"} 2.0' \
            in metrics
        assert 'sluice_router_admission_queued{model="stub-model",priority="2"} 0.0' in metrics


async def _queued_is(c: httpx.AsyncClient, n: int) -> bool:
    return await queued(c) == n


@pytest.mark.parametrize(("weights", "expected_a"), [({}, 10), ({"a": 2.0}, 13)])
async def test_tenants_in_one_band_share_by_weight(weights: dict[str, float],
                                                   expected_a: int) -> None:
    """Tenant a queues 20 requests before tenant b queues 20; of the first 20 granted,
    equal weights give exactly 10 each (strict alternation), weights 2:1 give a 13 or 14
    (2/3 of 20, ±1 for where the window cuts the 2:1 pattern)."""
    stub = StubState("a", gate=asyncio.Event())
    config = AdmissionConfig(max_inflight_per_worker=1, tenant_weights=weights)
    async with router(stub, config) as c:
        blocker = post(c, "blocker")
        await until(lambda: len(stub.requests) == 1)
        tasks = [post(c, f"a{i}", tenant="a") for i in range(20)]
        await until(lambda: _queued_is(c, 20))
        tasks += [post(c, f"b{i}", tenant="b") for i in range(20)]
        await until(lambda: _queued_is(c, 40))
        stub.gate.set()  # type: ignore[union-attr]
        await asyncio.gather(blocker, *tasks)
        first = served(stub)[1:21]
        share_a = sum(name.startswith("a") for name in first)
        assert expected_a <= share_a <= expected_a + 1, first
        assert [n for n in served(stub) if n.startswith("a")] == [f"a{i}" for i in range(20)]


async def test_full_band_is_429_and_a_timed_out_wait_is_503_with_retry_after() -> None:
    stub = StubState("a", gate=asyncio.Event())
    config = AdmissionConfig(max_inflight_per_worker=1,
                             bands={1: BandLimits(capacity=2, timeout_s=0.5)})
    async with router(stub, config) as c:
        blocker = post(c, "blocker")
        await until(lambda: len(stub.requests) == 1)
        waiting = [post(c, f"w{i}", priority=1) for i in range(2)]
        await until(lambda: _queued_is(c, 2))
        full = await c.post("/v1/chat/completions", json=chat("x"),
                            headers={"x-sluice-priority": "1"})
        assert full.status_code == 429 and full.headers["retry-after"] == "1"
        assert full.json()["error"]["code"] == "queue_full"
        assert full.json()["error"]["type"] == "rate_limit_error"
        other_band = post(c, "p0", priority=0)  # another band: default limits, queued
        for r in await asyncio.gather(*waiting):
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "queue_timeout"
        stub.gate.set()  # type: ignore[union-attr]
        assert (await blocker).status_code == 200 and (await other_band).status_code == 200
        assert served(stub) == ["blocker", "p0"]
        metrics = (await c.get("/metrics")).text
        shed = 'sluice_router_admission_shed_total{model="stub-model",priority="1",reason='
        assert shed + '"queue_full"} 1.0' in metrics
        assert shed + '"queue_timeout"} 2.0' in metrics
        bad = await c.post("/v1/chat/completions", json=chat("x"),
                           headers={"x-sluice-priority": "high"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-sluice-priority"


async def test_thresholds_change_at_runtime_through_the_admin_api() -> None:
    stub = StubState("a", gate=asyncio.Event())
    async with router(stub, AdmissionConfig(max_inflight_per_worker=1)) as c:
        assert (await c.get(URL)).status_code == 401
        blocker = post(c, "blocker")
        await until(lambda: len(stub.requests) == 1)
        tasks = [post(c, f"w{i}") for i in range(2)]
        await until(lambda: _queued_is(c, 2))
        r = await c.put(URL, json={"max_inflight_per_worker": 3,
                                   "bands": {"5": {"capacity": 0, "timeout_s": 1}}},
                        headers=ADMIN)
        assert r.status_code == 200, r.text
        assert r.json()["max_inflight_per_worker"] == 3
        assert r.json()["bands"] == {"5": {"capacity": 0, "timeout_s": 1.0}}
        await until(lambda: len(stub.requests) == 3)  # both granted by the raised limit
        refused = await c.post("/v1/chat/completions", json=chat("x"),
                               headers={"x-sluice-priority": "5"})
        assert refused.status_code == 429  # capacity 0: band 5 may not wait at all
        r = await c.put(URL, json={"max_inflight_per_worker": -1}, headers=ADMIN)
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_inflight_per_worker"
        r = await c.put(URL, json={"max_inflight": 2}, headers=ADMIN)
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_inflight"
        r = await c.get("/admin/pools/nope/admission", headers=ADMIN)
        assert r.status_code == 404
        stub.gate.set()  # type: ignore[union-attr]
        assert all(r.status_code == 200 for r in await asyncio.gather(blocker, *tasks))


async def test_a_nan_or_infinite_setting_is_a_400_naming_it() -> None:
    """An infinite band timeout was accepted through the admin API (and `--queue-timeout
    inf`), and the next 429 of that band was a 500: its Retry-After (the timeout, rounded
    up) overflowed. NaN passed every check too. Both are now refused, naming the field;
    the settings stay as they were."""
    stub = StubState("a", gate=asyncio.Event())
    async with router(stub, AdmissionConfig(max_inflight_per_worker=1)) as c:
        for body, param in (
                (b'{"default_band": {"capacity": 0, "timeout_s": 1e999}}', "timeout_s"),
                (b'{"bands": {"1": {"capacity": 0, "timeout_s": NaN}}}', "timeout_s"),
                (b'{"max_predicted_wait_s": NaN}', "max_predicted_wait_s"),
                (b'{"tenant_weights": {"acme": Infinity}}', "tenant_weights")):
            r = await c.put(URL, content=body, headers=ADMIN)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        settings = (await c.get(URL, headers=ADMIN)).json()
        assert settings["default_band"] == {"capacity": 1000, "timeout_s": 60.0}
        assert settings["max_predicted_wait_s"] == 0.0 and settings["tenant_weights"] == {}
        blocker = post(c, "blocker")
        await until(lambda: len(stub.requests) == 1)
        r = await c.put(URL, json={"default_band": {"capacity": 0, "timeout_s": 1e300}},
                        headers=ADMIN)
        assert r.status_code == 200, r.text  # large but finite: a full band is still a 429
        full = await c.post("/v1/chat/completions", json=chat("x"))
        assert full.status_code == 429 and full.json()["error"]["code"] == "queue_full"
        stub.gate.set()  # type: ignore[union-attr]
        assert (await blocker).status_code == 200
    for flags, param in ((["--queue-timeout", "inf"], "timeout_s"),
                         (["--max-predicted-wait", "nan"], "max_predicted_wait_s"),
                         (["--scrape-interval", "nan"], "scrape_interval_s"),
                         (["--breaker-open", "inf"], "open_s"),
                         (["--pd-mode", "always", "--pd-max-prefill-wait-ratio", "nan"],
                          "max_prefill_wait_ratio")):
        argv = ["router", "--worker", "http://a:1", *flags]
        with pytest.raises(InvalidRequestError) as err:
            config_from_args(build_parser(argv).parse_args(argv))
        assert err.value.param == param, flags


@pytest.mark.parametrize("front", sorted(FRONTS))
async def test_a_client_that_hangs_up_while_queued_leaves_the_queue(front: str) -> None:
    stub = StubState("a", gate=asyncio.Event())
    async with router(stub, AdmissionConfig(max_inflight_per_worker=1), FRONTS[front]) as c:
        blocker = post(c, "blocker")
        await until(lambda: len(stub.requests) == 1)
        gone = post(c, "gone")
        await until(lambda: _queued_is(c, 1))
        gone.cancel()  # closes the connection
        await until(lambda: _queued_is(c, 0))
        stays = post(c, "stays")
        await until(lambda: _queued_is(c, 1))
        stub.gate.set()  # type: ignore[union-attr]
        assert (await blocker).status_code == 200 and (await stays).status_code == 200
        assert served(stub) == ["blocker", "stays"]


async def test_a_finished_request_wakes_the_next_waiter_without_polling(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(admission, "POLL_S", 3600.0)
    stub = StubState("a", ttft_s=0.05)
    async with router(stub, AdmissionConfig(max_inflight_per_worker=1)) as c:
        loop = asyncio.get_running_loop()
        start = loop.time()
        replies = await asyncio.gather(*(post(c, f"r{i}") for i in range(5)))
        assert all(r.status_code == 200 for r in replies)
        assert loop.time() - start < 30  # a lost wake-up would wait an hour (test timeout)
        metrics = (await c.get("/metrics")).text
        assert 'sluice_router_admission_wait_seconds_count{model="stub-model",priority="0"} 5.0' \
            in metrics


async def test_the_queue_never_holds_while_the_worker_has_room_or_when_none_is_left() -> None:
    stub = StubState("a", gate=asyncio.Event())
    async with router(stub, AdmissionConfig(max_inflight_per_worker=2)) as c:
        tasks = [post(c, "one"), post(c, "two")]
        await until(lambda: len(stub.requests) == 2)  # both sent at once
        stub.healthy = False  # ejected by probes: no worker at all -> 503 at once, no wait
        await until(lambda: _no_healthy(c))
        r = await c.post("/v1/chat/completions", json=chat("x"))
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_healthy_worker"
        stub.gate.set()  # type: ignore[union-attr]
        await asyncio.gather(*tasks)


async def _no_healthy(c: httpx.AsyncClient) -> bool:
    return (await c.get("/health")).status_code == 503


def test_config_file_and_flags_set_admission_and_breakers(tmp_path: Path) -> None:
    path = tmp_path / "router.yaml"
    path.write_text("""
admission:
  max_inflight_per_worker: 8
  bands: {0: {capacity: 5, timeout_s: 2}}
  tenant_weights: {a: 2}
breaker: {failures: 3, open_s: 10}
pools:
  - model: m
    workers: [http://w:1]
    admission: {max_inflight_per_worker: 2}
""")
    cfg = config_from_args(parse("--config", str(path), "--queue-timeout", "5",
                                 "--tenant-weight", "b=3", "--retry-budget", "0.1",
                                 "--stalled-stream-timeout", "4"))
    assert cfg.stalled_stream_timeout_s == 4 and cfg.migration_limit == 3
    assert cfg.admission.max_inflight_per_worker == 8
    assert cfg.admission.bands == {0: BandLimits(capacity=5, timeout_s=2)}
    assert cfg.admission.default_band == BandLimits(capacity=1000, timeout_s=5)
    assert cfg.admission.tenant_weights == {"a": 2, "b": 3.0}
    assert (cfg.breaker.failures, cfg.breaker.open_s, cfg.breaker.budget_ratio) == (3, 10, 0.1)
    assert cfg.pools[0].admission == AdmissionConfig(max_inflight_per_worker=2)
    assert router_from_dict({"admission": {"bands": {"1": {"capacity": 1, "timeout_s": 1}}}}
                            ).admission.bands[1].capacity == 1  # JSON: string keys
    with pytest.raises(InvalidRequestError) as err:
        config_from_args(parse("--tenant-weight", "nobody"))
    assert err.value.param == "tenant-weight"
    with pytest.raises(InvalidRequestError) as err:
        router_from_dict({"admission": {"tenant_weights": {"a": 0}}})
    assert err.value.param == "tenant_weights"
    with pytest.raises(InvalidRequestError) as err:
        config_from_args(parse("--stalled-stream-timeout", "0"))
    assert err.value.param == "stalled_stream_timeout_s"


def parse(*argv: str) -> argparse.Namespace:
    return build_parser(["router", *argv]).parse_args(["router", *argv])


def waiters(band: admission.Band, names: list[str]) -> dict[str, admission.Waiter]:
    loop = asyncio.new_event_loop()
    out = {}
    for seq, name in enumerate(names):
        out[name] = admission.Waiter(loop.create_future(), name[0], seq, 0.0)
        band.push(out[name])
    loop.close()
    return out


def test_requests_that_leave_cost_their_tenant_no_share() -> None:
    """Tags are given at the head: a's two timed-out requests do not push a4 behind b."""
    band = admission.Band()
    w = waiters(band, ["a1", "a2", "a3", "a4", "b1", "b2", "b3", "b4"])
    band.remove(w["a2"])
    band.remove(w["a3"])
    order = [band.pop(lambda t: 1.0) for _ in range(6)]
    assert [x.tenant + str(x.seq) for x in order] == ["a0", "b4", "a3", "b5", "b6", "b7"]
    assert band.size == 0 and band.finish == {"b": band.vtime + 1.0}


def test_a_full_band_takes_the_newest_waiter_of_the_longest_tenant() -> None:
    band = admission.Band()
    w = waiters(band, ["a1", "a2", "a3", "b1"])
    assert band.push_out("b") is w["a3"] and not w["a3"].queued
    assert band.push_out("b") is None  # a 2, b 1: not longer by more than one
    assert band.push_out("c") is w["a2"]
    assert band.size == 2


async def test_a_full_band_refuses_the_tenant_that_fills_it_not_the_newcomer() -> None:
    stub = StubState("a", gate=asyncio.Event())
    config = AdmissionConfig(max_inflight_per_worker=1, default_band=BandLimits(capacity=3))
    async with router(stub, config) as c:
        blocker = post(c, "blocker")
        await until(lambda: len(stub.requests) == 1)
        tasks = [post(c, f"a{i}", tenant="a") for i in range(3)]
        await until(lambda: _queued_is(c, 3))
        newcomer = post(c, "b0", tenant="b")
        await until(lambda: tasks[2].done())
        r = tasks[2].result()
        assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
        stub.gate.set()  # type: ignore[union-attr]
        assert all(r.status_code == 200 for r in await asyncio.gather(blocker, newcomer,
                                                                       *tasks[:2]))
        assert served(stub) == ["blocker", "a0", "b0", "a1"]
