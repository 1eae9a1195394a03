"""The router's ASGI app: the worker's OpenAI endpoints, fronting a pool of workers.

    POST /v1/chat/completions, /v1/completions, /v1/messages   routed and streamed
    GET  /v1/models                                            union of the pools
    POST /tokenize, /detokenize                                passed to a worker
    GET  /health, /metrics                                     the router's own
    /admin/...                                                 see admin.py

Each routed request: parse (model, prompt, session) -> pool for the model (404) ->
request metadata (tokens, block hashes) -> `Proxy.forward` (choose, retry, stream).
All state is created in the lifespan (`RouterState`); errors leave as OpenAI JSON.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from sluice.protocol.errors import SluiceError
from sluice.router.admin import admin_router
from sluice.router.config import RouterConfig
from sluice.router.parse import CHAT, COMPLETION, MESSAGES, load_json_object, parse_request
from sluice.router.proxy import forward_headers
from sluice.router.state import RouterState, make_client
from sluice.router.tokens import LocalTokenizer, load_local_tokenizer

log = logging.getLogger(__name__)

ROUTED = {"/v1/chat/completions": CHAT, "/v1/completions": COMPLETION, "/v1/messages": MESSAGES}


def error_response(_request: Request, exc: Exception) -> Response:
    assert isinstance(exc, SluiceError)
    return JSONResponse(exc.to_dict(), status_code=exc.status_code, headers=exc.headers)


def load_tokenizers(config: RouterConfig) -> dict[str, LocalTokenizer]:
    names = {p.tokenizer for p in config.pools if p.tokenizer}
    return {name: load_local_tokenizer(name) for name in sorted(names)}


def build_app(config: RouterConfig, *, transport: httpx.AsyncBaseTransport | None = None,
              local_tokenizers: Mapping[str, LocalTokenizer] | None = None,
              rng: random.Random | None = None) -> FastAPI:
    """The router app. Local tokenizers named by pools are loaded here (blocking) unless
    given; the HTTP client, pools, probes and KV subscribers start in the lifespan."""
    tokenizers = dict(local_tokenizers) if local_tokenizers is not None else load_tokenizers(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state = RouterState(config, make_client(config, transport),
                            rng or random.Random(config.seed), tokenizers)
        app.state.router = state
        for pool in state.pools:
            for endpoint in pool.endpoints.values():
                state.start_subscriber(pool, endpoint)
        await asyncio.gather(state.monitor.probe_all(), state.monitor.scrape_all())
        tasks = [asyncio.create_task(state.monitor.run(config.health_interval_s,
                                                       state.monitor.probe_all)),
                 asyncio.create_task(state.monitor.run(config.scrape_interval_s,
                                                       state.monitor.scrape_all))]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await state.close()

    app = FastAPI(title="sluice router", lifespan=lifespan)
    app.add_exception_handler(SluiceError, error_response)
    app.add_middleware(RoutedFastPath)  # the OpenAI endpoints, ahead of FastAPI's layers
    app.add_route("/tokenize", _passthrough("/tokenize"), methods=["POST"])
    app.add_route("/detokenize", _passthrough("/detokenize"), methods=["POST"])
    app.add_route("/v1/models", models, methods=["GET"])
    app.add_route("/health", health, methods=["GET"])
    app.add_route("/metrics", metrics, methods=["GET"])
    app.include_router(admin_router())
    return app


class RoutedFastPath:
    """Pure-ASGI middleware: POSTs to the routed OpenAI paths go straight to the proxy.

    The hot path thereby skips FastAPI's exception, exit-stack and routing layers (each
    an extra coroutine wrapping send/receive per request); errors still leave as OpenAI
    JSON. Everything else (models, metrics, admin, lifespan) continues into FastAPI.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.routes = {path: _routed(kind, path) for path, kind in ROUTED.items()}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        handler = self.routes.get(scope.get("path", "")) if scope["type"] == "http" else None
        if handler is None or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive)
        try:
            response = await handler(request)
        except SluiceError as exc:
            response = error_response(request, exc)
        await response(scope, receive, send)


def _routed(kind: str, path: str) -> Callable[[Request], Awaitable[Response]]:
    async def route(request: Request) -> Response:
        state: RouterState = request.app.state.router
        req = parse_request(kind, await request.body(), request.headers)
        pool = state.resolve(req.model)
        meta = await state.request_meta(pool, req)
        return await unless_disconnected(
            request, state.proxy.forward(pool, req, meta, path, request.headers))

    route.__name__ = f"route_{kind}"
    return route


async def unless_disconnected(request: Request, work: Awaitable[Response]) -> Response:
    """Await `work` (up to the first body byte), cancelling it if the client hangs up first.

    Starlette only watches for disconnects once a streaming response has started; before
    that (queueing, prefill, a whole non-streamed generation) the router watches itself,
    so the worker sees the hang-up and aborts the request.
    """
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(request.receive())
    await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    if not task.done() and watch.result().get("type") == "http.disconnect":
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return Response(status_code=499)
    watch.cancel()
    return await task


def _passthrough(path: str) -> Callable[[Request], Awaitable[Response]]:
    async def passthrough(request: Request) -> Response:
        state: RouterState = request.app.state.router
        raw = await request.body()
        model = load_json_object(raw).get("model")
        _, endpoint = state.any_worker(model if isinstance(model, str) else None)
        resp = await state.client.post(endpoint.url + path, content=raw,
                                       headers=forward_headers(request.headers))
        return Response(resp.content, status_code=resp.status_code,
                        media_type=resp.headers.get("content-type"))

    passthrough.__name__ = f"passthrough_{path.strip('/')}"
    return passthrough


async def models(request: Request) -> Response:
    state: RouterState = request.app.state.router
    now = int(time.time())
    ids = dict.fromkeys(name for pool in state.pools for name in pool.names())
    return JSONResponse({"object": "list", "data": [
        {"id": name, "object": "model", "created": now, "owned_by": "sluice"} for name in ids]})


async def health(request: Request) -> Response:
    state: RouterState = request.app.state.router
    endpoints = [e for pool in state.pools for e in pool.endpoints.values()]
    healthy = sum(e.available for e in endpoints)
    ok = healthy > 0 or not endpoints
    return JSONResponse({"status": "ok" if ok else "no healthy worker",
                         "healthy_workers": healthy, "workers": len(endpoints)},
                        status_code=200 if ok else 503)


async def metrics(request: Request) -> Response:
    state: RouterState = request.app.state.router
    return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")
