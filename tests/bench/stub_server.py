"""A stub OpenAI server with known, injected timings, for testing the benchmark's clock.

It streams exactly `max_tokens` tokens: the first after `ttft` seconds, the others
`itl` seconds apart, then a usage chunk and `[DONE]`; `/tokenize` uses a real
`tokenizers` file; `/metrics` exposes vLLM's prefix-cache counters (with a toy prefix
cache over 4-token blocks, so shared prefixes really count as hits) and preemptions.
It runs under uvicorn on a free 127.0.0.1 port in a thread (real sleeps, real sockets).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from tokenizers import Tokenizer

from sluice.control.local import free_port

BLOCK = 4


@dataclass
class StubConfig:
    tokenizer_path: str
    ttft: float = 0.08
    itl: float = 0.02
    model: str = "stub-model"
    fail_every: int = 0  # every k-th request answers 503 (0: never)
    slow_every: int = 0  # every k-th request waits `slow_ttft` for its first token (0: never)
    slow_ttft: float = 0.3
    expose_metrics: bool = True
    total_suffix: bool = True  # `_total` on counter names, as prometheus_client writes them
    old_tokenize: bool = False  # /tokenize rejects add_special_tokens and always adds <s>
    api_key: str | None = None  # /v1/models answers 401 without `Authorization: Bearer KEY`
    status_workers: tuple[str, ...] = ()  # /status.json lists these, as a sluice router's does


@dataclass
class StubState:
    requests: int = 0
    queries: int = 0
    hits: int = 0
    preemptions: int = 0
    in_flight: int = 0
    max_in_flight: int = 0
    seen_blocks: set[tuple[int, ...]] = field(default_factory=set)
    bodies: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    # X-Request-Id -> perf_counter() at arrival, at each token chunk sent, at the end
    timings: dict[str, dict[str, Any]] = field(default_factory=dict)


def build_stub_app(cfg: StubConfig) -> tuple[FastAPI, StubState]:
    app = FastAPI()
    state = StubState()
    tok = Tokenizer.from_file(cfg.tokenizer_path)

    def encode(text: str) -> list[int]:
        return list(tok.encode(text, add_special_tokens=False).ids)

    def account(ids: list[int]) -> None:
        """Toy prefix cache: hits are the leading full blocks seen before."""
        state.queries += len(ids)
        hit = True
        for end in range(BLOCK, len(ids) + 1, BLOCK):
            key = tuple(ids[:end])
            if hit and key in state.seen_blocks:
                state.hits += BLOCK
            else:
                hit = False
            state.seen_blocks.add(key)

    async def stream(chat: bool, n: int, prompt_tokens: int, ttft: float, times: dict[str, Any]) -> AsyncIterator[str]:
        state.in_flight += 1
        state.max_in_flight = max(state.max_in_flight, state.in_flight)
        try:
            async for piece in _pieces(chat, n, prompt_tokens, ttft):
                if '" tok"' in piece:
                    times["chunks"].append(time.perf_counter())
                yield piece
        finally:
            state.in_flight -= 1
            times["done"] = time.perf_counter()

    async def _pieces(chat: bool, n: int, prompt_tokens: int, ttft: float) -> AsyncIterator[str]:
        obj = "chat.completion.chunk" if chat else "text_completion"
        if chat:
            yield "data: " + json.dumps({"object": obj, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}) + "\n\n"
        await asyncio.sleep(ttft)
        for i in range(n):
            if i:
                await asyncio.sleep(cfg.itl)
            piece = {"index": 0, "delta": {"content": " tok"}} if chat else {"index": 0, "text": " tok"}
            yield "data: " + json.dumps({"object": obj, "choices": [piece]}) + "\n\n"
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}
        yield "data: " + json.dumps({"object": obj, "choices": [], "usage": usage}) + "\n\n"
        yield "data: [DONE]\n\n"

    async def complete(request: Request, chat: bool) -> Any:
        times: dict[str, Any] = {"recv": time.perf_counter(), "chunks": []}
        state.timings[request.headers.get("x-request-id", str(state.requests))] = times
        body = await request.json()
        state.requests += 1
        state.bodies.append(body)
        state.headers.append(dict(request.headers))
        if cfg.fail_every and state.requests % cfg.fail_every == 0:
            return JSONResponse({"error": {"message": "busy", "type": "service_unavailable"}}, status_code=503)
        if chat:
            ids = encode("".join(" " + m["content"] for m in body["messages"]))
        else:
            p = body["prompt"]
            ids = list(p) if isinstance(p, list) else encode(p)
        account(ids)
        slow = cfg.slow_every and state.requests % cfg.slow_every == 0
        ttft = cfg.slow_ttft if slow else cfg.ttft
        return StreamingResponse(
            stream(chat, int(body["max_tokens"]), len(ids), ttft, times), media_type="text/event-stream"
        )

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await complete(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        return await complete(request, chat=True)

    @app.get("/v1/models")
    async def models(request: Request) -> Any:
        if cfg.api_key and request.headers.get("authorization") != f"Bearer {cfg.api_key}":
            return JSONResponse({"error": {"message": "missing API key", "type": "authentication_error",
                                           "code": "invalid_api_key"}}, status_code=401)
        return {"object": "list", "data": [{"id": cfg.model, "object": "model"}]}

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        body = await request.json()
        if cfg.old_tokenize and "add_special_tokens" in body:
            return JSONResponse({"error": {"message": "extra field", "param": "add_special_tokens"}}, status_code=400)
        ids = ([1] if cfg.old_tokenize else []) + encode(body["prompt"])
        return {"tokens": ids, "count": len(ids), "max_model_len": 4096}

    @app.get("/status.json")
    async def status() -> Any:
        if not cfg.status_workers:
            return PlainTextResponse("not found", status_code=404)
        return {"workers": [{"url": url, "healthy": True} for url in cfg.status_workers]}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        if not cfg.expose_metrics:
            return PlainTextResponse("not found", status_code=404)
        sfx = "_total" if cfg.total_suffix else ""
        text = (
            f"# TYPE vllm:prefix_cache_queries{sfx} counter\n"
            f'vllm:prefix_cache_queries{sfx}{{model_name="{cfg.model}"}} {float(state.queries)}\n'
            f'vllm:prefix_cache_hits{sfx}{{model_name="{cfg.model}"}} {float(state.hits)}\n'
            f'vllm:num_preemptions{sfx}{{model_name="{cfg.model}"}} {float(state.preemptions)}\n'
            f'vllm:num_requests_running{{model_name="{cfg.model}"}} 0.0\n'
        )
        return PlainTextResponse(text)

    return app, state


@contextmanager
def running_stub(cfg: StubConfig) -> Iterator[tuple[str, StubState]]:
    """Serve the stub on a free port in a thread; yields (base_url, state); stops on exit."""
    app, state = build_stub_app(cfg)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}", state
    finally:
        server.should_exit = True
        thread.join(timeout=5)
