"""Blue/green swaps of `sluice serve --workers 2` under streaming load, real processes.

`sluice serve` (gateway + router + controller in one process, local-backend workers on
the tiny model) serves 3 clients streaming chat and completions (benchmarks/migration.py's
client, each request with its own x-request-id) while the pool is swapped to a second
tiny model (another seed: other greedy answers), then to a model that does not load.
No client request fails; the first swap ends `done` and every later answer is the new
model's; the second rolls back with the workers untouched; after the server stopped,
the usage ledger holds exactly one ok row per request, with the tokens the client got.
"""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest

from benchmark_module import load_benchmark
from e2e.test_serve import serve
from tiny_models import make_tiny_checkpoint

ADMIN = {"authorization": "Bearer swap-admin"}
TINY = ["--max-model-len", "512", "--num-kv-blocks", "256", "--dtype", "float32"]


@pytest.fixture(scope="module")
def tiny_llama_v2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama-v2"), "llama", seed=1)


class Clients:
    """`n` clients streaming one request after another until `finish`."""

    def __init__(self, bench: ModuleType, url: str, key: str, model: str, n: int = 3) -> None:
        self.bench, self.url, self.key = bench, url, key
        self.load = bench.Workload(model, seconds=0, kill_every_s=0, max_tokens=24)
        self.streams: list[Any] = []
        self.stop = asyncio.Event()
        self.tasks = [asyncio.create_task(self._run(i)) for i in range(n)]

    async def _run(self, seed: int) -> None:
        rng = random.Random(seed)
        headers = {"authorization": f"Bearer {self.key}"}
        endpoints = self.bench.ENDPOINTS
        async with httpx.AsyncClient(timeout=120, headers=headers) as c:
            while not self.stop.is_set():
                endpoint = endpoints[(seed + len(self.streams)) % len(endpoints)]
                body = self.bench.request_body(rng, self.load, endpoint)
                stream = self.bench.Stream(f"swap-c{seed}-{len(self.streams)}", endpoint,
                                           time.monotonic())
                self.streams.append(stream)
                await self.bench.one_stream(c, self.url, stream, body)

    async def finish(self) -> list[Any]:
        self.stop.set()
        await asyncio.gather(*self.tasks)
        return self.streams


async def answer(c: httpx.AsyncClient, url: str, key: str, model: str) -> str:
    resp = await c.post(url + "/v1/completions", headers={"authorization": f"Bearer {key}"},
                        json={"model": model, "prompt": "Once upon a time", "max_tokens": 8,
                              "temperature": 0, "ignore_eos": True})
    assert resp.status_code == 200, resp.text
    return str(resp.json()["choices"][0]["text"])


async def settled(c: httpx.AsyncClient, url: str, timeout_s: float = 150) -> dict[str, Any]:
    """GET the pool's model view until its swap is done or failed."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        view: dict[str, Any] = (await c.get(url, headers=ADMIN)).json()
        if view["swap"]["state"] in ("done", "failed"):
            return view
        await asyncio.sleep(0.2)
    raise AssertionError(f"the swap did not settle in {timeout_s}s: {view}")


async def test_swaps_under_load_fail_no_request_and_keep_one_ledger_row_each(
        tiny_llama_dir: Path, tiny_llama_v2: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    bench = load_benchmark("migration", monkeypatch)
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text("not a config")
    args = ["--workers", "2", "--model", str(tiny_llama_dir), "--admin-key", "swap-admin",
            "--log-level", "warning", *TINY]
    with serve(args, tmp_path, 150) as (url, key, log):
        async with httpx.AsyncClient(timeout=60) as c:
            name = (await c.get(url + "/v1/models", headers={
                "authorization": f"Bearer {key}"})).json()["data"][0]["id"]
            pool = f"{url}/admin/pools/{name}/model"
            first_view = (await c.get(pool, headers=ADMIN)).json()
            old_answer = await answer(c, url, key, name)
            clients = Clients(bench, url, key, name)
            await asyncio.sleep(1.0)
            started = await c.post(pool, headers=ADMIN, json={"model": str(tiny_llama_v2)})
            again = await c.post(pool, headers=ADMIN, json={"model": str(tiny_llama_v2)})
            swapped = await settled(c, pool)
            during = len(clients.streams)
            new_answers = [await answer(c, url, key, name) for _ in range(3)]
            failing = await c.post(pool, headers=ADMIN, json={"model": str(broken)})
            rolled_back = await settled(c, pool)
            await asyncio.sleep(0.5)
            streams = await clients.finish()
    # the server has stopped: the gateway's shutdown wrote every settlement
    assert started.status_code == 202 and again.status_code == 409, (started.text, again.text)
    assert first_view["revision"] == 1 and first_view["model"]["model"] == str(tiny_llama_dir)
    assert swapped["swap"]["state"] == "done", swapped
    assert swapped["revision"] == 2 and swapped["model"]["model"] == str(tiny_llama_v2)
    assert [w["revision"] for w in swapped["workers"]] == [2, 2]
    assert set(swapped["swap"]["old"]) == {w["url"] for w in first_view["workers"]}
    assert new_answers == [new_answers[0]] * 3 and new_answers[0] != old_answer
    assert failing.status_code == 202
    assert rolled_back["swap"]["state"] == "failed" and rolled_back["revision"] == 2
    assert "failed to start" in rolled_back["swap"]["error"], rolled_back
    assert rolled_back["workers"] == swapped["workers"]
    assert any("swap_moved" in line for line in log) and any("swap_failed" in line
                                                             for line in log)
    failed = [(s.request_id, s.failure) for s in streams if s.failure is not None]
    # load during the swap: 3 clients' requests started before it settled (10 on a slow
    # 2-core host, 20+ on a faster one), more after it, and none failed
    assert during >= 6 and len(streams) > during and not failed, (during, failed)
    rows = bench.ledger_rows(f"sqlite:///{tmp_path / 'sluice.db'}", "swap-")
    ledger = bench.check_ledger(streams, rows)
    assert ledger["usage_records"] == len(streams), ledger
    problems = ("lost", "duplicated", "token_mismatches", "prompt_mismatches", "rows_not_ok",
                "rows_without_request")
    assert {k: ledger[k] for k in problems} == dict.fromkeys(problems, 0), ledger["examples"]
