"""The router in front of two real `sluice worker` processes on the tiny model.

The workers are started once for the module by `LocalWorkerPool`, with KV events on.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from router_stubs import serve

from sluice.control.local import LocalWorkerPool
from sluice.protocol.block_hash import hash_blocks
from sluice.router.app import build_app
from sluice.router.config import PoolConfig, RouterConfig, WorkerSpec
from sluice.router.scrape import parse_load
from sluice.router.tokens import load_local_tokenizer


@pytest.fixture(scope="module")
def workers(tiny_llama_dir: Path) -> Iterator[LocalWorkerPool]:
    args = ["--model", str(tiny_llama_dir), "--max-model-len", "1024", "--num-kv-blocks", "512"]
    with LocalWorkerPool(2, args, kv_events=True, startup_timeout_s=150) as pool:
        yield pool


def router_config(pool: LocalWorkerPool, policy: str = "cost",
                  tokenizer: str | None = None) -> RouterConfig:
    """Predicted index entries expire after 1 ms, so the precise index shows the events."""
    specs = tuple(WorkerSpec(u, kv_events=k)
                  for u, k in zip(pool.urls, pool.kv_endpoints, strict=True))
    return RouterConfig(pools=(PoolConfig(workers=specs, policy=policy, tokenizer=tokenizer),),
                        seed=0,
                        scrape_interval_s=0.2, health_interval_s=0.5, predicted_block_ttl_s=0.001)


def prefix_hits(metrics_text: str) -> float:
    return parse_load(metrics_text).prefix_hits


def test_local_tokenizer_matches_worker_tokenize(workers: LocalWorkerPool,
                                                 tiny_llama_dir: Path) -> None:
    tok = load_local_tokenizer(str(tiny_llama_dir))
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"}]
    local = tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True),
                       add_special_tokens=False)
    model = httpx.get(workers.urls[0] + "/v1/models").json()["data"][0]["id"]
    remote = httpx.post(workers.urls[0] + "/tokenize", json={"model": model, "messages": msgs})
    assert remote.json()["tokens"] == local


async def test_routes_streams_and_keeps_a_shared_prefix_on_one_worker(
        workers: LocalWorkerPool, tiny_llama_dir: Path) -> None:
    app = build_app(router_config(workers, tokenizer=str(tiny_llama_dir)), rng=random.Random(0))
    async with serve(app) as router, httpx.AsyncClient(base_url=router, timeout=60) as c:
        model = (await c.get("/v1/models")).json()["data"][0]["id"]
        system = "You are a helpful assistant for the sluice project. " * 12  # > 100 tokens
        before = {u: prefix_hits(httpx.get(u + "/metrics").text) for u in workers.urls}
        for i in range(4):
            body: dict[str, Any] = {"model": model, "max_tokens": 4, "stream": True,
                                    "messages": [{"role": "system", "content": system},
                                                 {"role": "user", "content": f"question {i}"}]}
            async with c.stream("POST", "/v1/chat/completions", json=body) as s:
                assert s.status_code == 200
                lines = [ln async for ln in s.aiter_lines() if ln.startswith("data:")]
            assert lines[-1] == "data: [DONE]"
        decisions = [ln for ln in (await c.get("/metrics")).text.splitlines()
                     if ln.startswith("sluice_router_decisions_total")]
        counts = {ln.split('worker="')[1].split('"')[0]: float(ln.split()[-1]) for ln in decisions}
        assert sorted(counts.values()) in ([4.0], [0.0, 4.0])  # every turn on one worker
        home = max(counts, key=lambda u: counts[u])
        after = prefix_hits(httpx.get(home + "/metrics").text)
        assert after - before[home] >= 3 * 96  # turns 2-4 reused >= 6 blocks each

        # the engine's KV events reached the router and confirm the router's own hashes
        tok_body = {"model": model, "messages": [{"role": "system", "content": system},
                                                 {"role": "user", "content": "question 3"}]}
        ids = (await c.post("/tokenize", json=tok_body)).json()["tokens"]
        hashes = hash_blocks(ids, 16)
        (pool,) = app.state.router.pools
        other = next(u for u in workers.urls if u != home)
        for _ in range(100):  # predictions live 1 ms here: only the engine's events remain
            held = pool.precise.match(hashes, [home, other])
            if held[home] == len(hashes):
                break
            await asyncio.sleep(0.05)
        assert held == {home: len(hashes), other: 0} and len(hashes) >= 7


def generated(urls: list[str]) -> tuple[float, float]:
    """(running requests, generated tokens so far) summed over the workers."""
    text = [httpx.get(u + "/metrics").text for u in urls]
    tokens = sum(v for t in text for ln in t.splitlines() if ln.startswith(
        "vllm:generation_tokens_total") for v in [float(ln.split()[-1])])
    return sum(parse_load(t).running for t in text), tokens


async def test_client_disconnect_aborts_the_request_in_the_engine(
        workers: LocalWorkerPool) -> None:
    app = build_app(router_config(workers, policy="least_load"), rng=random.Random(0))
    async with serve(app) as router, httpx.AsyncClient(base_url=router, timeout=60) as c:
        model = (await c.get("/v1/models")).json()["data"][0]["id"]
        _, tokens_before = generated(workers.urls)
        body = {"model": model, "max_tokens": 1000, "stream": True, "ignore_eos": True,
                "messages": [{"role": "user", "content": "count forever"}]}
        async with c.stream("POST", "/v1/chat/completions", json=body) as s:
            async for line in s.aiter_lines():
                if line.startswith("data:"):
                    break
        for _ in range(200):
            running, tokens_after = generated(workers.urls)
            if running == 0:
                break
            await asyncio.sleep(0.05)
        assert running == 0
        assert tokens_after - tokens_before < 1000  # aborted, not run to max_tokens
        assert sum(e.inflight for e in app.state.router.pools[0].endpoints.values()) == 0


async def test_an_adapter_through_the_router_equals_the_workers_direct_answer(
        tiny_llama_dir: Path, tmp_path: Path) -> None:
    """A real worker (`--enable-lora --max-loras 2`), an adapter made with peft and
    registered with the router only: the router loads it on demand, and its greedy answer
    through the router is the worker's own for the same request."""
    from lora_adapters import make_adapter
    from sluice.router.config import AdapterSpec

    path = make_adapter(tiny_llama_dir, tmp_path / "sql", r=8, seed=11)
    args = ["--model", str(tiny_llama_dir), "--max-model-len", "512", "--num-kv-blocks", "128",
            "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16"]
    with LocalWorkerPool(1, args, startup_timeout_s=150) as pool:
        config = RouterConfig(pools=(PoolConfig(workers=(WorkerSpec(pool.urls[0]),)),),
                              adapters=(AdapterSpec("sql", str(path)),), seed=0)
        body = {"model": "sql", "prompt": "select the rows where", "max_tokens": 8,
                "temperature": 0}
        app = build_app(config, rng=random.Random(0))
        async with serve(app) as router, httpx.AsyncClient(timeout=60) as c:
            routed = (await c.post(router + "/v1/completions", json=body)).json()
            direct = (await c.post(pool.urls[0] + "/v1/completions", json=body)).json()
            assert app.state.router.adapters.counts.loads == {"demand": 1}
        assert routed["model"] == "sql" and direct["model"] == "sql"
        assert routed["choices"][0]["text"] == direct["choices"][0]["text"]
