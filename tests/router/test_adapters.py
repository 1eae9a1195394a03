"""Adapter placement (router/adapters.py) against LoRA stub workers over real HTTP."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry
from tests.router.lora_stub import LoraStub, chat, content_hash
from tests.router.router_stubs import serve, serve_router

from sluice.protocol.block_hash import hash_blocks
from sluice.protocol.kv_events import BlockStored
from sluice.router.adapters import Adapters, Holding
from sluice.router.app import build_app
from sluice.router.config import (
    CANARY,
    SHADOW,
    AdapterPlacement,
    AdapterSpec,
    PoolConfig,
    ReleaseConfig,
    RouterConfig,
    WorkerSpec,
    router_from_dict,
)
from sluice.router.kv_subscriber import apply_event
from sluice.router.policies import RequestMeta
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


async def test_v1_models_lists_every_adapter_with_its_parent() -> None:
    """/v1/models gives an adapter vLLM's `parent` and `root`, whether a worker lists it
    (--lora-modules) or the router registered it, loaded or not. Once a worker listed an
    adapter, its entry was a base model's (no parent): a discovered one always, a
    registered one from its first load on."""
    stubs = [LoraStub("a")]
    stubs[0].adapters["sql"] = "/adapters/sql"
    async with fleet(stubs, (AdapterSpec("chat", "/adapters/chat"),)) as (router, state, _), \
            httpx.AsyncClient(base_url=router) as c:
        async def listed() -> dict[str, dict[str, Any]]:
            return {m["id"]: m for m in (await c.get("/v1/models")).json()["data"]}

        models = await listed()
        assert "parent" not in models["base"]
        assert (models["sql"]["parent"], models["sql"]["root"]) == ("base", "/adapters/sql")
        assert (models["chat"]["parent"], models["chat"]["root"]) == (None, "/adapters/chat")
        assert (await c.post("/v1/chat/completions", json=chat("chat"))).status_code == 200
        await until(lambda: "chat" in state.pools[0].names())  # the worker lists it now
        models = await listed()
        assert (models["chat"]["parent"], models["chat"]["root"]) == (None, "/adapters/chat")
        assert list(models).count("chat") == 1


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
        # one load on demand, which the other four wait for (none loads it again); the
        # burst of five placed at once may make it hot enough for its second copy
        loads = state.adapters.counts.loads
        assert loads["demand"] == 1 and loads.get("replicate", 0) <= 1, loads
        assert sum(s.load_calls for s in stubs) == state.adapters.counts.total_loads()


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


ZIPF_NAMES = [f"lora{i}" for i in range(8)]
ZIPF_SPECS = tuple(AdapterSpec(n, f"/a/{n}") for n in ZIPF_NAMES)


def zipf_mix(seed: int, k: int) -> list[str]:
    """k adapter names drawn Zipf(1.1) over ZIPF_NAMES (lora0 the hottest)."""
    weights = [1 / (i + 1) ** 1.1 for i in range(len(ZIPF_NAMES))]
    return random.Random(seed).choices(ZIPF_NAMES, weights, k=k)


async def statuses(c: httpx.AsyncClient, names: list[str], concurrency: int) -> set[int]:
    """One chat request per name, `concurrency` at a time: the set of statuses."""
    sem = asyncio.Semaphore(concurrency)

    async def one(name: str) -> int:
        async with sem:
            return (await c.post("/v1/chat/completions", json=chat(name))).status_code

    return set(await asyncio.gather(*(one(n) for n in names)))


async def test_zipf_mix_does_not_thrash() -> None:
    """8 adapters, Zipf(1.1), 3 workers of 2 slots, 240 requests 6 at a time."""
    stubs = [LoraStub(n, service_s=0.01, max_num_seqs=4) for n in "abc"]
    mix = zipf_mix(seed=7, k=240)
    async with fleet(stubs, ZIPF_SPECS, max_adapter_replicas=2, load_s=0.001,
                     min_residency_s=30) \
            as (router, state, _), httpx.AsyncClient(base_url=router, timeout=30) as c:
        assert await statuses(c, mix, concurrency=6) == {200}
        counts = state.adapters.counts
        # the two hottest: a second copy of each is an extra replica, the first copy to go
        # when a request finds no holder and has waited out its patience (the rule), so
        # timing decides how often each is replicated again. The hottest (107 of the 240
        # requests) loaded 3 times in 3 runs of 58 of this body since the tail shares its
        # slots (docs/router.md); the second (40 requests) 3-4 times in earlier runs and 5
        # in one fresh-clone CI run (2026-12-03, night): a fixed count for it kept being
        # one short. Thrash is a load on a large share of an adapter's own requests (an
        # engine's LRU behind round robin: ~60%), so its bound is a share: 15% (6 of 40).
        assert counts.loads_by_adapter["lora0"] <= 4, counts.loads_by_adapter
        assert counts.loads_by_adapter["lora1"] <= 0.15 * mix.count("lora1"), \
            (mix.count("lora1"), counts.loads_by_adapter)
        # 8 adapters for 6 slots: the tail rotates through the free slot, but a load is
        # rare: an engine's LRU behind round robin reads weights on ~60% of requests, this
        # at most a third of that. The tail shares its slots (a tail request takes an idle
        # tail copy rather than wait for its own kind to go idle): 11.7-15.8% of requests
        # in 58 runs of this body on a 2-core host, against 10.4-12.9% in 42 runs when the
        # tail waited (docs/router.md, "The tail shares its slots");
        assert counts.total_loads() <= 0.20 * len(mix), counts.loads_by_adapter
        # a burst found no free slot: over the slots only until those adapters are idle;
        # the router's view and the workers' own (an unload is on its way a moment after
        # the router counts it gone)
        await until(lambda: all(len(h) <= 2 for h in state.adapters.held.values())
                    and all(len(s.adapters) <= 2 for s in stubs), 6.0)


async def test_zipf_mix_replicates_the_hottest_adapter_and_keeps_the_two_hottest() -> None:
    """The hottest adapter (40% of requests) is replicated and loaded no more often than
    it may have copies (never evicted and loaded again); the second (19%) at most once
    more (its extra replica is the first copy to go when a request finds no holder).
    Which worker a copy goes to among near-equal ones is a matter of timing here; the
    rule itself is checked on fixed data below."""
    stubs = [LoraStub(n, service_s=0.02, max_num_seqs=2) for n in "abc"]
    mix = ["lora0", "lora1"] + zipf_mix(seed=3, k=180)
    async with fleet(stubs, ZIPF_SPECS, max_adapter_replicas=2, load_s=0.01,
                     min_residency_s=30) \
            as (router, state, _), httpx.AsyncClient(base_url=router, timeout=30) as c:
        assert await statuses(c, mix, concurrency=8) == {200}
        counts = state.adapters.counts
        by = counts.loads_by_adapter
        assert len(state.adapters.holders("lora0")) == 2 and by["lora0"] == 2, counts
        assert by["lora1"] <= 3, counts  # its copies (up to the cap), and one reload at most
        assert counts.total_loads() <= 0.15 * len(mix), by


ZIPF_SHARES = {"lora0": 0.40, "lora1": 0.19, "lora2": 0.12, "lora3": 0.087, "lora4": 0.068,
               "lora5": 0.055, "lora6": 0.047, "lora7": 0.040}


def placed(held: dict[str, list[str]], client: httpx.AsyncClient | None = None) -> Adapters:
    """Adapters on fixed data: workers' holdings (2 slots each), recent shares as
    ZIPF_SHARES, every copy resident for 10 s and idle (clock 100)."""
    adapters = Adapters(ZIPF_SPECS, AdapterPlacement(adapters_per_worker=2, min_residency_s=30),
                        client or httpx.AsyncClient(), list, CollectorRegistry(),
                        clock=lambda: 100.0)
    for url, names in held.items():
        adapters.held[url] = {n: Holding(loaded_at=90.0, by_router=True,
                                         last_used=90.0 - i) for i, n in enumerate(names)}
    adapters.recent = {n: round(1000 * share) for n, share in ZIPF_SHARES.items()}
    return adapters


def test_a_hot_copy_goes_to_the_coolest_worker_else_takes_a_rare_last_copy() -> None:
    """lora0 is hot on a (3 of its requests placed, 3 in flight in the pool); b holds
    lora1 (19%), c lora2 (12%), each with a free slot: the copy goes to c, the cooler,
    though b is as cheap. Once every slot holds some adapter's only copy, the copy takes
    the idle one worth least among those at most half as used as the copy would be
    (20% / 2: lora7's 4% on b, lora3's 8.7% on c), on the worker coolest once it is gone
    (c: lora2's 12% left, b: lora1's 19%), never a busy one nor one more used (lora1,
    lora2); an adapter that is not hot (lora1) takes no last copy."""
    adapters = placed({"a": ["lora0", "lora4"], "b": ["lora1"], "c": ["lora2"]})
    adapters.placing["lora0"] = 3
    seconds = {"a": 0.2, "b": 0.1, "c": 0.1}
    load = adapters._target("lora0", ["a", "b", "c"], ["a"], seconds, pool_inflight=3)
    assert load is not None and (load.url, load.victim, load.reason) == \
        ("c", None, "replicate")
    adapters.held["b"]["lora7"] = Holding(90.0, True, 80.0)
    adapters.held["c"]["lora3"] = Holding(90.0, True, 80.0)
    load = adapters._target("lora0", ["a", "b", "c"], ["a"], seconds, pool_inflight=3)
    assert load is not None and (load.url, load.victim, load.reason) == \
        ("c", "lora3", "replicate")
    adapters.inflight[("c", "lora3")] = 1
    load = adapters._target("lora0", ["a", "b", "c"], ["a"], seconds, pool_inflight=4)
    assert load is not None and (load.url, load.victim) == ("b", "lora7")
    adapters.inflight[("b", "lora7")] = 1
    assert adapters._target("lora0", ["a", "b", "c"], ["a"], seconds, pool_inflight=5) is None
    adapters.inflight.clear()
    adapters.placing, adapters.load_s = {"lora1": 3}, 0.0  # a and c cheap enough for a copy
    assert adapters._target("lora1", ["a", "b", "c"], ["b"], {"a": 0.1, "b": 0.2, "c": 0.1},
                            pool_inflight=3) is None


def test_a_request_with_no_holder_waits_rather_than_evict_a_more_used_copy() -> None:
    """lora6 has no holder; every copy is busy but lora0's two (20% each, idle a
    moment): while the request may wait (`patient`), no copy of an adapter more used
    than lora6 is evicted and no worker goes over its slots (the load is `over`: wait).
    Once it has waited long enough, an idle copy is evicted as before (lora0's on a, the
    cheaper of two equal); with none idle, the copy worth least among adapters no more
    used than lora6 (lora4 on a) is drained for it, busy as it is."""
    adapters = placed({"a": ["lora0", "lora4"], "b": ["lora0", "lora7"],
                       "c": ["lora1", "lora2"]})
    for key in (("a", "lora4"), ("b", "lora7"), ("c", "lora1"), ("c", "lora2")):
        adapters.inflight[key] = 1
    seconds = {"a": 0.1, "b": 0.2, "c": 0.1}
    load = adapters._target("lora6", ["a", "b", "c"], [], seconds, patient=True)
    assert load is not None and (load.victim, load.over) == (None, True)
    load = adapters._target("lora6", ["a", "b", "c"], [], seconds, patient=False)
    assert load is not None and (load.url, load.victim, load.drain) == ("a", "lora0", False)
    adapters.inflight[("a", "lora0")] = adapters.inflight[("b", "lora0")] = 1
    load = adapters._target("lora6", ["a", "b", "c"], [], seconds, patient=False)
    assert load is not None and (load.url, load.victim, load.drain) == ("a", "lora4", True)


def test_a_tail_request_takes_an_idle_tail_copy_more_used_than_its_own() -> None:
    """lora6 (4.7%) has no holder; 6 slots, so one slot's worth is 1/6 (17%) and the tail
    is below 17% - 2.5%. The only idle copies are on b: lora3 (8.7%, a step more used
    than lora6) and lora1 (19%). While the request may wait, it takes lora3's copy: a
    tail adapter shares its slot with the rest of the tail rather than keep a request
    waiting for another tail copy to go idle. lora1 is hot: busy lora3, the request waits
    (`over`) rather than take lora1's only copy."""
    adapters = placed({"a": ["lora0", "lora4"], "b": ["lora1", "lora3"],
                       "c": ["lora0", "lora2"]})
    for key in (("a", "lora0"), ("a", "lora4"), ("c", "lora0"), ("c", "lora2")):
        adapters.inflight[key] = 1
    seconds = {"a": 0.1, "b": 0.2, "c": 0.1}
    load = adapters._target("lora6", ["a", "b", "c"], [], seconds, patient=True)
    assert load is not None and (load.url, load.victim, load.over) == ("b", "lora3", False)
    adapters.inflight[("b", "lora3")] = 1
    load = adapters._target("lora6", ["a", "b", "c"], [], seconds, patient=True)
    assert load is not None and (load.victim, load.over) == (None, True)


async def test_a_drained_copy_takes_no_requests_and_is_unloaded_once_idle() -> None:
    """A drained copy is no holder at once (its slot is the new adapter's), and is
    unloaded on the worker only once its requests there have ended."""
    posts: list[str] = []

    def worker(request: httpx.Request) -> httpx.Response:
        posts.append(f"{request.url.path} {request.read().decode()}")
        return httpx.Response(200, text="Success")

    a = "http://a"
    adapters = placed({a: ["lora0", "lora4"]},
                      httpx.AsyncClient(transport=httpx.MockTransport(worker)))
    adapters.inflight[(a, "lora4")] = 1
    adapters._drain(a, "lora4")
    assert adapters.holders("lora4") == [] and adapters.holders("lora0") == [a]
    await adapters._drop_idle(a)
    assert posts == [] and adapters.draining == {(a, "lora4")}
    adapters.inflight[(a, "lora4")] = 0
    await adapters._drop_idle(a)
    assert posts == ['/v1/unload_lora_adapter {"lora_name":"lora4"}']
    assert adapters.draining == set() and adapters.counts.unloads == {"evict": 1}


def test_a_request_with_no_holder_evicts_the_least_used_copy_in_the_pool() -> None:
    """lora6 has no holder and every slot is full: the copy evicted is the pool's least
    used (lora7, 4%), not a worker's least recently used (lora1's, the oldest here), and
    on whichever worker it is."""
    adapters = placed({"a": ["lora0", "lora4"], "b": ["lora1", "lora7"],
                       "c": ["lora2", "lora3"]})
    adapters.held["b"]["lora1"].last_used = 0.0
    load = adapters._target("lora6", ["a", "b", "c"], [], {"a": 0.1, "b": 0.2, "c": 0.1})
    assert load is not None and (load.url, load.victim, load.reason) == ("b", "lora7", "demand")


class CountingStub(LoraStub):
    """A stub that records the most adapters it held at once."""

    most: int = 0

    async def load(self, request: Any) -> Any:
        reply = await super().load(request)
        self.most = max(self.most, len(self.adapters))
        return reply


async def test_a_request_with_no_room_waits_for_a_copy_to_go_idle() -> None:
    """One worker of one slot; `x` has a request in flight there when one for `y`
    arrives: `y` waits until `x` is idle and takes its slot (an eviction), rather than
    loading beside it over the slot (the worker would swap weights on each request)."""
    stub = CountingStub("a", service_s=0.1, max_num_seqs=2)
    specs = (AdapterSpec("x", "/a/x"), AdapterSpec("y", "/a/y"))
    async with fleet([stub], specs, adapters_per_worker=1) as (router, state, urls), \
            httpx.AsyncClient(base_url=router, timeout=30) as c:
        first = asyncio.create_task(statuses(c, ["x"], concurrency=1))
        await until(lambda: state.adapters.inflight.get((urls[0], "x")) or "x" in stub.served)
        assert await statuses(c, ["y"], concurrency=1) == {200}
        assert await first == {200}
        assert stub.served == ["x", "y"] and sorted(stub.adapters) == ["y"]
        assert state.adapters.counts.loads == {"demand": 2}
        assert state.adapters.counts.unloads == {"evict": 1}  # not "trim": never over
        assert stub.most == 1


class SlowUnload(LoraStub):
    """A stub whose unloads wait for `release` (a read of /v1/models meanwhile still
    lists the adapter)."""

    release: asyncio.Event

    async def unload(self, request: Any) -> Any:
        await self.release.wait()
        return await super().unload(request)


async def test_a_sync_during_an_unload_does_not_bring_the_adapter_back() -> None:
    """The router unloads `x` on a worker; a sync reads the worker's list before the
    worker has unloaded it: `x` stays gone from the router's view (else requests for it
    go there and meet a 404), and comes back only if a later read lists it."""
    stub = SlowUnload("a")
    stub.release = asyncio.Event()
    specs = (AdapterSpec("x", "/a/x"),)
    async with fleet([stub], specs, sync_interval_s=3600) as (router, state, urls), \
            httpx.AsyncClient(base_url=router, timeout=30) as c:
        assert await statuses(c, ["x"], concurrency=1) == {200}
        adapters, pool = state.adapters, state.pools[0]
        await until(lambda: adapters.holders("x") == urls)
        unload = asyncio.create_task(adapters._unload(urls[0], "x", "evict"))
        await asyncio.sleep(0)  # the unload is sent and waits in the worker
        await adapters.sync(pool, urls[0])
        assert "x" in stub.adapters and adapters.holders("x") == []
        stub.release.set()
        await unload
        await adapters.sync(pool, urls[0])
        assert "x" not in stub.adapters and adapters.holders("x") == []


async def test_a_404_from_a_holder_places_the_request_again() -> None:
    """Worker a lost `x` behind the router's back (an unload the router did not make):
    the 404 drops a as a holder and the request is placed again, loading `x` anew."""
    stubs = [LoraStub("a")]
    async with fleet(stubs, (AdapterSpec("x", "/a/x"),), sync_interval_s=3600) as \
            (router, state, urls), httpx.AsyncClient(base_url=router, timeout=30) as c:
        assert await statuses(c, ["x"], concurrency=1) == {200}
        del stubs[0].adapters["x"]
        assert await statuses(c, ["x"], concurrency=1) == {200}
        assert state.adapters.counts.loads_by_adapter["x"] == 2 and stubs[0].load_calls == 2


async def test_an_adapter_no_worker_could_load_is_never_served_by_the_base_model() -> None:
    """The adapter could be loaded nowhere (the worker refuses loads, as a sluice worker
    without --enable-lora does): the request goes to a worker as the adapter's and its 404
    reaches the client. The router rewrote the adapter's name to the base model's (as it
    does a pool alias), so the base model answered 200 in the adapter's place (a new-user
    pass: `POST /admin/adapters` then a chat for it, against default workers)."""
    stubs = [LoraStub("a", lora_enabled=False)]
    async with fleet(stubs, (AdapterSpec("x", "/a/x"),)) as (router, _, _urls), \
            httpx.AsyncClient(base_url=router, timeout=30) as c:
        r = await c.post("/v1/chat/completions", json=chat("x"))
        assert r.status_code == 404 and "`x`" in r.json()["error"]["message"], r.text
        assert stubs[0].served == [] and stubs[0].load_calls >= 1
        r = await c.post("/v1/chat/completions", json=chat("base"))  # the base is served
        assert r.status_code == 200 and stubs[0].served == ["base"]


async def test_an_adapter_prompt_is_tokenized_as_the_base_models() -> None:
    """The router counts and hashes an adapter request's prompt on a worker's /tokenize
    under the base model's name (an adapter shares its tokenizer), whichever worker it
    asks, also one that does not hold the adapter: a worker refuses a model it does not
    serve (404), and the prompt was then routed on load alone."""
    stubs = [LoraStub("a"), LoraStub("b")]
    async with fleet(stubs, (AdapterSpec("x", "/a/x"),)) as (router, _, _urls), \
            httpx.AsyncClient(base_url=router, timeout=30) as c:
        for i in range(4):
            r = await c.post("/v1/chat/completions", json=chat("x", salt=i))
            assert r.status_code == 200, r.text
        asked = sum(s.tokenize_refused for s in stubs)
        assert asked == 0, [s.tokenize_refused for s in stubs]


async def test_a_placed_request_keeps_its_adapter_until_it_is_sent() -> None:
    """A request placed on `rare`'s holder (`prepare`) and not yet sent keeps `rare` there,
    however long it takes to be sent (a wall-clock grace alone let a busy event loop
    evict it first, and the request met a 404): `new` evicts `busy` instead, though
    `rare` serves less; once the request is given up (`unplace`), `rare` is idle."""
    stubs = [LoraStub("a")]
    specs = tuple(AdapterSpec(n, f"/a/{n}") for n in ("rare", "busy", "new"))
    async with fleet(stubs, specs) as (router, state, urls), \
            httpx.AsyncClient(base_url=router, timeout=30) as c:
        assert await statuses(c, ["busy"] * 3 + ["rare"], concurrency=1) == {200}
        pool = state.pools[0]
        assert await state.adapters.prepare(pool, "rare", RequestMeta("rare", 8)) == ()
        await asyncio.sleep(0.1)  # both idle for longer than the grace (MIN_IDLE_S)
        assert await statuses(c, ["new"], concurrency=1) == {200}
        assert sorted(stubs[0].adapters) == ["new", "rare"]
        assert state.adapters.busy(urls[0], "rare")
        state.adapters.unplace("rare")
        assert not state.adapters.busy(urls[0], "rare") and not state.adapters.placing


async def test_prefix_hits_are_keyed_by_adapter() -> None:
    """Worker a holds the base model's KV blocks of a prompt, worker b the adapter's
    (hashed with the adapter's content hash, as the engine's KV events are): the adapter
    request goes to b, the base request to a; neither counts the other's blocks."""
    stubs = [LoraStub("a"), LoraStub("b")]
    for s in stubs:
        s.adapters["sql"] = "/adapters/sql"
    async with AsyncExitStack() as stack:
        urls = [await stack.enter_async_context(serve(s.app())) for s in stubs]
        workers = tuple(WorkerSpec(u, kv_events=f"tcp://127.0.0.1:{1 + i}")
                        for i, u in enumerate(urls))
        config = RouterConfig(pools=(PoolConfig(model="base", workers=workers),),
                              health_interval_s=0.05, scrape_interval_s=0.05, seed=0,
                              adapter_placement=AdapterPlacement(sync_interval_s=0.05))
        app = build_app(config, rng=random.Random(0))
        router = await stack.enter_async_context(serve_router(app))
        state: RouterState = app.state.router
        c = await stack.enter_async_context(httpx.AsyncClient(base_url=router, timeout=10))
        await until(lambda: state.adapters.holders("sql") == sorted(urls))
        salt = bytes.fromhex(content_hash("/adapters/sql"))
        assert state.adapters.cache_salt("sql") == salt
        assert state.adapters.cache_salt("base") == b""
        pool = state.pools[0]
        body = chat("sql", words=64)
        ids = (await c.post(urls[0] + "/tokenize", json=body)).json()["tokens"]
        bs = pool.block_size
        base_blocks, sql_blocks = hash_blocks(ids, bs), hash_blocks(ids, bs, salt)
        assert len(base_blocks) >= 3 and not set(base_blocks) & set(sql_blocks)
        apply_event(pool.precise, urls[0], BlockStored(base_blocks, None, ids, bs))
        apply_event(pool.precise, urls[1], BlockStored(sql_blocks, None, ids, bs, 7))
        assert (await c.post("/v1/chat/completions", json=body)).status_code == 200
        assert (await c.post("/v1/chat/completions", json={**body, "model": "base"})
                ).status_code == 200
        assert stubs[0].served == ["base"] and stubs[1].served == ["sql"]


async def test_canary_and_shadow_requests_go_only_to_workers_holding_the_adapter() -> None:
    """A pool with a canary and a shadow worker: a canary request's adapter is loaded on
    the canary, a baseline one's on a baseline worker; a shadow copy goes only to a shadow
    worker that holds the adapter (never served there as the base model)."""
    stubs = [LoraStub("a"), LoraStub("b"), LoraStub("canary"), LoraStub("shadow")]
    async with AsyncExitStack() as stack:
        urls = [await stack.enter_async_context(serve(s.app())) for s in stubs]
        workers = (WorkerSpec(urls[0]), WorkerSpec(urls[1]),
                   WorkerSpec(urls[2], version=CANARY), WorkerSpec(urls[3], version=SHADOW))
        release = ReleaseConfig(canary_weight=0, auto=False, shadow_percent=100)
        config = RouterConfig(
            pools=(PoolConfig(model="base", workers=workers, release=release),),
            adapters=(AdapterSpec("sql", "/a/sql"),), health_interval_s=0.05,
            scrape_interval_s=0.05, seed=0,
            adapter_placement=AdapterPlacement(sync_interval_s=0.05))
        app = build_app(config, rng=random.Random(0))
        router = await stack.enter_async_context(serve_router(app))
        state: RouterState = app.state.router
        c = await stack.enter_async_context(httpx.AsyncClient(base_url=router, timeout=10))
        canary = {"x-sluice-version": CANARY}
        r = await c.post("/v1/chat/completions", json=chat("sql"), headers=canary)
        assert r.status_code == 200 and stubs[2].served == ["sql"], r.text
        assert (await c.post("/v1/chat/completions", json=chat("sql"))).status_code == 200
        assert stubs[0].served + stubs[1].served == ["sql"]
        assert state.adapters.counts.loads == {"demand": 2}
        stubs[3].adapters["sql"] = "/a/sql"  # the shadow worker gets it (--lora-modules)
        await until(lambda: urls[3] in state.adapters.holders("sql"))
        assert (await c.post("/v1/chat/completions", json=chat("sql"))).status_code == 200
        await until(lambda: stubs[3].served)
        assert stubs[3].served == ["sql"]  # the two copies before it were dropped


async def test_a_restarted_worker_gets_its_adapters_back() -> None:
    stubs = [LoraStub("a")]
    async with fleet(stubs, (AdapterSpec("chat", "/a/chat"),)) as (router, state, _), \
            httpx.AsyncClient(base_url=router) as c:
        assert (await c.post("/v1/chat/completions", json=chat("chat"))).status_code == 200
        stubs[0].restart()
        # the stub holds it as soon as the load arrives; the router counts it on the reply
        await until(lambda: "restore" in state.adapters.counts.loads)
        assert "chat" in stubs[0].adapters
        assert state.adapters.counts.loads == {"demand": 1, "restore": 1}
        assert (await c.post("/v1/chat/completions", json=chat("chat"))).status_code == 200


async def test_admin_refuses_an_adapter_named_as_the_model_or_on_a_base_no_pool_serves(
        ) -> None:
    """`POST /admin/adapters` with the pool's model as the adapter's name (the router then
    loaded a LoRA called `base` and placed the base model's requests as its), or with a
    base no pool serves (a typo: listed by /v1/models, never loaded, and each request a
    404 naming the base): 400 naming the field, nothing registered or loaded."""
    stubs = [LoraStub("a")]
    async with fleet(stubs) as (router, state, _), \
            httpx.AsyncClient(base_url=router, headers={"x-admin-key": ADMIN}) as c:
        r = await c.post("/admin/adapters", json={"name": "base", "path": "/a/z"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "name", r.text
        r = await c.post("/admin/adapters", json={"name": "x", "path": "/a/x", "base": "bse"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "base", r.text
        assert (await c.get("/admin/adapters")).json()["adapters"] == []
        r = await c.post("/v1/chat/completions", json=chat("base"))
        assert r.status_code == 200 and stubs[0].load_calls == 0
        r = await c.post("/admin/adapters", json={"name": "x", "path": "/a/x", "base": "base"})
        assert r.status_code == 201, r.text
        r = await c.post("/admin/adapters", json={"name": "x", "path": "/a/x2"})  # replaced
        assert r.status_code == 201, r.text


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
            await until(lambda: state.adapters.counts.loads.get("pinned") == 2)
            assert "p" in stubs[1].adapters
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


async def test_a_hung_worker_s_model_list_does_not_hold_the_sync_round() -> None:
    """A sync round read each worker's /v1/models with the read timeout (600 s), so a hung
    worker held the round (and a router starting beside it, which syncs first); it waits
    the probes' timeout, then that worker is skipped this round."""
    import time

    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def hung(_: Any) -> JSONResponse:
        await asyncio.sleep(2.5)  # (the stub's shutdown waits for it)
        return JSONResponse({"data": []})

    async with serve(Starlette(routes=[Route("/v1/models", hung)])) as url, \
            httpx.AsyncClient() as client:
        adapters = Adapters([], AdapterPlacement(), client, lambda: [], CollectorRegistry(),
                            read_timeout_s=0.3)
        start = time.monotonic()
        assert await adapters._read_adapters(url) is None
        assert time.monotonic() - start < 2.0
