"""Scale-down under load on the real default model: zero failed requests.

Two `sluice worker`s on SmolLM2-135M (LocalBackend) behind the router; four clients
stream completions without pause; the controller is told to go to one worker (what a
planner decision of 1 does). The worker with the least in flight is drained: the
router stops routing to it, its streams finish, then it is stopped (SIGTERM). Every
request must succeed and end with `[DONE]`.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import httpx
import pytest

from router.router_stubs import serve_router
from sluice.control.controller import Controller, ControllerConfig, attach
from sluice.control.local import LocalBackend
from sluice.control.planner import Planner, PlannerConfig
from sluice.router.app import build_app
from sluice.router.config import PoolConfig, RouterConfig

MODEL = "smol"


async def client_loop(url: str, results: list[tuple[int, str]], stop: asyncio.Event) -> None:
    body = {"model": MODEL, "prompt": "Rivers of Europe:", "max_tokens": 24, "stream": True,
            "temperature": 0}
    async with httpx.AsyncClient(timeout=120) as client:
        while not stop.is_set():
            try:
                async with client.stream("POST", url + "/v1/completions", json=body) as resp:
                    text = (await resp.aread()).decode()
                results.append((resp.status_code, text))
            except httpx.HTTPError as exc:
                results.append((0, repr(exc)))


@pytest.mark.model
async def test_scale_down_under_load_loses_no_request(default_gguf: Path) -> None:
    backend = LocalBackend(["--model", str(default_gguf), "--max-model-len", "512",
                            "--num-kv-blocks", "128"], kv_events=False, startup_timeout_s=240)
    app = build_app(RouterConfig(pools=(PoolConfig(model=MODEL, policy="least_load"),)),
                    rng=random.Random(0))
    made: list[Controller] = []

    def controllers(state):  # type: ignore[no-untyped-def]
        made.append(Controller("smol", state, state.pools[0], backend,
                               Planner(PlannerConfig(min_replicas=1, max_replicas=2), initial=2),
                               ControllerConfig(interval_s=3600, drain_grace_s=60)))
        return made

    attach(app, controllers)
    results: list[tuple[int, str]] = []
    stop = asyncio.Event()
    async with serve_router(app) as url:
        (ctl,) = made
        clients = [asyncio.create_task(client_loop(url, results, stop)) for _ in range(4)]
        endpoints = list(ctl.pool.endpoints.values())
        for _ in range(1200):  # both workers busy
            if all(e.inflight > 0 for e in endpoints):
                break
            await asyncio.sleep(0.05)
        ctl.reconcile(1)
        (victim,) = ctl.draining
        drained_inflight = ctl.pool.endpoints[victim].inflight
        for _ in range(1200):
            if not ctl.draining:
                break
            await asyncio.sleep(0.05)
        done_at_drain = len(results)
        while len(results) < done_at_drain + 4:  # the last worker keeps serving
            await asyncio.sleep(0.05)
        stop.set()
        await asyncio.gather(*clients)
    assert drained_inflight > 0, "the drained worker had streams in flight"
    stopped = [e for e in ctl.events if e["event"] == "stopped"]
    assert [e["worker"] for e in stopped] == [victim] and stopped[0]["unfinished"] == 0
    failed = [r for r in results if r[0] != 200 or not r[1].rstrip().endswith("data: [DONE]")]
    assert not failed, failed[:3]
    assert len(results) >= 8
