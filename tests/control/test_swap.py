"""Blue/green model swap over real HTTP: router (its own server) + stub workers.

Under continuous streaming load a swap fails no request, the old workers get nothing
new once traffic moved and none of their streams is cut, every later request reaches
the new model, and the controller's later starts use it. A new model that fails to
start or does not serve the pool's name rolls back with the old workers untouched. The
API answers 202 / 409 / 400 (the field named) / 401 / 403 / 404.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from control.stub_backend import StubBackend
from control.test_controller import ADMIN, MODEL, one_pool, stack, stream, wait_for
from router.router_stubs import serve_router
from sluice.control.backend import ModelSpec
from sluice.control.controller import Controller, attach
from sluice.control.local import LocalBackend
from sluice.control.planner import Planner, PlannerConfig
from sluice.router.app import build_app
from sluice.router.config import PoolConfig, RouterConfig
from sluice.router.state import RouterState
from sluice.worker.cli import register as register_worker

FIXED = PlannerConfig(min_replicas=2, max_replicas=2)
SWAP = f"/admin/pools/{MODEL}/model"


class Load:
    """Clients streaming back to back; each result is (start time, status, text)."""

    def __init__(self, url: str, clients: int = 6) -> None:
        self.results: list[tuple[float, int, str]] = []
        self.stop = asyncio.Event()
        self.tasks = [asyncio.create_task(self._client(url)) for _ in range(clients)]

    async def _client(self, url: str) -> None:
        async with httpx.AsyncClient(timeout=30) as client:
            while not self.stop.is_set():
                started = time.monotonic()
                self.results.append((started, *await stream(client, url)))

    async def finish(self) -> list[tuple[float, int, str]]:
        self.stop.set()
        await asyncio.gather(*self.tasks)
        return self.results


def whole(result: tuple[float, int, str]) -> bool:
    return result[1] == 200 and result[2].endswith("data: [DONE]\n\n")


async def test_a_swap_under_streaming_load_fails_nothing_and_moves_every_request() -> None:
    backend = StubBackend(start_delay_s=0.3, token_delay_s=0.02, num_tokens=15)
    async with stack(backend, FIXED, initial=2) as (url, (ctl,)):
        old = dict(backend.workers)
        load = Load(url)
        await wait_for(lambda: all(len(w.state.requests) >= 3 for w in old.values()))
        async with httpx.AsyncClient(timeout=10, headers=ADMIN) as admin:
            started = await admin.post(url + SWAP, json={"model": "v2"})
            again = await admin.post(url + SWAP, json={"model": "v3"})
            await wait_for(lambda: ctl.swap is not None and ctl.swap.state == "draining")
            served = {w.state.name: len(w.state.requests) for w in old.values()}
            await wait_for(lambda: ctl.swap is not None and not ctl.swap.running)
            done_at = time.monotonic()
            swap = ctl.swap
            assert swap is not None and swap.finished_at is not None
            assert any(swap.started_at < d.at < swap.finished_at for d in ctl.planner.decisions)
            await asyncio.sleep(0.5)
            results = await load.finish()
            view = (await admin.get(url + SWAP)).json()
            planner = (await admin.get(url + "/admin/planner")).json()
        await backend.kill("v2-2")  # its replacement loads the new model
        await wait_for(lambda: len(ctl.workers) == 2 and "v2-2" not in backend.workers)
        names = sorted(w.state.name for w in backend.workers.values())
    assert started.status_code == 202, started.text
    assert started.json()["swap"]["state"] == "starting" and started.json()["revision"] == 1
    assert again.status_code == 409 and again.json()["error"]["code"] == "swap_in_progress"
    assert len(results) > 20 and all(whole(r) for r in results), \
        [r for r in results if not whole(r)][:3]
    after = [text for start, _, text in results if start > done_at]
    assert after and all('"v2-' in text for text in after)
    assert not any(f'"{w.state.name}-' in text for text in after for w in old.values())
    for w in old.values():  # drained: nothing new after the move, no stream cut
        assert w.stopped_with_drain is True and w.state.cancelled == 0
        assert w.state.completed == len(w.state.requests) == served[w.state.name]
    assert view["revision"] == 2 and view["model"] == {"model": "v2", "options": {}}
    assert view["swap"]["state"] == "done" and view["swap"]["error"] is None
    assert sorted(view["swap"]["old"]) == sorted(w.handle.url for w in old.values())
    assert [w["revision"] for w in view["workers"]] == [2, 2]
    assert planner["pools"][0]["revision"] == 2
    kinds = [e["event"] for e in ctl.events if e["at"] >= swap.started_at]
    assert kinds[:3] == ["swap_start", "start", "start"] and kinds[3:5] == ["ready", "ready"]
    assert kinds[5] == "swap_moved" and kinds.index("swap_done") > max(
        i for i, k in enumerate(kinds) if k == "stopped")
    assert sorted(kinds[6:kinds.index("swap_done")]) == ["drain", "drain", "stopped", "stopped"]
    assert names == ["v2-3", "v2-4"]


async def test_a_new_model_that_fails_to_start_rolls_back_with_nothing_failed() -> None:
    backend = StubBackend(start_delay_s=0.2, token_delay_s=0.02, num_tokens=10,
                          broken=frozenset({"bad"}))
    async with stack(backend, FIXED, initial=2) as (url, (ctl,)):
        before = dict(ctl.workers)
        load = Load(url, clients=4)
        async with httpx.AsyncClient(timeout=10, headers=ADMIN) as admin:
            assert (await admin.post(url + SWAP, json={"model": "bad"})).status_code == 202
            await wait_for(lambda: ctl.swap is not None and not ctl.swap.running)
            view = (await admin.get(url + SWAP)).json()
        results = await load.finish()
        await backend.kill("s0")  # the pool kept its model: the replacement is an old one
        await wait_for(lambda: len(ctl.workers) == 2 and "s0" not in backend.workers)
        names = sorted(w.state.name for w in backend.workers.values())
    assert results and all(whole(r) for r in results)
    assert view["swap"]["state"] == "failed"
    assert "cannot load bad" in view["swap"]["error"]
    assert view["revision"] == 1 and view["model"] is None
    assert {w["url"] for w in view["workers"]} == set(before)
    assert names == ["s1", "s2"]
    assert [e["event"] for e in ctl.events][-1] == "ready"
    assert "swap_failed" in [e["event"] for e in ctl.events]


async def test_every_swap_attempt_gets_its_own_revision() -> None:
    """A failed swap's revision is not handed out again: the events of the failed attempt
    and of the next one are told apart by their revision (the pool's own revision skips
    the failed number)."""
    backend = StubBackend(broken=frozenset({"bad"}))
    async with stack(backend, FIXED, initial=2) as (url, (ctl,)):
        async with httpx.AsyncClient(timeout=10, headers=ADMIN) as admin:
            for model in ("bad", "v2"):
                assert (await admin.post(url + SWAP, json={"model": model})).status_code == 202
                await wait_for(lambda: ctl.swap is not None and not ctl.swap.running)
            view = (await admin.get(url + SWAP)).json()
    swaps = [(e["event"], e["revision"]) for e in ctl.events if e["event"].startswith("swap")]
    assert swaps == [("swap_start", 2), ("swap_failed", 2),
                     ("swap_start", 3), ("swap_moved", 3), ("swap_done", 3)]
    assert view["revision"] == 3 and view["swap"]["previous_revision"] == 1
    assert [w["revision"] for w in view["workers"]] == [3, 3]


async def test_new_workers_that_do_not_serve_the_pool_are_stopped_unused() -> None:
    backend = StubBackend(model=MODEL)
    async with stack(backend, FIXED, initial=2) as (url, (ctl,)):
        before = set(ctl.workers)
        backend.model = "other-name"  # what the new stubs serve
        async with httpx.AsyncClient(timeout=10, headers=ADMIN) as admin:
            assert (await admin.post(url + SWAP, json={"model": "v2"})).status_code == 202
            await wait_for(lambda: ctl.swap is not None and not ctl.swap.running)
            assert (await stream(admin, url))[0] == 200
        swap = ctl.swap
        assert swap is not None and swap.state == "failed"
        assert "not serving 'stub-model'" in (swap.error or "")
        assert set(ctl.workers) == before == set(ctl.pool.endpoints)
        new = [w for w in backend.gone if w.state.name.startswith("v2-")]
        assert len(new) == 2 and all(not w.state.requests for w in new)
        assert all(w.stopped_with_drain is False for w in new)


@asynccontextmanager
async def bare_router(admin_key: str | None, backend: StubBackend | None
                      ) -> AsyncIterator[str]:
    config = RouterConfig(pools=(PoolConfig(model=MODEL, policy="least_load"),),
                          admin_key=admin_key)
    app = build_app(config, rng=random.Random(0))

    def controllers(state: RouterState) -> list[Controller]:
        return [Controller("stub", state, state.pools[0], backend,
                           Planner(PlannerConfig(min_replicas=1, max_replicas=1), initial=1))]

    attach(app, controllers)
    async with serve_router(app) as url:
        yield url


async def test_the_api_checks_key_body_and_pool() -> None:
    bad: list[tuple[dict[str, Any] | str, str | None]] = [
        ({}, "model"), ({"model": " "}, "model"), ({"model": 3}, "model"),
        ({"model": "m", "max_model_len": "long"}, "max_model_len"),
        ({"model": "m", "dtype": "float8"}, "dtype"),
        ({"model": "m", "tool_call_parser": "nope"}, "tool_call_parser"),
        ({"model": "m", "reasoning_parser": "o1"}, "reasoning_parser"),
        ({"model": "m", "enable_prefix_caching": "maybe"}, "enable_prefix_caching"),
        ({"model": "m", "served_model_name": "x"}, "served_model_name"),
        ({"model": "m", "gpu_memory_utilization": 0.9}, "gpu_memory_utilization"),
        ("not json", None), ("[1]", None), ({"model": "a\u0000b"}, "model")]
    async with bare_router("k", StubBackend()) as url, httpx.AsyncClient(timeout=10) as c:
        assert (await c.get(url + SWAP)).status_code == 401
        wrong = {"authorization": "Bearer nope"}
        assert (await c.post(url + SWAP, json={"model": "v2"}, headers=wrong)).status_code == 401
        for body, param in bad:
            kw: dict[str, Any] = {"content": body} if isinstance(body, str) else {"json": body}
            resp = await c.post(url + SWAP, headers=ADMIN, **kw)
            assert resp.status_code == 400, (body, resp.text)
            assert resp.json()["error"]["param"] == param, (body, resp.text)
        missing = await c.get(url + "/admin/pools/nope/model", headers=ADMIN)
        view = (await c.get(url + SWAP, headers=ADMIN)).json()
        ok = await c.post(url + SWAP, headers=ADMIN,
                          json={"model": "v2", "max_model_len": 512, "dtype": "float32",
                                "enable_prefix_caching": False})
    assert missing.status_code == 404
    assert view["revision"] == 1 and view["swap"] is None and len(view["workers"]) == 1
    assert ok.status_code == 202, ok.text
    assert ok.json()["swap"]["model"]["options"] == {
        "max_model_len": 512, "dtype": "float32", "enable_prefix_caching": False}
    async with bare_router(None, StubBackend()) as url, httpx.AsyncClient(timeout=10) as c:
        assert (await c.post(url + SWAP, headers=ADMIN, json={"model": "v2"})).status_code == 403
    async with bare_router("k", None) as url, httpx.AsyncClient(timeout=10) as c:
        external = await c.post(url + SWAP, headers=ADMIN, json={"model": "v2"})
    assert external.status_code == 400 and external.json()["error"]["param"] == "pool"


async def test_a_model_path_missing_here_is_refused_before_anything_starts(
        tmp_path: Path) -> None:
    """A swap of a local-backend pool to a path that does not exist on this machine was
    accepted (202): the pool's own starts were cancelled and the swap rolled back only
    once a new worker had failed to load it. Now it is a 400 naming `model`, and no swap
    and no worker start."""
    backend = LocalBackend(zygote=False)
    at_zero = Planner(PlannerConfig(min_replicas=0, max_replicas=1, scale_to_zero_after_s=0),
                      initial=0)
    app, made = one_pool(backend, at_zero, admin_key="k")
    missing = [str(tmp_path / "v2.gguf"), str(tmp_path / "v2"), "./no-such-model",
               "~/no-such-model", "no-such-model", "a/b/c"]
    async with serve_router(app) as url, httpx.AsyncClient(timeout=10, headers=ADMIN) as c:
        answers = [await c.post(url + SWAP, json={"model": m}) for m in missing]
        view = (await c.get(url + SWAP)).json()
    for model, resp in zip(missing, answers, strict=True):
        assert resp.status_code == 400, (model, resp.text)
        assert resp.json()["error"] == {
            "message": f"model {model!r} not found: no such file or directory",
            "type": "invalid_request_error", "param": "model", "code": "model_not_found"}
    assert view["swap"] is None and view["revision"] == 1 and not backend.workers
    assert [e["event"] for e in made[0].events] == []


def test_the_local_backend_refuses_exactly_what_the_worker_would_not_find(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`LocalBackend.check_model` refuses the names the worker's `local_model_path`
    refuses without a download (missing local paths), and lets through what it finds or
    would download (a hub id); the check itself downloads nothing (the hub is the edge
    replaced here)."""
    from sluice.engine import tokenizer

    downloads: list[str] = []
    monkeypatch.setattr(tokenizer, "_snapshot_download",
                        lambda repo, revision: downloads.append(repo) or tmp_path)
    (tmp_path / "v2.gguf").write_bytes(b"GGUF")
    (tmp_path / "v3").mkdir()
    monkeypatch.chdir(tmp_path)
    missing = ["org/model.gguf", "/org", "org/a/b", "no-such-model", "./org/name", "~/org",
               str(tmp_path / "v4")]
    names = [str(tmp_path / "v2.gguf"), str(tmp_path / "v3"), "v3", "./v3", "v2.gguf",
             "HuggingFaceTB/SmolLM2-135M-Instruct", *missing]
    backend = LocalBackend(zygote=False)
    refused_here = [n for n in names if refuses(backend.check_model, ModelSpec(n))]
    assert not downloads
    refused_by_worker = [n for n in names if refuses(tokenizer.local_model_path, n)]
    assert refused_here == refused_by_worker == missing
    assert downloads == ["HuggingFaceTB/SmolLM2-135M-Instruct"]


def refuses(check: Any, arg: Any) -> bool:
    """Whether `check(arg)` raises `ModelNotFoundError`."""
    from sluice.engine.tokenizer import ModelNotFoundError

    try:
        check(arg)
    except ModelNotFoundError:
        return True
    return False


def test_a_model_spec_becomes_worker_flags_that_win() -> None:
    spec = ModelSpec("/m/v2", {"max_model_len": 512, "enable_prefix_caching": False,
                               "enable_chunked_prefill": True})
    assert spec.flags() == ["--model", "/m/v2", "--max-model-len", "512",
                            "--no-enable-prefix-caching", "--enable-chunked-prefill"]
    parser = argparse.ArgumentParser()
    register_worker(parser.add_subparsers())
    base = ["worker", "--model", "/m/v1", "--max-model-len", "256", "--served-model-name", "p"]
    args = parser.parse_args([*base, *spec.flags()])
    assert (args.model, args.max_model_len, args.served_model_name) == ("/m/v2", 512, ["p"])
    assert args.enable_prefix_caching is False and args.enable_chunked_prefill is True
