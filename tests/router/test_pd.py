"""Prefill/decode disaggregation in the router (router/pd.py), over real HTTP on 127.0.0.1
against stub workers that play vLLM's side of `kv_transfer_params` (pd_stubs.py)."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import httpx
import pytest
from pd_stubs import KVStore, PDStub, answer, make_pd_stub
from router_stubs import serve

from sluice.control.pd import PDController
from sluice.control.planner import PDRatioConfig, PDRatioPlanner, PDSignals
from sluice.control.signals import pd_signals
from sluice.protocol.errors import ConflictError, InvalidRequestError
from sluice.router.app import build_app
from sluice.router.cli import config_from_args
from sluice.router.config import (
    AdapterSpec,
    PDConfig,
    PoolConfig,
    RouterConfig,
    WorkerSpec,
    pool_from_dict,
)
from sluice.router.server import RouterServer
from sluice.router.state import RouterState

LONG = " ".join(f"w{i}" for i in range(120))  # 120 words = 120 stub tokens


@asynccontextmanager
async def pd_cluster(stubs: list[PDStub], pd: PDConfig, roles: bool = True,
                     configured: dict[str, str] | None = None, policy: str = "cost",
                     **router_kw: Any) -> AsyncIterator[tuple[str, RouterState]]:
    """The stubs behind a router whose pool is disaggregated; `roles`: configure each
    worker's role (its stub's, or by name from `configured`; else the router reads them
    from /v1/pd_role). Each stub's `url` is set."""
    configured = configured or {}
    async with AsyncExitStack() as stack:
        urls = [await stack.enter_async_context(serve(make_pd_stub(s))) for s in stubs]
        for s, u in zip(stubs, urls, strict=True):
            s.url = u
        workers = tuple(WorkerSpec(u, role=configured.get(s.name, s.role) if roles else None)
                        for s, u in zip(stubs, urls, strict=True))
        config = RouterConfig(pools=(PoolConfig(model="stub-model", workers=workers, pd=pd,
                                                policy=policy),),
                              seed=0, health_interval_s=30, scrape_interval_s=30, **router_kw)
        server = await stack.enter_async_context(RouterServer(build_app(config), "127.0.0.1", 0,
                                                              shutdown_timeout_s=5))
        assert server.state is not None
        yield server.url, server.state


def chat(content: str, **kw: Any) -> dict[str, Any]:
    return {"model": "stub-model", "messages": [{"role": "user", "content": content}], **kw}


def pd_counts(state: RouterState) -> dict[str, float]:
    text = state.metrics.render().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("sluice_router_pd_requests_total{"):
            out[line.split('"')[1]] = float(line.split()[-1])
    return out


async def answered_both_ways(c: httpx.AsyncClient, url: str) -> None:
    """A chat of LONG, non-streamed then streamed, answered 200 with the stub's words."""
    for stream in (False, True):
        body = chat(LONG, max_tokens=3, stream=stream)
        r = await c.post(url + "/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        got = r.text if stream else r.json()["choices"][0]["message"]["content"]
        assert all(w in got for w in answer(body, 3))


def no_errors(*stubs: PDStub) -> None:
    assert [e for s in stubs for e in s.errors] == []


async def test_the_router_drives_vllm_workers_with_exactly_vllms_fields() -> None:
    """Interop: non-streamed chat and streamed completion (with stream_options), each
    through a vLLM-style prefill worker then a decode worker; the client's body reaches
    the decode worker unchanged but for the prefill's kv_transfer_params."""
    store = KVStore()
    p, d = PDStub("p", store, role="prefill"), PDStub("d", store, role="decode")
    async with pd_cluster([p, d], PDConfig(mode="always")) as (url, state), \
            httpx.AsyncClient(timeout=10) as c:
        body = chat(LONG, max_tokens=5, temperature=0)
        r = await c.post(url + "/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["worker"] == "d"
        assert r.json()["choices"][0]["message"]["content"] == " ".join(answer(body, 5))
        assert "kv_transfer_params" not in r.json()
        assert len(p.prefills) == 1 and len(d.decodes) == 1 and not d.locals
        decoded = dict(d.decodes[0])
        params = decoded.pop("kv_transfer_params")
        assert decoded == body
        assert params["remote_engine_id"] == "engine-p" and params["tp_size"] == 1

        body = {"model": "stub-model", "prompt": LONG, "max_tokens": 3, "stream": True,
                "stream_options": {"include_usage": True}, "max_completion_tokens": 3}
        async with c.stream("POST", url + "/v1/completions", json=body) as r:
            text = (await r.aread()).decode()
        assert r.status_code == 200
        events = [json.loads(e[6:]) for e in text.split("\n\n") if e.startswith("data: {")]
        assert "".join(e["choices"][0]["text"] for e in events).split() == answer(body, 3)
        assert text.rstrip().endswith("data: [DONE]")
        assert p.prefills[1]["stream"] is False and "stream_options" not in p.prefills[1]
        assert p.prefills[1]["max_completion_tokens"] == 1
        assert d.decodes[1]["stream"] is True and d.decodes[1]["stream_options"] == \
            {"include_usage": True}
        assert pd_counts(state) == {"disaggregated": 2.0, "local": 0.0, "fallback": 0.0}
        metrics = state.metrics.render().decode()
        assert "sluice_router_pd_prefill_seconds_count 2.0" in metrics
        assert "sluice_router_pd_transfer_seconds_count 1.0" in metrics  # the stream
        assert "sluice_router_pd_decode_seconds_count 2.0" in metrics
        # two client requests, counted once each (the prefill step counted a third and
        # a fourth)
        assert 'sluice_router_requests_total{model="stub-model",status="200"} 2.0' in metrics
        # and their first bytes timed once each, from routing to the decode worker's first
        # bytes (the prefill step's answer was a sample of its own)
        assert 'sluice_router_first_byte_seconds_count{model="stub-model"} 2.0' in metrics
        assert p.epochs_seen == [None, None]  # vLLM workers: no epoch known, none sent
    no_errors(p, d)


async def test_a_worker_started_without_a_role_takes_the_configured_one() -> None:
    """`--prefill-worker URL` in front of a sluice worker started without `--role` (it
    reports `both`, epoch 0): the router prefills there. The worker's `both` replaced the
    configured role, so no worker was a prefill worker and every request went local,
    silently (a new-user pass: `sluice router --prefill-worker A --decode-worker B
    --pd-mode always` with A a default worker counted only `local`). A worker switched
    since (epoch > 0) is taken at its word."""
    store = KVStore()
    p = PDStub("p", store, role="both", pd_api=True)
    d = PDStub("d", store, role="decode", pd_api=True)
    async with pd_cluster([p, d], PDConfig(mode="always"), configured={"p": "prefill"}) \
            as (url, state), httpx.AsyncClient(timeout=10) as c:
        r = await c.post(url + "/v1/chat/completions", json=chat(LONG, max_tokens=3))
        assert r.status_code == 200 and r.json()["worker"] == "d", r.text
        assert len(p.prefills) == 1 and len(d.decodes) == 1
        assert pd_counts(state) == {"disaggregated": 1.0, "local": 0.0, "fallback": 0.0}
        pool = state.pools[0]
        p.epoch = 1  # switched to both since: its word stands
        await state.pd.roles.refresh(pool.endpoints[p.url])
        assert state.pd.roles.count(pool) == {"prefill": 0, "decode": 1, "both": 1}
    no_errors(p, d)


async def test_conditional_disaggregation_follows_the_uncached_tokens() -> None:
    """Short prompts prefill locally; a long one goes to the prefill worker; the same long
    prompt again is cached on the decode worker that got its KV, so it stays local."""
    store = KVStore()
    p, d = PDStub("p", store, role="prefill"), PDStub("d", store, role="decode")
    config = PDConfig(min_uncached_tokens=64, max_prefill_wait_ratio=100.0)
    async with pd_cluster([p, d], config) as (url, state), httpx.AsyncClient(timeout=10) as c:
        short = await c.post(url + "/v1/chat/completions", json=chat("hello there"))
        assert short.status_code == 200 and not p.prefills and len(d.locals) == 1
        long_body = chat(LONG + " first")
        r = await c.post(url + "/v1/chat/completions", json=long_body)
        assert r.status_code == 200 and len(p.prefills) == 1 and len(d.decodes) == 1
        again = await c.post(url + "/v1/chat/completions", json=chat(LONG + " second"))
        assert again.status_code == 200
        assert len(p.prefills) == 1 and len(d.locals) == 2  # the prefix is on d now
        assert pd_counts(state) == {"disaggregated": 1.0, "local": 2.0, "fallback": 0.0}
    no_errors(p, d)


async def test_conditional_stays_local_while_the_prefill_side_is_busy() -> None:
    store = KVStore()
    p, d = PDStub("p", store, role="prefill"), PDStub("d", store, role="decode")
    async with pd_cluster([p, d], PDConfig(min_uncached_tokens=64)) as (url, state), \
            httpx.AsyncClient(timeout=10) as c:
        busy = state.pools[0].endpoints[p.url]
        busy.prefill_tokens = 100_000.0  # the router's own queued prefill there
        r = await c.post(url + "/v1/chat/completions", json=chat(LONG))
        assert r.status_code == 200 and not p.prefills and len(d.locals) == 1
        busy.prefill_tokens = 0.0
        r = await c.post(url + "/v1/chat/completions", json=chat("another " + LONG))
        assert r.status_code == 200 and len(p.prefills) == 1
    no_errors(p, d)


@pytest.mark.parametrize("failure", ["prefill_500", "prefill_down", "kv_pull"])
async def test_failures_fall_back_to_a_local_prefill_on_a_decode_worker(failure: str) -> None:
    store = KVStore()
    p, d = PDStub("p", store, role="prefill"), PDStub("d", store, role="decode")
    p.fail_status = 500 if failure == "prefill_500" else None
    p.fail_status = 503 if failure == "prefill_down" else p.fail_status
    d.fail_pull = failure == "kv_pull"
    async with pd_cluster([p, d], PDConfig(mode="always"), max_retries=0) as (url, state), \
            httpx.AsyncClient(timeout=10) as c:
        await answered_both_ways(c, url)
        assert len(d.locals) == 2 and "kv_transfer_params" not in d.locals[0]
        assert pd_counts(state)["fallback"] == 2.0
        if failure == "kv_pull":
            assert len(p.prefills) == 2 and not d.decodes
    no_errors(p, d)


@pytest.mark.parametrize("mode, decode", [("always", "ejected"), ("conditional", "ejected"),
                                          ("always", "failing")])
async def test_with_no_decode_worker_left_a_prefill_worker_serves_the_request_whole(
        mode: str, decode: str) -> None:
    """A pool whose decode workers are all ejected (or all answer 5xx) is served by its
    prefill workers, whole engines, instead of answering 503 (before: a prefill, then
    no decode worker to hand off to, then 503 `no_healthy_worker`)."""
    store = KVStore()
    p, d = PDStub("p", store, role="prefill"), PDStub("d", store, role="decode")
    d.fail_status = 500 if decode == "failing" else None
    async with pd_cluster([p, d], PDConfig(mode=mode, min_uncached_tokens=1),
                          max_retries=0) as (url, state), httpx.AsyncClient(timeout=10) as c:
        if decode == "ejected":
            state.pools[0].endpoints[d.url].healthy = False
        await answered_both_ways(c, url)
        assert len(p.locals) == 2 and "kv_transfer_params" not in p.locals[0]
        assert not d.locals and not d.decodes
        assert pd_counts(state)["fallback"] == 2.0
        if decode == "ejected":  # planned local at once: no prefill whose KV nobody pulls
            assert not p.prefills
    no_errors(p, d)


async def test_a_request_the_prefill_worker_refuses_is_answered_locally_not_as_a_fallback(
        ) -> None:
    """A 4xx from the prefill worker is about the request (too long, a bad field): the
    decode worker answers it as a local request, with no failure counted."""
    store = KVStore()
    p, d = PDStub("p", store, role="prefill"), PDStub("d", store, role="decode")
    p.fail_status = 400
    async with pd_cluster([p, d], PDConfig(mode="always"), max_retries=0) as (url, state), \
            httpx.AsyncClient(timeout=10) as c:
        r = await c.post(url + "/v1/chat/completions", json=chat(LONG, max_tokens=3))
        assert r.status_code == 200, r.text
        assert len(d.locals) == 1 and not d.decodes
        assert pd_counts(state) == {"disaggregated": 0.0, "local": 1.0, "fallback": 0.0}


HAND_OFF_REFUSED = {
    "chat n=2": ("/v1/chat/completions", chat(LONG, max_tokens=3, n=2)),
    "two prompts": ("/v1/completions", {"model": "stub-model", "prompt": [LONG, LONG],
                                        "max_tokens": 3}),
    "prompt_logprobs": ("/v1/chat/completions", chat(LONG, max_tokens=3, prompt_logprobs=0)),
    "echo with logprobs": ("/v1/completions", {"model": "stub-model", "prompt": LONG,
                                               "max_tokens": 1, "echo": True, "logprobs": 1}),
}


@pytest.mark.parametrize("kind", list(HAND_OFF_REFUSED))
async def test_a_request_no_prefill_can_hand_off_is_local_without_asking_one(kind: str
                                                                              ) -> None:
    """n > 1 or several prompts: a prefill hands off one sequence (sluice's worker answers
    such a prefill 400 `n` / `prompt`), so the router plans them local at once instead of
    sending each one to a prefill worker first for a refusal. Prompt logprobs: the
    prefill worker would compute them and the decode worker answer without them."""
    store = KVStore()
    p, d = PDStub("p", store, role="prefill"), PDStub("d", store, role="decode")
    path, body = HAND_OFF_REFUSED[kind]
    async with pd_cluster([p, d], PDConfig(mode="always")) as (url, state), \
            httpx.AsyncClient(timeout=10) as c:
        r = await c.post(url + path, json=body)
        assert r.status_code == 200, r.text
        assert not p.prefills and len(d.locals) == 1 and not d.decodes
        assert pd_counts(state) == {"disaggregated": 0.0, "local": 1.0, "fallback": 0.0}
    no_errors(p, d)


async def test_an_adapter_request_goes_only_to_the_workers_holding_its_adapter() -> None:
    """LoRA placement on the P/D path as on the plain one: an adapter's request is
    prefilled and decoded only where the adapter is (a prefill worker without it: the
    decode worker holding it prefills), and a registered adapter is loaded on a decode
    worker, which can serve the request whole. `PD.forward` ignored the holders: the
    prefill went to a prefill worker without the adapter (its 404 sent the request
    local) and the local or decode step to any decode worker, which answered 404."""
    store = KVStore()
    p = PDStub("p", store, role="prefill")
    d1, d2 = PDStub("d1", store, role="decode"), PDStub("d2", store, role="decode")
    d2.adapters["sql"] = "/adapters/sql"  # --lora-modules on d2 only
    async with pd_cluster([p, d1, d2], PDConfig(mode="always"), policy="round_robin",
                          adapters=(AdapterSpec("chat", "/adapters/chat"),)) as (url, state), \
            httpx.AsyncClient(timeout=10) as c:
        assert state.adapters.holders("sql") == [d2.url]
        for i in range(4):
            r = await c.post(url + "/v1/chat/completions",
                             json=chat(f"{i} {LONG}", model="sql", max_tokens=3))
            assert r.status_code == 200 and r.json()["worker"] == "d2", r.text
        assert not p.prefills and len(d2.locals) == 4 and not d1.locals + d1.decodes
        p.adapters["sql"] = "/adapters/sql"  # now on the prefill worker too
        await state.adapters.sync_all()
        for i in range(4):
            r = await c.post(url + "/v1/chat/completions",
                             json=chat(f"{i} {LONG}", model="sql", max_tokens=3))
            assert r.status_code == 200 and r.json()["worker"] == "d2", r.text
        assert len(p.prefills) == 4 and len(d2.decodes) == 4 and not d1.locals + d1.decodes
        r = await c.post(url + "/v1/chat/completions", json=chat(LONG, model="chat"))
        assert r.status_code == 200, r.text
        assert "chat" not in p.adapters and set(state.adapters.holders("chat")) == {
            d.url for d in (d1, d2) if "chat" in d.adapters} != set()
        assert r.json()["worker"] in [d.name for d in (d1, d2) if "chat" in d.adapters]
    no_errors(p, d1, d2)


async def test_roles_come_from_the_workers_and_a_stale_epoch_is_re_routed() -> None:
    """Roles read from GET /v1/pd_role; requests carry the epoch; a worker that switched
    behind the router's back answers 409 stale_pd_epoch and the request is served
    elsewhere, then the router knows the new role."""
    store = KVStore()
    p = PDStub("p", store, role="prefill", pd_api=True, epoch=3)
    d1 = PDStub("d1", store, role="decode", pd_api=True)
    d2 = PDStub("d2", store, role="decode", pd_api=True)
    async with pd_cluster([p, d1, d2], PDConfig(mode="always"), roles=False) as (url, state), \
            httpx.AsyncClient(timeout=10) as c:
        pool = state.pools[0]
        assert state.pd.roles.count(pool) == {"prefill": 1, "decode": 2, "both": 0}
        r = await c.post(url + "/v1/chat/completions", json=chat(LONG))
        assert r.status_code == 200 and p.epochs_seen == ["3"]
        d1.epoch = d2.epoch = 7  # both re-epoched behind the router's back, still decode
        for i in range(2):
            r = await c.post(url + "/v1/chat/completions", json=chat(LONG + f" {i}"))
            assert r.status_code == 200, r.text
        assert d1.stale + d2.stale >= 1  # refused once, read again, served with epoch 7
        assert all(state.pd.roles.roles[s.url].epoch == 7 for s in (d1, d2) if s.stale)
        assert [e for s in (d1, d2) for e in s.epochs_seen] .count("7") == 2
        d2.role, d2.epoch = "prefill", 8  # now one switched sides: re-routed to d1
        d1.decodes.clear()
        r = await c.post(url + "/v1/chat/completions", json=chat("next " + LONG))
        assert r.status_code == 200 and len(d1.decodes) == 1
        assert state.pd.roles.roles[d2.url].role == "prefill" or d2.stale == 0
    no_errors(p, d1, d2)


async def test_a_role_switch_under_load_loses_nothing_and_fences_stale_epochs() -> None:
    """Streams run on both decode workers while one of them becomes a prefill worker:
    every request succeeds; afterwards the pool is 2:1 and a switch with the old epoch
    is refused (409)."""
    store = KVStore()
    p = PDStub("p", store, role="prefill", pd_api=True)
    d1 = PDStub("d1", store, role="decode", pd_api=True, token_delay_s=0.01, num_tokens=8)
    d2 = PDStub("d2", store, role="decode", pd_api=True, token_delay_s=0.01, num_tokens=8)
    async with pd_cluster([p, d1, d2], PDConfig(mode="always"), roles=False) as (url, state), \
            httpx.AsyncClient(timeout=30) as c:
        pool = state.pools[0]
        stop = asyncio.Event()
        statuses: list[int] = []

        async def client(i: int) -> None:
            n = 0
            while not stop.is_set():
                body = chat(f"{LONG} {i} {n}", max_tokens=8, stream=True)
                async with c.stream("POST", url + "/v1/chat/completions", json=body) as r:
                    text = (await r.aread()).decode()
                statuses.append(r.status_code if text.rstrip().endswith("[DONE]") else -1)
                n += 1

        tasks = [asyncio.create_task(client(i)) for i in range(6)]
        while len(d2.decodes) < 3:
            await asyncio.sleep(0.01)
        target = pool.endpoints[d2.url]
        for _ in range(500):  # switch while the router has streams in flight there
            if target.inflight > 0:
                break
            await asyncio.sleep(0.002)
        assert target.inflight > 0
        old_epoch = state.pd.roles.get(target).epoch
        switched = await state.pd.roles.switch(target, "prefill", drain_timeout_s=10)
        assert switched.role == "prefill" and switched.epoch == old_epoch + 1
        before = len(p.prefills) + len(d2.prefills)
        while len(p.prefills) + len(d2.prefills) < before + 6:
            await asyncio.sleep(0.01)
        stop.set()
        await asyncio.gather(*tasks)
        assert statuses and set(statuses) == {200}
        assert state.pd.roles.count(pool) == {"prefill": 2, "decode": 1, "both": 0}
        assert d2.prefills  # it serves as a prefill worker now
        state.pd.roles.get(target).epoch = old_epoch  # a decision made on the old epoch
        with pytest.raises(ConflictError):
            await state.pd.roles.switch(target, "decode", drain_timeout_s=1)
        assert d2.role == "prefill" and state.pd.roles.get(target).epoch == old_epoch + 1
    no_errors(p, d1, d2)


def test_config_and_flags_declare_disaggregated_pools() -> None:
    import argparse

    from sluice.router import cli

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    cli.register(sub)
    args = parser.parse_args(["router", "--prefill-worker", "http://p:1", "--decode-worker",
                              "http://d:1", "--pd-min-uncached-tokens", "512"])
    pool = config_from_args(args).pools[0]
    assert pool.pd == PDConfig(min_uncached_tokens=512)
    assert [(w.url, w.role) for w in pool.workers] == [("http://p:1", "prefill"),
                                                       ("http://d:1", "decode")]
    args = parser.parse_args(["router", "--worker", "http://w:1"])
    assert config_from_args(args).pools[0].pd is None
    args = parser.parse_args(["router", "--worker", "http://w:1", "--pd-mode", "always"])
    assert config_from_args(args).pools[0].pd == PDConfig(mode="always")
    pool = pool_from_dict({"workers": [{"url": "http://p:1", "role": "prefill"}],
                           "pd": {"mode": "never"}})
    assert pool.pd == PDConfig(mode="never") and pool.workers[0].role == "prefill"
    with pytest.raises(InvalidRequestError) as exc:
        WorkerSpec("http://x:1", role="prefiller")
    assert exc.value.param == "role"
    with pytest.raises(InvalidRequestError) as exc:
        pool_from_dict({"pd": {"mode": "sometimes"}})
    assert exc.value.param == "pd_mode"


def test_the_pd_ratio_planner_moves_a_worker_to_the_side_over_its_target() -> None:
    cfg = PDRatioConfig(target_prefill_wait_s=1.0, target_decode_running=8, delay_s=5)
    planner = PDRatioPlanner(cfg)
    # prefill: 4,000 tokens x 1 ms queued on 1 worker = 4 s (4x target); decode: 3 workers
    # with 12 running, 4 each (0.5), 6 each with one fewer (0.75): move one to prefill
    s = PDSignals("p", prefill_workers=1, decode_workers=3, prefill_queued_tokens=4000,
                  prefill_seconds_per_token=1e-3, decode_running=12)
    assert planner.decide(s, 0.0).to_role is None  # wanted, held for the delay
    assert planner.decide(s, 4.9).to_role is None
    move = planner.decide(s, 5.0)
    assert move.to_role == "prefill" and move.prefill_utilisation == pytest.approx(4.0)
    assert planner.decide(s, 5.5).to_role is None  # the delay starts again
    # decode over target but the prefill side cannot spare its only worker
    busy = PDSignals("p", prefill_workers=1, decode_workers=1, decode_running=40)
    assert PDRatioPlanner(cfg).want(busy)[0] is None
    # decode over target, two prefill workers idle: one moves to decode
    s = PDSignals("p", prefill_workers=2, decode_workers=2, decode_running=40)
    assert PDRatioPlanner(PDRatioConfig(delay_s=0)).decide(s, 0.0).to_role == "decode"
    # both within target: nothing
    calm = PDSignals("p", prefill_workers=1, decode_workers=1, decode_running=2)
    assert PDRatioPlanner(PDRatioConfig(delay_s=0)).decide(calm, 0.0).to_role is None


async def test_the_controller_switches_a_decode_worker_when_prefill_queues() -> None:
    """The planner hook end to end: per-side signals from the router, a move, a live
    role switch through POST /v1/pd_role with the epoch read."""
    store = KVStore()
    p = PDStub("p", store, role="prefill", pd_api=True)
    d1 = PDStub("d1", store, role="decode", pd_api=True)
    d2 = PDStub("d2", store, role="decode", pd_api=True)
    async with pd_cluster([p, d1, d2], PDConfig(), roles=False) as (_, state):
        pool = state.pools[0]
        pd = PDController("p", state, pool, PDRatioPlanner(PDRatioConfig(delay_s=0)),
                          prefill_share=1 / 3)
        signals = pd_signals("p", pool, state.pd.roles)
        assert (signals.prefill_workers, signals.decode_workers) == (1, 2)
        pool.endpoints[p.url].prefill_tokens = 1e6  # a long prefill queue
        move = pd.step()
        assert move.to_role == "prefill" and pd.switching is not None
        await pd.switching
        assert state.pd.roles.count(pool)["prefill"] == 2
        assert sorted(s.role for s in (d1, d2)) == ["decode", "prefill"]
        assert pd.describe()["roles"] == {"prefill": 2, "decode": 1, "both": 0}
        # new workers keep the new ratio (2:1): the 4th a prefill worker, the 5th decode
        assert pd.prefill_share == pytest.approx(2 / 3)
        assert [pd.next_role(), pd.next_role()] == ["prefill", "decode"]


@pytest.mark.parametrize("argv, message", [
    (["--workers", "3", "--pd", "1:3"], "needs 4 workers"),
    (["--workers", "2", "--pd", "0:2"], "P, D >= 1"),
    (["--workers", "2", "--pd", "one:one"], "P:D"),
])
def test_serve_pd_flags(argv: list[str], message: str,
                        capsys: pytest.CaptureFixture[str]) -> None:
    from sluice.cli import build_parser, main
    from sluice.serve import pd_ratio, uses_router

    args = build_parser(["serve"]).parse_args(["serve", "--workers", "4", "--pd", "1:3"])
    assert pd_ratio(args) == (1, 3) and uses_router(args)
    assert main(["serve", "--no-gateway", *argv]) == 2
    assert message in capsys.readouterr().err


async def test_the_status_page_and_the_admin_api_show_each_worker_s_role() -> None:
    """A disaggregated pool's workers carry their P/D role in /status.json (the page shows
    it beside the URL) and GET /admin/workers; a plain pool's say null."""
    store = KVStore()
    p, d = PDStub("p", store, role="prefill"), PDStub("d", store, role="decode")
    async with pd_cluster([p, d], PDConfig(), admin_key="k") as (url, state), \
            httpx.AsyncClient(timeout=10) as c:
        status = (await c.get(url + "/status.json")).json()
        admin = (await c.get(url + "/admin/workers", headers={"authorization": "Bearer k"})
                 ).json()
    assert {w["url"]: w["role"] for w in status["workers"]} == {p.url: "prefill",
                                                                 d.url: "decode"}
    assert {w["url"]: w["role"] for w in admin["pools"][0]["workers"]} == {
        p.url: "prefill", d.url: "decode"}
    plain = RouterState(RouterConfig(pools=(PoolConfig(model="m", workers=(
        WorkerSpec("http://127.0.0.1:9"),)),)), random.Random(0))
    pool = plain.pools[0]
    assert plain.pd_role(pool, pool.endpoints["http://127.0.0.1:9"]) is None
    await plain.close()


def test_the_prefill_request_asks_for_one_token_in_each_api() -> None:
    """vLLM's prefill body: one token (`max_tokens`, or a Responses request's
    `max_output_tokens`), no stream, the decode side's params asked for."""
    from sluice.router.parse import RESPONSES
    from sluice.router.pd import PREFILL_REQUEST_PARAMS, prefill_body

    chat = prefill_body({"messages": [], "max_completion_tokens": 50, "stream": True,
                         "stream_options": {"include_usage": True}})
    assert (chat["max_tokens"], chat["max_completion_tokens"], chat["stream"]) == (1, 1, False)
    assert "stream_options" not in chat
    assert chat["kv_transfer_params"] == PREFILL_REQUEST_PARAMS
    responses = prefill_body({"input": "hi", "max_output_tokens": 50, "stream": True},
                             RESPONSES)
    assert (responses["max_output_tokens"], responses["stream"]) == (1, False)
    assert "max_tokens" not in responses  # (a 400 on the Responses API)
