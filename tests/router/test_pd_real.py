"""The router's disaggregated pool in front of real `sluice worker` processes (tiny model):
prefill worker -> KV hand-off -> decode worker gives a single worker's greedy text,
streamed or not, chat, completions and the Responses API, with prefix hits on either
side."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from router_stubs import serve

from sluice.control.local import LocalWorkerPool
from sluice.observe.prometheus import sum_samples
from sluice.router.app import build_app
from sluice.router.config import PDConfig, PoolConfig, RouterConfig, WorkerSpec

# float32: a prefix hit computes exactly what a cold prefill does (docs/pd.md)
ARGS = ["--dtype", "float32", "--max-model-len", "1024", "--num-kv-blocks", "256"]
TEXTS = ["hi", "Tell me a story about a lighthouse keeper and the sea",
         "Rivers carry sediment down to their deltas, where it settles. " * 4,
         "Compilers translate source code into machine code in several passes. " * 6]


@pytest.fixture(scope="module")
def workers(tiny_llama_dir: Path) -> Iterator[dict[str, str]]:
    """prefill, decode, and a reference worker (both) with the same flags."""
    pools = {role: LocalWorkerPool(1, ["--model", str(tiny_llama_dir), *ARGS, "--role", role],
                                   startup_timeout_s=150)
             for role in ("prefill", "decode", "both")}
    try:
        for pool in pools.values():
            pool.start()
        yield {role: pool.urls[0] for role, pool in pools.items()}
    finally:
        for pool in pools.values():
            pool.stop()


def text_of(resp: httpx.Response, stream: bool) -> str:
    if resp.request.url.path == "/v1/responses":  # OpenAI's Responses API
        if not stream:
            return "".join(part["text"] for item in resp.json()["output"]
                           for part in item.get("content") or [])
        events = [json.loads(line[6:]) for line in resp.text.splitlines()
                  if line.startswith("data: {")]
        return "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    if not stream:
        choice = resp.json()["choices"][0]
        return str(choice["message"]["content"] if "message" in choice else choice["text"])
    out = []
    for line in resp.text.splitlines():
        if line.startswith("data: {"):
            choice = json.loads(line[6:])["choices"]
            if choice:
                out.append(choice[0].get("text") or choice[0].get("delta", {}).get("content")
                           or "")
    return "".join(out)


async def test_disaggregated_greedy_output_is_one_workers(workers: dict[str, str]) -> None:
    specs = (WorkerSpec(workers["prefill"], role="prefill"),
             WorkerSpec(workers["decode"], role="decode"))
    config = RouterConfig(pools=(PoolConfig(workers=specs, pd=PDConfig(mode="always")),),
                          seed=0, health_interval_s=5, scrape_interval_s=5)
    async with serve(build_app(config, rng=random.Random(0))) as router, \
            httpx.AsyncClient(timeout=120) as c:
        model = (await c.get(workers["both"] + "/v1/models")).json()["data"][0]["id"]
        cases: list[tuple[str, dict[str, Any]]] = []
        for i, text in enumerate(TEXTS + TEXTS[2:]):  # the repeats hit both sides' caches
            stream = i % 2 == 1
            cases.append(("/v1/completions", {"model": model, "prompt": text, "max_tokens": 10,
                                              "temperature": 0, "stream": stream}))
        cases.append(("/v1/chat/completions", {
            "model": model, "messages": [{"role": "user", "content": TEXTS[3]}],
            "max_completion_tokens": 8, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}))
        for stream in (False, True):  # the Responses API too, handed off the same way
            cases.append(("/v1/responses", {"model": model, "input": TEXTS[1 + stream],
                                            "max_output_tokens": 8, "temperature": 0,
                                            "stream": stream}))
        for path, body in cases:
            want = await c.post(workers["both"] + path, json=body)
            got = await c.post(router + path, json=body)
            assert got.status_code == want.status_code == 200, got.text
            assert text_of(got, body["stream"]) == text_of(want, body["stream"]), body
        metrics = (await c.get(router + "/metrics")).text
        assert f'sluice_router_pd_requests_total{{path="disaggregated"}} {len(cases)}.0' in metrics
        decode = sum_samples((await c.get(workers["decode"] + "/metrics")).text)
        assert decode["sluice:kv_transfer_bytes_total"] > 0  # the KV came over the wire
