"""The gateway in front of a real sluice worker (tiny random Llama, SmolLM2 tokenizer):
prompt tokens counted at admission equal the engine's own count, the injected priority
is accepted by the worker, usage from JSON and SSE (OpenAI and Anthropic) lands in the
ledger."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sluice.gateway.middleware import GatewayMiddleware
from sluice.gateway.store import SQLStore, UsageQuery
from sluice.gateway.tokens import PromptTokenCounter

from .conftest import client_for, make_state, new_key


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> Iterator[Any]:
    from sluice.engine.async_engine import AsyncEngine
    from sluice.engine.config import EngineConfig

    eng = AsyncEngine(EngineConfig.from_options(
        str(tiny_llama_dir), num_kv_blocks=256, block_size=16, max_model_len=512,
        max_num_seqs=8, max_num_batched_tokens=256))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def counter(tiny_llama_dir: Path) -> PromptTokenCounter:
    return PromptTokenCounter(default_source=str(tiny_llama_dir))


async def test_gateway_over_real_worker(engine: Any, counter: PromptTokenCounter,
                                        sqlite_store: SQLStore) -> None:
    from sluice.worker.app import build_app
    from sluice.worker.config import WorkerConfig

    worker = build_app(engine, WorkerConfig(served_model_names=("tiny",)))
    key = new_key(sqlite_store, tpm=10_000, rpm=100, priority_class="batch")
    gw = GatewayMiddleware(worker, make_state(sqlite_store, count=counter))
    chat = {"model": "tiny", "max_tokens": 6, "temperature": 0,
            "messages": [{"role": "user", "content": "Count to three, please."}]}
    async with client_for(gw, key) as c:
        r = await c.post("/v1/chat/completions", json=chat)
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert usage["prompt_tokens"] == counter("tiny", chat)  # admission count is exact
        assert r.headers["x-ratelimit-remaining-tokens"] == str(
            10_000 - usage["prompt_tokens"] - 6)  # reserved prompt + max_tokens
        r = await c.post("/v1/chat/completions", json={**chat, "priority": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "priority"

        r = await c.post("/v1/chat/completions", json={**chat, "stream": True})
        events = [e for e in r.text.split("\n\n") if e]
        assert events[-1] == "data: [DONE]"
        chunks = [json.loads(e[6:]) for e in events[:-1]]
        assert all(ch["choices"] for ch in chunks)  # gateway's usage chunk stripped

        r = await c.post("/v1/completions", json={"model": "tiny", "prompt": "Hello world",
                                                  "max_tokens": 4, "stream": True,
                                                  "stream_options": {"include_usage": True}})
        last = json.loads([e for e in r.text.split("\n\n") if e][-2][6:])
        assert last["usage"]["prompt_tokens"] == counter("tiny", {"prompt": "Hello world"})

        r = await c.post("/v1/messages", json={"model": "tiny", "max_tokens": 5,
                                               "messages": [{"role": "user", "content": "Hi"}]},
                         headers={"x-api-key": key, "Authorization": ""})
        assert r.status_code == 200, r.text
        anthropic_usage = r.json()["usage"]
    records = sqlite_store.query_usage(UsageQuery())
    assert [(x.endpoint, x.status) for x in records] == [
        ("/v1/chat/completions", "ok"), ("/v1/chat/completions", "rejected"),
        ("/v1/chat/completions", "ok"), ("/v1/completions", "ok"), ("/v1/messages", "ok")]
    assert (records[0].prompt_tokens, records[0].completion_tokens) == (
        usage["prompt_tokens"], usage["completion_tokens"])
    assert records[2].prompt_tokens == usage["prompt_tokens"]
    assert records[2].completion_tokens == 6
    assert (records[4].prompt_tokens, records[4].completion_tokens) == (
        anthropic_usage["input_tokens"], anthropic_usage["output_tokens"])
