"""Workers found by DNS (`router/discovery.py`): stub workers on two loopback addresses
and one port, as pods behind a headless Service; the name's answer is the test's (the
resolver is the edge), the workers, the router and the requests are real."""

from __future__ import annotations

import asyncio
import ipaddress
import random
import socket
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import httpx
import pytest
import uvicorn
from tests.router.router_stubs import StubState, make_stub, serve_router

from sluice.control.local import free_port
from sluice.protocol.errors import InvalidRequestError
from sluice.router.app import build_app
from sluice.router.config import DnsTarget, PoolConfig, RouterConfig
from sluice.router.discovery import DnsDiscovery, resolve_addresses

ADDRESSES = ("127.0.0.2", "127.0.0.3")


@asynccontextmanager
async def stub_at(state: StubState, host: str, port: int) -> AsyncIterator[None]:
    server = uvicorn.Server(uvicorn.Config(make_stub(state), host=host, port=port,
                                           log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve())
    for _ in range(500):
        if server.started or task.done():
            break
        await asyncio.sleep(0.01)
    assert server.started, f"stub on {host}:{port} did not start"
    try:
        yield
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)


class Names:
    """The resolver's answers: what the test says the name holds now."""

    def __init__(self, *addresses: str) -> None:
        self.addresses = list(addresses)
        self.error: OSError | None = None
        self.asked: list[tuple[str, int]] = []

    async def __call__(self, host: str, port: int) -> list[str]:
        self.asked.append((host, port))
        if self.error is not None:
            raise self.error
        return list(self.addresses)


@asynccontextmanager
async def setup(states: list[StubState], names: Names, **kw: float):  # type: ignore[no-untyped-def]
    port = free_port()
    config = RouterConfig(pools=(PoolConfig(model="stub-model", policy="round_robin"),),
                          health_interval_s=0.1, scrape_interval_s=0.1, seed=0)
    app = build_app(config, rng=random.Random(0))
    async with AsyncExitStack() as stack:
        for state, address in zip(states, ADDRESSES, strict=True):
            await stack.enter_async_context(stub_at(state, address, port))
        router = await stack.enter_async_context(serve_router(app))
        state = app.state.router
        discovery = DnsDiscovery(state, state.pools[0],
                                 DnsTarget.parse(f"http://workers.sluice.svc:{port}"),
                                 resolve=names, **kw)
        client = await stack.enter_async_context(httpx.AsyncClient(base_url=router, timeout=10))
        yield discovery, client, port


def chat(content: str, stream: bool = False) -> dict[str, object]:
    return {"model": "stub-model", "messages": [{"role": "user", "content": content}],
            "stream": stream}


async def test_each_address_is_a_worker_and_a_vanished_one_drains_then_leaves() -> None:
    a, b = StubState("a"), StubState("b", num_tokens=2)
    names = Names(*ADDRESSES)
    async with setup([a, b], names) as (discovery, client, port):
        await discovery.sync()
        assert names.asked == [("workers.sluice.svc", port)]
        urls = {f"http://{x}:{port}" for x in ADDRESSES}
        assert set(discovery.pool.endpoints) == urls == discovery.found
        served = {(await client.post("/v1/chat/completions", json=chat(str(i)))).json()["worker"]
                  for i in range(4)}
        assert served == {"a", "b"}

        # b's pod leaves the Service while a stream runs on it: no new request reaches
        # it, the stream finishes, then it leaves the pool
        b.gate = asyncio.Event()
        b_url = f"http://{ADDRESSES[1]}:{port}"
        while True:  # round robin: the next request lands on b
            held = asyncio.create_task(client.post("/v1/chat/completions",
                                                   json=chat("held", stream=True)))
            for _ in range(200):
                if b.requests and b.requests[-1]["messages"][0]["content"] == "held" or held.done():
                    break
                await asyncio.sleep(0.01)
            if not held.done():
                break
            assert held.result().status_code == 200
        names.addresses = [ADDRESSES[0]]
        await discovery.sync()
        assert discovery.pool.endpoints[b_url].draining
        before = len(b.requests)
        for i in range(3):
            r = await client.post("/v1/chat/completions", json=chat(f"after {i}"))
            assert r.json()["worker"] == "a"
        assert len(b.requests) == before
        b.gate.set()
        reply = await held
        assert reply.status_code == 200 and "b-1" in reply.text
        await discovery.sync()
        assert set(discovery.pool.endpoints) == {f"http://{ADDRESSES[0]}:{port}"}
        # nothing of b is kept: its target and its idle keep-alive connections
        proxy = discovery.state.proxy
        assert b_url not in proxy._targets
        assert not [k for k in proxy.upstream.idle if k[1] == ADDRESSES[1]]
        assert [k for k in proxy.upstream.idle if k[1] == ADDRESSES[0]]  # a's are kept

        # the name has no address (no ready pod): the pool is empty, not an error
        names.addresses = []
        await discovery.sync()
        assert discovery.pool.endpoints == {} and discovery.found == set()
        names.addresses = list(ADDRESSES)
        await discovery.sync()
        assert set(discovery.pool.endpoints) == urls


async def test_an_address_back_within_the_grace_is_routed_again_and_a_failing_resolver_keeps_the_set() -> None:
    a, b = StubState("a"), StubState("b")
    names = Names(*ADDRESSES)
    now = [0.0]
    async with setup([a, b], names, grace_s=30.0) as (discovery, client, port):
        discovery.clock = lambda: now[0]
        await discovery.sync()
        b_url = f"http://{ADDRESSES[1]}:{port}"
        endpoint = discovery.pool.endpoints[b_url]
        endpoint.inflight += 1  # a request still on it
        names.addresses = [ADDRESSES[0]]
        await discovery.sync()
        assert endpoint.draining and b_url in discovery.pool.endpoints
        names.addresses = list(ADDRESSES)
        await discovery.sync()
        assert not endpoint.draining and discovery.pool.endpoints[b_url] is endpoint

        names.error = OSError("temporary failure in name resolution")
        with pytest.raises(OSError):
            await discovery.sync()
        assert set(discovery.pool.endpoints) == discovery.found and len(discovery.found) == 2
        discovery.interval_s = 0.01
        task = asyncio.create_task(discovery.run())  # run() logs the failure and goes on
        await asyncio.sleep(0.1)
        assert not task.done() and len(names.asked) > 5 and len(discovery.found) == 2
        task.cancel()

        # gone for longer than the grace: removed even with a request in flight
        names.error = None
        names.addresses = [ADDRESSES[0]]
        await discovery.sync()
        now[0] += 31.0
        await discovery.sync()
        assert b_url not in discovery.pool.endpoints


async def test_workers_removed_elsewhere_and_real_names() -> None:
    a, b = StubState("a"), StubState("b")
    names = Names(*ADDRESSES)
    async with setup([a, b], names) as (discovery, client, port):
        await discovery.sync()
        b_url = f"http://{ADDRESSES[1]}:{port}"
        await discovery.state.remove_worker(b_url)  # e.g. DELETE /admin/workers
        names.addresses = [ADDRESSES[0]]
        await discovery.sync()  # forgets it instead of failing on it
        assert discovery.found == {f"http://{ADDRESSES[0]}:{port}"}
    assert await resolve_addresses("localhost", 80) == ["127.0.0.1"] or "::1" in \
        await resolve_addresses("localhost", 80)
    assert await resolve_addresses("no-such-host.invalid", 80) == []


def test_target_urls() -> None:
    t = DnsTarget.parse("http://sluice-workers-pods.ns.svc.cluster.local:8000")
    assert (t.host, t.port, t.url("10.1.2.3")) == ("sluice-workers-pods.ns.svc.cluster.local",
                                                    8000, "http://10.1.2.3:8000")
    assert DnsTarget.parse("https://w").url("fd00::1") == "https://[fd00::1]:443"
    assert t.url("fe80::1%eth0") == "http://[fe80::1%eth0]:8000"  # the zone the clients read
    for bad in ("w:8000", "http://w:8000/v1", "http://w:99999", "ftp://w"):
        with pytest.raises(InvalidRequestError) as err:
            DnsTarget.parse(bad)
        assert err.value.param == "discover"


async def test_a_link_local_address_keeps_its_zone() -> None:
    """getaddrinfo gives an IPv6 scope as a number beside the address (Python 3.7+ drops
    `%zone` from the string): the address alone names no interface and cannot be
    reached, so the zone is put back, by name."""
    index, name = socket.if_nameindex()[0]
    assert await resolve_addresses(f"fe80::1%{index}", 80) == [f"fe80::1%{name}"]
    assert await resolve_addresses("::1", 80) == ["::1"]  # no scope: no zone


def link_local() -> tuple[str, str] | None:
    """(address, interface) of one of this machine's IPv6 link-local addresses."""
    try:
        lines = Path("/proc/net/if_inet6").read_text().splitlines()
    except OSError:
        return None
    for hexed, _, _, scope, _, name in (line.split() for line in lines):
        if scope == "20":  # link
            return str(ipaddress.IPv6Address(bytes.fromhex(hexed))), name
    return None


async def test_a_link_local_worker_is_reached_through_its_zone() -> None:
    """A link-local address is reachable only through its interface: the resolver's
    scope id, which getaddrinfo gives beside the address (Python 3.7+ drops `%zone`
    from the string), was dropped, the worker joined as `http://[fe80::...]:PORT`,
    its probe failed, and the pool never had a ready worker."""
    found = link_local()
    if found is None:
        pytest.skip("no IPv6 link-local address here")
    address, interface = found
    a, port = StubState("a"), free_port()
    config = RouterConfig(pools=(PoolConfig(model="stub-model"),), health_interval_s=0.1,
                          seed=0)
    app = build_app(config, rng=random.Random(0))
    numeric = f"{address}%{socket.if_nametoindex(interface)}"  # as a resolver answers
    async with stub_at(a, f"{address}%{interface}", port), serve_router(app) as router, \
            httpx.AsyncClient(base_url=router, timeout=10) as client:
        state = app.state.router
        discovery = DnsDiscovery(state, state.pools[0], DnsTarget("http", numeric, port))
        await discovery.sync()
        assert discovery.found == {f"http://[{address}%{interface}]:{port}"}
        r = await client.post("/v1/chat/completions", json=chat("hi"))
        assert r.status_code == 200 and r.json()["worker"] == "a", r.text


async def test_a_pool_discovers_its_workers_from_the_config_with_the_system_resolver() -> None:
    """`discover` in a pool's config: the router resolves the name itself (here
    `localhost`, the machine's resolver) before it listens, then every interval."""
    a = StubState("a")
    port = free_port()
    config = RouterConfig(pools=(PoolConfig(model="stub-model",
                                            discover=(f"http://localhost:{port}",)),
                                 PoolConfig(model="other-model")),  # (not joined)
                          discovery_interval_s=0.05, health_interval_s=0.1, seed=0)
    async with stub_at(a, "127.0.0.1", port), serve_router(build_app(config)) as router, \
            httpx.AsyncClient(base_url=router, timeout=10) as client:
        r = await client.post("/v1/chat/completions", json=chat("hi"))
        assert r.status_code == 200 and r.json()["worker"] == "a"
        models = (await client.get("/v1/models")).json()["data"]
        assert "stub-model" in {m["id"] for m in models}
        with pytest.raises(InvalidRequestError):
            PoolConfig(model="m", discover=("localhost:8000",))
