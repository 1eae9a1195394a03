"""Adapter placement (router/adapters.py) against LoRA stub workers over real HTTP."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import httpx
import pytest
from tests.router.lora_stub import LoraStub, chat
from tests.router.router_stubs import serve, serve_router

from sluice.router.app import build_app
from sluice.router.config import (
    AdapterPlacement,
    AdapterSpec,
    PoolConfig,
    RouterConfig,
    WorkerSpec,
    router_from_dict,
)
from sluice.router.state import RouterState

ADMIN = "admin-secret"


@asynccontextmanager
async def fleet(stubs: list[LoraStub], adapters: tuple[AdapterSpec, ...] = (),
                **placement: Any) -> AsyncIterator[tuple[str, RouterState, list[str]]]:
    async with AsyncExitStack() as stack:
        urls = [await stack.enter_async_context(serve(s.app())) for s in stubs]
        config = RouterConfig(
            pools=(PoolConfig(model="base", workers=tuple(WorkerSpec(u) for u in urls)),),
            adapters=adapters, health_interval_s=0.05, scrape_interval_s=0.05, seed=0,
            admin_key=ADMIN,
            adapter_placement=AdapterPlacement(**{"sync_interval_s": 0.05, **placement}))
        app = build_app(config, rng=random.Random(0))
        router = await stack.enter_async_context(serve_router(app))
        yield router, app.state.router, urls


async def until(predicate: Any, timeout: float = 5.0) -> None:
    """Poll a condition the router's background sync makes true (bounded)."""
    for _ in range(int(timeout / 0.02)):
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached")


async def test_a_discovered_adapter_goes_only_to_its_holder() -> None:
    stubs = [LoraStub("a"), LoraStub("b"), LoraStub("c")]
    stubs[1].adapters["sql"] = "/adapters/sql"  # --lora-modules on b only
    async with fleet(stubs) as (router, state, urls), httpx.AsyncClient(base_url=router) as c:
        await until(lambda: state.adapters.holders("sql") == [urls[1]])
        for _ in range(6):
            r = await c.post("/v1/chat/completions", json=chat("sql"))
            assert r.status_code == 200 and r.json()["model"] == "sql"
        direct = (await c.post(urls[1] + "/v1/chat/completions", json=chat("sql"))).json()
        assert r.json()["choices"] == direct["choices"]
        assert stubs[1].served.count("sql") == 7 and "sql" not in stubs[0].served + stubs[2].served
        assert state.adapters.counts.total_loads() == 0  # no path: never loaded elsewhere


async def test_a_registered_adapter_is_loaded_on_demand_once() -> None:
    stubs = [LoraStub("a"), LoraStub("b")]
    spec = AdapterSpec("chat", "/adapters/chat")
    async with fleet(stubs, (spec,)) as (router, state, _), \
            httpx.AsyncClient(base_url=router) as c:
        models = (await c.get("/v1/models")).json()["data"]
        assert {"id": "chat", "parent": None, "root": "/adapters/chat"}.items() <= \
            next(m for m in models if m["id"] == "chat").items()
        replies = await asyncio.gather(*(c.post("/v1/chat/completions", json=chat("chat"))
                                         for _ in range(5)))
        assert [r.status_code for r in replies] == [200] * 5, replies[0].text
        assert {r.json()["model"] for r in replies} == {"chat"}
        assert state.adapters.counts.loads == {"demand": 1}
        assert sum(s.load_calls for s in stubs) == 1


async def test_hot_adapter_replicated_up_to_the_cap_cold_one_not_everywhere() -> None:
    stubs = [LoraStub(n, service_s=0.05, max_num_seqs=2) for n in "abc"]
    specs = (AdapterSpec("hot", "/a/hot"), AdapterSpec("cold", "/a/cold"))
    async with fleet(stubs, specs, max_adapter_replicas=2, load_s=0.001) as \
            (router, state, _), httpx.AsyncClient(base_url=router, timeout=30) as c:
        await c.post("/v1/chat/completions", json=chat("cold", words=64))

        async def hot(i: int) -> httpx.Response:
            await asyncio.sleep(0.01 * i)  # arrivals spread over 0.24 s (pacing, not a sync)
            return await c.post("/v1/chat/completions", json=chat("hot", words=64, salt=i))

        replies = await asyncio.gather(*(hot(i) for i in range(24)))
        assert all(r.status_code == 200 for r in replies)
        assert len(state.adapters.holders("hot")) == 2  # replicated, to the cap
        assert len(state.adapters.holders("cold")) == 1
        assert state.adapters.counts.loads == {"demand": 2, "replicate": 1}


async def test_zipf_mix_does_not_thrash() -> None:
    """8 adapters, Zipf(1.1), 3 workers of 2 slots, 240 requests 6 at a time."""
    stubs = [LoraStub(n, service_s=0.01, max_num_seqs=4) for n in "abc"]
    names = [f"lora{i}" for i in range(8)]
    specs = tuple(AdapterSpec(n, f"/a/{n}") for n in names)
    rng = random.Random(7)
    weights = [1 / (i + 1) ** 1.1 for i in range(8)]
    mix = rng.choices(names, weights, k=240)
    async with fleet(stubs, specs, max_adapter_replicas=2, load_s=0.001, min_residency_s=30) \
            as (router, state, _), httpx.AsyncClient(base_url=router, timeout=30) as c:
        sem = asyncio.Semaphore(6)

        async def one(name: str) -> int:
            async with sem:
                return (await c.post("/v1/chat/completions", json=chat(name))).status_code

        assert set(await asyncio.gather(*(one(n) for n in mix))) == {200}
        counts = state.adapters.counts
        # the two hot adapters: loaded once per replica, never evicted and loaded again
        assert counts.loads_by_adapter["lora0"] <= 2 and counts.loads_by_adapter["lora1"] <= 2
        # 8 adapters for 6 slots: the tail rotates through the free slot, but a load is
        # rare (an engine's LRU behind round robin reads weights on ~60% of requests)
        assert counts.total_loads() <= 0.1 * len(mix), counts.loads_by_adapter
        # a burst found no free slot: over the slots only until those adapters are idle
        await until(lambda: all(len(h) <= 2 for h in state.adapters.held.values()), 6.0)
        assert all(len(s.adapters) <= 2 for s in stubs)


async def test_a_restarted_worker_gets_its_adapters_back() -> None:
    stubs = [LoraStub("a")]
    async with fleet(stubs, (AdapterSpec("chat", "/a/chat"),)) as (router, state, _), \
            httpx.AsyncClient(base_url=router) as c:
        assert (await c.post("/v1/chat/completions", json=chat("chat"))).status_code == 200
        stubs[0].restart()
        await until(lambda: "chat" in stubs[0].adapters)
        assert state.adapters.counts.loads == {"demand": 1, "restore": 1}
        assert (await c.post("/v1/chat/completions", json=chat("chat"))).status_code == 200


async def test_admin_registers_and_a_new_worker_gets_pinned_adapters() -> None:
    stubs = [LoraStub("a"), LoraStub("b")]
    async with AsyncExitStack() as stack:
        late = await stack.enter_async_context(serve(stubs[1].app()))
        async with fleet(stubs[:1]) as (router, state, _), \
                httpx.AsyncClient(base_url=router, headers={"x-admin-key": ADMIN}) as c:
            bad = await c.post("/admin/adapters", json={"name": "x"})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "path"
            r = await c.post("/admin/adapters", json={"name": "p", "path": "/a/p", "pinned": True})
            assert r.status_code == 201
            await until(lambda: "p" in stubs[0].adapters)
            assert (await c.post("/admin/workers", json={"url": late})).status_code in (200, 201)
            await until(lambda: "p" in stubs[1].adapters)
            assert state.adapters.counts.loads == {"pinned": 2}
            listed = (await c.get("/admin/adapters")).json()["adapters"]
            assert listed[0]["name"] == "p" and len(listed[0]["workers"]) == 2
            assert (await c.delete("/admin/adapters/p")).status_code == 200
            assert not stubs[0].adapters and not stubs[1].adapters


def test_adapters_and_aliases_read_from_a_config_file() -> None:
    config = router_from_dict({
        "adapters": [{"name": "sql", "path": "/a/sql", "base": "base"}],
        "adapter_placement": {"max_adapter_replicas": 3},
        "aliases": {"fast": "sql", "auto": {"policy": "cascade", "small": "base",
                                            "large": "big", "keywords": ["Prove"]}}})
    assert config.adapters[0].base == "base" and config.adapter_placement.max_adapter_replicas == 3
    assert config.aliases[0].target == "sql"
    assert config.aliases[1].cascade is not None and config.aliases[1].cascade.keywords == ("prove",)
    with pytest.raises(Exception, match="max_adapter_replicas"):
        router_from_dict({"adapter_placement": {"max_adapter_replicas": 0}})


def test_cli_flags_register_adapters_aliases_and_the_replica_cap() -> None:
    import argparse

    from sluice.router import cli

    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    args = parser.parse_args(["router", "--worker", "http://w:1", "--alias", "other",
                              "--alias", "fast=sql", "--lora-adapter", "sql=/a/sql",
                              "--max-adapter-replicas", "3"])
    config = cli.config_from_args(args)
    assert config.pools[0].aliases == ("other",)
    assert [(a.name, a.target) for a in config.aliases] == [("fast", "sql")]
    assert [(a.name, a.path) for a in config.adapters] == [("sql", "/a/sql")]
    assert config.adapter_placement.max_adapter_replicas == 3
