"""In-process stub workers that speak the worker contract, and two runners: uvicorn (any
ASGI app) and `RouterServer` (a router app, as `sluice router` serves it).

A stub serves /health, /v1/models, /metrics (vLLM gauge names), /tokenize (one token
per whitespace-separated word, stable ids), and /v1/chat/completions, /v1/completions
(streamed or not) with injected time to first token, per-token delay and failures,
optionally held behind a gate (an asyncio.Event) until the test opens it. It records
every request and notices client disconnects. With a `KVEventPublisher` it
publishes `BlockStored` for each prompt it serves, as a real engine would.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from sluice.control.local import free_port
from sluice.protocol.block_hash import hash_blocks
from sluice.protocol.kv_events import BlockStored
from sluice.router.server import RouterServer


def word_ids(text: str) -> list[int]:
    return [int.from_bytes(hashlib.blake2b(w.encode(), digest_size=4).digest(), "big") % 49152
            for w in text.split()]


def chat_text(messages: list[dict[str, Any]]) -> str:
    return " ".join(f"<{m['role']}> {m['content']}" for m in messages) + " <assistant>"


def prompt_ids(body: dict[str, Any]) -> list[int]:
    if "messages" in body:
        return word_ids(chat_text(body["messages"]))
    return word_ids(str(body.get("prompt", "")))


@dataclass
class StubState:
    name: str
    model: str = "stub-model"
    ttft_s: float = 0.0
    token_delay_s: float = 0.0
    num_tokens: int = 3
    fail_status: int | None = None  # answer every generation request with this status
    healthy: bool = True
    publisher: Any = None  # KVEventPublisher
    block_size: int = 16
    has_tokenize: bool = True
    tokenize_delay_s: float = 0.0  # /tokenize answers after this long (a hung worker's)
    tokenize_calls: int = 0
    tokenized_models: list[Any] = field(default_factory=list)  # `model` of each /tokenize
    requests: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    gate: asyncio.Event | None = None  # generation requests wait for it (held in flight)
    running: int = 0
    cancelled: int = 0
    completed: int = 0
    cancel_event: asyncio.Event = field(default_factory=asyncio.Event)
    prefix_queries: int = 0  # served as vllm:prefix_cache_queries/hits (counters)
    prefix_hits: int = 0


def _chunk(state: StubState, i: int, chat: bool) -> bytes:
    piece = f"{state.name}-{i} "
    choice: dict[str, Any] = ({"index": 0, "delta": {"content": piece}, "finish_reason": None}
                              if chat else {"index": 0, "text": piece, "finish_reason": None})
    return f"data: {json.dumps({'id': 'x', 'model': state.model, 'choices': [choice]})}\n\n".encode()


async def _tokens(state: StubState, chat: bool) -> AsyncIterator[bytes]:
    state.running += 1
    try:
        for i in range(state.num_tokens):
            await asyncio.sleep(state.token_delay_s if i else state.ttft_s)
            yield _chunk(state, i, chat)
        yield b"data: [DONE]\n\n"
        state.completed += 1
    except asyncio.CancelledError:
        state.cancelled += 1
        state.cancel_event.set()
        raise
    finally:
        state.running -= 1


def make_stub(state: StubState) -> Starlette:
    async def generate(request: Request) -> Response:
        body = await request.json()
        state.requests.append(body)
        state.headers.append(dict(request.headers))
        if state.gate is not None:
            await state.gate.wait()
        if state.fail_status is not None:
            return JSONResponse({"error": {"message": "injected"}}, status_code=state.fail_status)
        if state.publisher is not None:
            hashes = hash_blocks(prompt_ids(body), state.block_size)
            state.publisher.publish([BlockStored(hashes, None, [], state.block_size)])
        chat = request.url.path.endswith("chat/completions")
        if body.get("stream"):  # headers at once, first token after ttft_s (like an engine)
            return StreamingResponse(_tokens(state, chat), media_type="text/event-stream")
        await asyncio.sleep(state.ttft_s)
        state.completed += 1
        text = " ".join(f"{state.name}-{i}" for i in range(state.num_tokens))
        msg = {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
        return JSONResponse({"id": "x", "model": body.get("model"), "worker": state.name,
                             "choices": [{"index": 0, "finish_reason": "stop", **msg}]})

    async def health(_: Request) -> Response:
        return PlainTextResponse("ok" if state.healthy else "down",
                                 status_code=200 if state.healthy else 503)

    async def models(_: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": state.model, "object": "model"}]})

    async def metrics(_: Request) -> Response:
        return PlainTextResponse(
            f'vllm:num_requests_running{{model_name="{state.model}"}} {state.running}\n'
            f'vllm:num_requests_waiting{{model_name="{state.model}"}} 0\n'
            f'vllm:kv_cache_usage_perc{{model_name="{state.model}"}} 0.1\n'
            f'vllm:prefix_cache_queries_total{{model_name="{state.model}"}} '
            f'{state.prefix_queries}\n'
            f'vllm:prefix_cache_hits_total{{model_name="{state.model}"}} {state.prefix_hits}\n')

    async def tokenize(request: Request) -> Response:
        state.tokenize_calls += 1
        if state.tokenize_delay_s:
            await asyncio.sleep(state.tokenize_delay_s)
        if not state.has_tokenize:
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        body = await request.json()
        state.tokenized_models.append(body.get("model"))
        ids = prompt_ids(body)
        return JSONResponse({"count": len(ids), "max_model_len": 4096, "tokens": ids,
                             "worker": state.name})

    return Starlette(routes=[
        Route("/v1/chat/completions", generate, methods=["POST"]),
        Route("/v1/completions", generate, methods=["POST"]),
        Route("/v1/messages", generate, methods=["POST"]),
        Route("/health", health), Route("/v1/models", models), Route("/metrics", metrics),
        Route("/tokenize", tokenize, methods=["POST"]),
    ])


@asynccontextmanager
async def serve(app: Any) -> AsyncIterator[str]:
    """Run `app` under uvicorn on a free 127.0.0.1 port in this event loop; yields its URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="on"))
    task = asyncio.create_task(server.serve())
    for _ in range(500):
        if server.started or task.done():
            break
        await asyncio.sleep(0.01)
    if not server.started:
        task.cancel()
        raise RuntimeError("server did not start")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)


@asynccontextmanager
async def serve_router(app: Any) -> AsyncIterator[str]:
    """Run a router app on `RouterServer` (as `sluice router` does) on a free 127.0.0.1
    port in this event loop; yields its URL."""
    async with RouterServer(app, "127.0.0.1", 0, shutdown_timeout_s=5) as server:
        yield server.url
