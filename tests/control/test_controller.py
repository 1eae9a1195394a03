"""The control loop over real HTTP: router (its own server) + stub workers from a backend.

Scale-down drains (zero failed streams, none routed to the draining worker after it
was picked), a dead worker is replaced and the router re-admits the new one, a pool at
zero holds requests until a worker is ready (or answers 503 + Retry-After), and the
planner's decisions show on /admin/planner and /metrics.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from control.stub_backend import StubBackend
from router.router_stubs import serve_router
from sluice.control.backend import Backend, WorkerHandle, WorkerHealth
from sluice.control.controller import Controller, ControllerConfig, attach
from sluice.control.planner import Planner, PlannerConfig
from sluice.router.app import build_app
from sluice.router.config import PoolConfig, RouterConfig
from sluice.router.state import RouterState

ADMIN = {"authorization": "Bearer k"}
MODEL = "stub-model"


def one_pool(backend: Backend, planner: Planner, control: ControllerConfig | None = None,
             model: Any = None, **router_kw: Any) -> tuple[Any, list[Controller]]:
    """A router app with one pool run by one controller over `backend`, and the list
    the controller lands in once the app's lifespan has made it."""
    config = RouterConfig(pools=(PoolConfig(model=MODEL, policy="least_load"),), **router_kw)
    app = build_app(config, rng=random.Random(0))
    made: list[Controller] = []

    def controllers(state: RouterState) -> list[Controller]:
        made.append(Controller("stub", state, state.pools[0], backend, planner,
                               control or ControllerConfig(), model=model))
        return made

    attach(app, controllers)
    return app, made


@asynccontextmanager
async def stack(backend: StubBackend, planner: PlannerConfig, initial: int,
                interval_s: float = 0.1, **router_kw: Any
                ) -> AsyncIterator[tuple[str, list[Controller]]]:
    app, made = one_pool(backend, Planner(planner, initial=initial),
                         ControllerConfig(interval_s=interval_s, drain_grace_s=10),
                         admin_key="k", health_interval_s=0.2, scrape_interval_s=0.2,
                         **router_kw)
    async with serve_router(app) as url:
        yield url, made


async def stream(client: httpx.AsyncClient, url: str) -> tuple[int, str]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
        text = (await resp.aread()).decode()
    return resp.status_code, text


async def wait_for(predicate: Any, timeout: float = 10.0) -> None:
    for _ in range(int(timeout / 0.02)):
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not met in time")


async def test_scale_down_under_load_drains_with_zero_failed_requests() -> None:
    backend = StubBackend(token_delay_s=0.02, num_tokens=15)  # 0.3 s streams
    fixed = PlannerConfig(min_replicas=2, max_replicas=2)
    async with stack(backend, fixed, initial=2, interval_s=60) as (url, (ctl,)):
        assert sorted(w.state.name for w in backend.workers.values()) == ["s0", "s1"]
        results: list[tuple[int, str]] = []
        stop = asyncio.Event()

        async def client_loop() -> None:
            async with httpx.AsyncClient(timeout=30) as client:
                while not stop.is_set():
                    results.append(await stream(client, url))

        clients = [asyncio.create_task(client_loop()) for _ in range(6)]
        await wait_for(lambda: all(len(w.state.requests) >= 3 for w in backend.workers.values()))
        ctl.reconcile(1)  # what a planner decision of 1 does
        (victim_url,) = ctl.draining
        victim = next(w for w in backend.workers.values() if w.handle.url == victim_url)
        served_before = len(victim.state.requests)
        assert served_before > 0
        await wait_for(lambda: not ctl.draining)
        drained = len(results)  # the pool goes on serving: a round of streams after it
        await wait_for(lambda: len(results) > max(20, drained + 6))
        stop.set()
        await asyncio.gather(*clients)
    assert len(results) > 20
    assert all(status == 200 and text.endswith("data: [DONE]\n\n") for status, text in results)
    assert victim.stopped_with_drain is True and victim.state.cancelled == 0
    assert victim.state.completed == len(victim.state.requests) == served_before
    assert [e["event"] for e in ctl.events if e["worker"] == victim_url][-2:] == \
        ["drain", "stopped"]


async def test_a_dead_worker_is_replaced_and_readmitted(
        caplog: pytest.LogCaptureFixture) -> None:
    backend = StubBackend(start_delay_s=0.2)
    fixed = PlannerConfig(min_replicas=2, max_replicas=2)
    caplog.set_level(logging.INFO, "sluice.control.controller")
    async with stack(backend, fixed, initial=2) as (url, (ctl,)):
        pool = ctl.pool
        first = set(pool.endpoints)
        await backend.kill("s0")
        await wait_for(lambda: len(ctl.workers) == 2 and set(ctl.workers) != first)
        assert set(pool.endpoints) == set(ctl.workers)
        assert all(e.available for e in pool.endpoints.values())
        assert sorted(w.state.name for w in backend.workers.values()) == ["s1", "s2"]
        assert [e["event"] for e in ctl.events][-3:] == ["dead", "start", "ready"]
        # a lost worker is a WARNING (the status page's recent errors list those), its
        # replacement's start an INFO
        levels = {r.getMessage().split()[2]: r.levelname for r in caplog.records
                  if r.getMessage().startswith("pool ")}
        assert levels["dead"] == "WARNING" and levels["ready"] == "INFO"
        async with httpx.AsyncClient(timeout=10) as client:
            assert [(await stream(client, url))[0] for _ in range(4)] == [200] * 4


async def test_a_pool_whose_workers_all_fail_to_start_fails_the_startup() -> None:
    """A model that does not load: the router listened with no worker, answered 503
    after the buffer timeout and started another doomed worker every second, for good.
    Now the startup fails with the worker's error and nothing is left running; one
    worker of two starting is a pool (the other is replaced later)."""
    from sluice.control.backend import ModelSpec

    backend = StubBackend(start_delay_s=0.05, broken=frozenset({"bad"}))
    fixed = PlannerConfig(min_replicas=2, max_replicas=2)
    app, made = one_pool(backend, Planner(fixed, initial=2), model=ModelSpec("bad"))
    with pytest.raises(RuntimeError, match="startup"):
        async with serve_router(app):
            pass
    (ctl,) = made
    assert ctl.initial_error == \
        "no worker of pool stub started: worker exited with 1: cannot load bad"
    assert not backend.workers and not ctl.starting
    assert [e["event"] for e in ctl.events] == ["start", "start", "start_failed", "start_failed"]


async def test_a_worker_that_cannot_start_is_retried_with_backoff() -> None:
    """The pool's worker dies and its replacement cannot start (its model went bad): the
    controller started another every second (each failure logging a worker's log tail);
    now it waits 0.2 s, 0.4 s, 0.8 s ... between tries, and a start that works again
    ends the backoff."""
    from sluice.control.backend import ModelSpec

    backend = StubBackend(start_delay_s=0.02, broken=frozenset({"bad"}))
    fixed = PlannerConfig(min_replicas=1, max_replicas=1)
    app, made = one_pool(backend, Planner(fixed, initial=1),
                         ControllerConfig(interval_s=0.05, start_backoff_s=0.2,
                                          start_backoff_max_s=0.8), health_interval_s=0.2)
    async with serve_router(app):
        (ctl,) = made
        ctl.model = ModelSpec("bad")
        await backend.kill("s0")
        await asyncio.sleep(2.0)  # 40 steps: tries at ~0, 0.2, 0.6, 1.4 s (then 2.2)
        failed = [e for e in ctl.events if e["event"] == "start_failed"]
        assert 3 <= len(failed) <= 5 and ctl.start_failures == len(failed)
        ctl.model = None  # the model is loadable again: the next try starts it
        await wait_for(lambda: len(ctl.workers) == 1, timeout=3.0)
        assert ctl.start_failures == 0 and ctl.next_start_at == 0.0


async def test_a_hung_worker_is_killed_and_replaced() -> None:
    """A worker stopped with SIGSTOP (or wedged) is alive to its backend but answers no
    /health: it held its place in the pool for good (`sluice serve --workers 2` served
    on one worker, the planner counting two). Failing /health for `liveness_timeout_s`
    kills it and a replacement starts; a shorter outage is forgiven."""
    backend = StubBackend(start_delay_s=0.05)
    fixed = PlannerConfig(min_replicas=2, max_replicas=2)
    app, made = one_pool(backend, Planner(fixed, initial=2),
                         ControllerConfig(interval_s=0.05, liveness_timeout_s=0.6),
                         health_interval_s=0.1)
    async with serve_router(app):
        (ctl,) = made
        blip, hung = backend.workers["s0"], backend.workers["s1"]
        blip.state.healthy = hung.state.healthy = False
        await asyncio.sleep(0.3)
        blip.state.healthy = True  # back within the timeout: kept
        await wait_for(lambda: hung.handle.id not in backend.workers, timeout=3.0)
        assert hung.stopped_with_drain is False  # killed: it serves nothing to drain
        await wait_for(lambda: len(ctl.workers) == 2 and all(
            e.available for e in ctl.pool.endpoints.values()), timeout=3.0)
        assert blip.handle.url in ctl.workers and hung.handle.url not in ctl.pool.endpoints
        assert [e["event"] for e in ctl.events][-3:] == ["unresponsive", "start", "ready"]


class SickOnStart(StubBackend):
    """While `sick`, its workers answer /health 200 to the backend, then fail the
    router's probe."""

    sick = True

    async def start(self, model: Any = None) -> WorkerHandle:
        handle = await super().start(model)
        self.workers[handle.id].state.healthy = not self.sick
        return handle


@pytest.mark.parametrize("fault", ["another model", "unhealthy"])
async def test_a_started_worker_takes_requests_only_once_its_probe_passed(fault: str) -> None:
    """A replacement that lists none of the models the pool's other workers serve, or
    whose /health fails the router's probe, was routable all the same (`join` probed it
    and ignored the answer; a failed probe ejects only at the third). Now, as POST
    /admin/workers gates a worker, it is stopped without a request and counts as a failed
    start (backoff); the next start that passes its probe takes requests."""
    backend = SickOnStart()
    backend.sick = False
    fixed = PlannerConfig(min_replicas=2, max_replicas=2)
    app, made = one_pool(backend, Planner(fixed, initial=2),
                         ControllerConfig(interval_s=0.05, start_backoff_s=0.5),
                         health_interval_s=60)
    async with serve_router(app) as url:
        (ctl,) = made
        if fault == "another model":
            backend.model = "other-name"
        else:
            backend.sick = True
        await backend.kill("s0")
        await wait_for(lambda: ctl.start_failures == 1, timeout=5.0)
        (refused,) = backend.gone
        assert refused.handle.url not in ctl.pool.endpoints
        assert list(ctl.workers) == [backend.workers["s1"].handle.url]
        assert refused.stopped_with_drain is False and not refused.state.requests
        assert [e["event"] for e in ctl.events][-4:] == ["dead", "start", "refused", "stopped"]
        backend.model, backend.sick = MODEL, False  # the next worker passes its probe
        await wait_for(lambda: len(ctl.workers) == 2, timeout=5.0)
        async with httpx.AsyncClient(timeout=10) as client:
            assert [(await stream(client, url))[0] for _ in range(4)] == [200] * 4
    assert ctl.start_failures == 0 and not refused.state.requests


async def test_scale_to_zero_then_a_buffered_request_wakes_the_pool() -> None:
    backend = StubBackend(start_delay_s=0.3)
    cfg = PlannerConfig(min_replicas=0, max_replicas=1, scale_to_zero_after_s=0.3)
    async with stack(backend, cfg, initial=1, buffer_timeout_s=10) as (url, (ctl,)):
        await wait_for(lambda: not backend.workers and not ctl.pool.endpoints)
        assert ctl.planner.desired == 0
        async with httpx.AsyncClient(timeout=20) as client:
            status, text = await stream(client, url)  # held until the new worker is ready
            assert status == 200 and text.endswith("data: [DONE]\n\n")
            assert any(d.signals.queued == 1 and d.desired == 1 for d in ctl.planner.decisions)
            planner = (await client.get(url + "/admin/planner", headers=ADMIN)).json()
            assert (await client.get(url + "/admin/planner")).status_code == 401
            metrics = (await client.get(url + "/metrics")).text
    (view,) = planner["pools"]
    assert view["backend"] == "stub" and view["config"]["scale_to_zero_after_s"] == 0.3
    reasons = [d["reason"] for d in view["decisions"] if d["changed"]]
    assert any(r.startswith("idle for") for r in reasons)
    assert any("activation from zero" in r for r in reasons)
    assert 'sluice:desired_replicas{pool="stub"} 1.0' in metrics
    assert 'sluice:planner_ready_replicas{pool="stub"}' in metrics


async def test_a_full_or_timed_out_buffer_answers_503_with_retry_after() -> None:
    backend = StubBackend(start_delay_s=30)  # never ready within the test
    cfg = PlannerConfig(min_replicas=0, max_replicas=1, scale_to_zero_after_s=0)
    async with stack(backend, cfg, initial=0, buffer_timeout_s=0.4,
                     buffer_max_requests=1) as (url, _):
        async with httpx.AsyncClient(timeout=10) as client:
            held, full = await asyncio.gather(stream(client, url), _later(stream(client, url)))
    assert held[0] == 503 and "no worker became ready within 0.4s" in held[1]
    assert full[0] == 503 and "already waiting" in full[1]


async def _later(coro: Any) -> Any:
    await asyncio.sleep(0.1)
    return await coro


@pytest.mark.parametrize("timeout", [0.0])
async def test_without_buffering_a_pool_at_zero_answers_503_at_once(timeout: float) -> None:
    backend = StubBackend(start_delay_s=30)
    cfg = PlannerConfig(min_replicas=0, max_replicas=1, scale_to_zero_after_s=0)
    async with stack(backend, cfg, initial=0, buffer_timeout_s=timeout) as (url, _):
        async with httpx.AsyncClient(timeout=10) as client:
            resp = await client.post(url + "/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "x"}]})
    assert resp.status_code == 503 and "retry-after" in resp.headers


async def test_a_worker_drained_while_supervision_runs_is_not_reported_dead() -> None:
    """supervise() walks a snapshot of the workers and awaits each one's health: a drain
    that ends meanwhile (the worker stopped and forgotten) must not be reported dead."""
    class SlowHealth(StubBackend):
        async def health(self, worker: WorkerHandle) -> WorkerHealth:
            await asyncio.sleep(0.2)
            return await super().health(worker)

    backend = SlowHealth()
    planner = PlannerConfig(min_replicas=1, max_replicas=3, scale_down_delay_s=0)
    async with stack(backend, planner, initial=3) as (_, [controller]):
        await wait_for(lambda: sum(e["event"] == "stopped" for e in controller.events) == 2, 20)
        steps = len(controller.planner.decisions)
        await wait_for(lambda: len(controller.planner.decisions) >= steps + 3, 15)
    assert [e["event"] for e in controller.events if e["event"] in ("stopped", "dead")] \
        == ["stopped", "stopped"]


class FailingPlanner(Planner):
    """A planner with a bug: every other decision raises (as `PoolSignals.grown` did on a
    NaN look-ahead)."""

    calls = 0

    def decide(self, signals: Any, now: float) -> Any:
        self.calls += 1
        if self.calls % 2:
            raise ValueError("cannot convert float NaN to integer")
        return super().decide(signals, now)


async def test_a_failing_step_is_logged_and_the_loop_goes_on_supervising(
        caplog: pytest.LogCaptureFixture) -> None:
    """An unexpected error in a step is logged with its traceback, and the loop lives:
    the next steps still take a dead worker out and start its replacement."""
    backend = StubBackend()
    fixed = PlannerConfig(min_replicas=1, max_replicas=1)
    app, made = one_pool(backend, FailingPlanner(fixed, initial=1),
                         ControllerConfig(interval_s=0.05), admin_key="k",
                         health_interval_s=0.2, scrape_interval_s=0.2)
    with caplog.at_level("ERROR", logger="sluice.control.controller"):
        async with serve_router(app):
            (ctl,) = made
            await wait_for(lambda: len(caplog.records) >= 2)  # two steps failed, not one
            await backend.kill("s0")
            await wait_for(lambda: list(ctl.workers) == [backend.workers["s1"].handle.url])
    failed = [r for r in caplog.records if "control step for pool stub failed" in r.message]
    assert len(failed) >= 2 and all(r.exc_info and r.exc_info[0] is ValueError for r in failed)
    assert [e["event"] for e in ctl.events][-3:] == ["dead", "start", "ready"]
