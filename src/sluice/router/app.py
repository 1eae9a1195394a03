"""The router's ASGI app: the worker's OpenAI endpoints, fronting a pool of workers.

    POST /v1/chat/completions, /v1/completions, /v1/messages,
         /v1/responses                                         routed and streamed
    GET  /v1/models                                            union of the pools
    POST /tokenize, /detokenize, /v1/messages/count_tokens     passed to a worker
    POST /v1/responses/input_tokens                            (the same)
    GET  /health, /metrics, /version                           the router's own
    GET  /status, /status.json                                 live status page (status.py)
    /admin/...                                                 see admin.py
    /admin/pools/{pool}/release                                see release_admin.py

Each routed request: parse (model, prompt, session) -> pool for the model (404) ->
request metadata (tokens, block hashes) -> `Proxy.forward` (choose, retry, stream).
All state is created in the lifespan (`RouterState`); errors leave as OpenAI JSON.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from sluice import __version__
from sluice.observe.buckets import LatencyBuckets
from sluice.observe.tracing import Tracing
from sluice.protocol import responses
from sluice.protocol.edge import (
    HOP_BY_HOP_STR,
    BodyLimit,
    error_json,
    http_status_error,
    load_json_object,
    on_disconnect,
    read_body,
    send_error,
)
from sluice.protocol.errors import NotFoundError, SluiceError
from sluice.protocol.prompt import READ_REQUEST, TokenCache
from sluice.router.adapter_admin import adapter_router
from sluice.router.admin import admin_router
from sluice.router.config import DnsTarget, RouterConfig
from sluice.router.discovery import DnsDiscovery
from sluice.router.proxy import Relay
from sluice.router.release_admin import release_router
from sluice.router.routed import ROUTED, ErrorReply, route
from sluice.router.state import RouterState
from sluice.router.status import open_board, status_json, status_page
from sluice.router.tokens import LocalTokenizer, load_local_tokenizer
from sluice.router.upstream import UpstreamError

log = logging.getLogger(__name__)

def error_response(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, SluiceError)
    return Response(error_json(exc, request.url.path), status_code=exc.status_code,
                    headers=exc.headers, media_type="application/json")


def http_error_response(request: Request, exc: Exception) -> Response:
    """FastAPI's own 404 / 405 in the API's error shape (not `{"detail": ...}`)."""
    assert isinstance(exc, StarletteHTTPException)
    return error_response(request, http_status_error(exc.status_code, str(exc.detail),
                                                     request.method, request.url.path))


def load_tokenizers(config: RouterConfig) -> dict[str, LocalTokenizer]:
    names = {p.tokenizer for p in config.pools if p.tokenizer}
    return {name: load_local_tokenizer(name) for name in sorted(names)}


def build_app(config: RouterConfig, *, transport: httpx.AsyncBaseTransport | None = None,
              local_tokenizers: Mapping[str, LocalTokenizer] | None = None,
              rng: random.Random | None = None,
              token_cache: TokenCache | None = None, tracing: Tracing | None = None,
              buckets: LatencyBuckets | None = None,
              status_metrics: Sequence[Callable[[], bytes]] = ()) -> FastAPI:
    """The router app. Local tokenizers named by pools are loaded here (blocking) unless
    given; the HTTP client, pools, probes and KV subscribers start in the lifespan.
    `tracing`: OpenTelemetry (observe/tracing.py), None: off. `status_metrics`: more
    registries' renderers for the status page (the gateway's under `sluice serve`)."""
    tokenizers = dict(local_tokenizers) if local_tokenizers is not None else load_tokenizers(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state = RouterState(config, rng or random.Random(config.seed), tokenizers,
                            token_cache=token_cache, transport=transport, tracing=tracing,
                            buckets=buckets or LatencyBuckets())
        app.state.router = state
        app.state.status_board = open_board(state, status_metrics)
        for pool in state.pools:
            for endpoint in pool.endpoints.values():
                state.start_subscriber(pool, endpoint)
        await asyncio.gather(state.monitor.probe_all(), state.monitor.scrape_all(),
                             state.pd.roles.refresh_all(state.pools))
        await state.adapters.sync_all()  # which worker holds which adapter, its slots
        discoveries = [DnsDiscovery(state, pool, DnsTarget.parse(url),
                                    interval_s=config.discovery_interval_s)
                       for pool in state.pools for url in pool.config.discover]
        await asyncio.gather(*(d.first_sync() for d in discoveries))  # workers by DNS
        tasks = [asyncio.create_task(state.monitor.run(config.health_interval_s,
                                                       state.monitor.probe_all)),
                 asyncio.create_task(state.monitor.run(config.scrape_interval_s,
                                                       state.monitor.scrape_all)),
                 asyncio.create_task(state.releases.run()),  # canary judge (release.py)
                 asyncio.create_task(state.pd.run(lambda: state.pools,  # P/D roles (pd.py)
                                                  min((p.pd.role_refresh_s for p in config.pools
                                                       if p.pd), default=2.0))),
                 asyncio.create_task(state.monitor.run(  # LoRA placement (adapters.py)
                     config.adapter_placement.sync_interval_s, state.adapters.sync_all)),
                 *(asyncio.create_task(d.run()) for d in discoveries)]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            app.state.status_board.close()
            await state.close()

    app = FastAPI(title="sluice router", lifespan=lifespan)
    app.add_exception_handler(SluiceError, error_response)
    app.add_exception_handler(StarletteHTTPException, http_error_response)
    app.add_middleware(RoutedFastPath)  # the OpenAI endpoints, ahead of FastAPI's layers
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)  # outermost: 413 first
    app.add_route("/tokenize", _passthrough("/tokenize"), methods=["POST"])
    app.add_route("/detokenize", _passthrough("/detokenize"), methods=["POST"])
    app.add_route("/v1/messages/count_tokens", _passthrough("/v1/messages/count_tokens"),
                  methods=["POST"])
    app.add_route("/v1/models", models, methods=["GET"])
    app.add_route("/v1/models/{model_id:path}", model, methods=["GET"])
    app.add_route(responses.INPUT_TOKENS_PATH, _passthrough(responses.INPUT_TOKENS_PATH),
                  methods=["POST"])
    for path in responses.STORED_PATHS:  # a 404 saying why, as the worker's
        app.add_route(path, responses.stored_response, methods=["GET", "POST", "DELETE"])
    app.add_route("/health", health, methods=["GET"])
    app.add_route("/liveness", liveness, methods=["GET"])
    app.add_route("/version", version, methods=["GET"])
    app.add_route("/metrics", metrics, methods=["GET"])
    app.add_route("/status", status_page, methods=["GET"])
    app.add_route("/status.json", status_json, methods=["GET"])
    app.include_router(admin_router())
    app.include_router(release_router())
    app.include_router(adapter_router())
    return app


def routed_first(app: FastAPI) -> RoutedFastPath:
    """The router app with its routed POSTs answered before FastAPI's layers are entered
    (its error, telemetry and body-limit middleware): what a layer over the app (the
    gateway under `sluice serve`) wraps, so a routed request crosses no FastAPI code."""
    return RoutedFastPath(app, state=lambda: app.state.router)


class RoutedFastPath:
    """Pure-ASGI middleware: POSTs to the routed OpenAI paths go straight to `routed.route`.

    The hot path thereby skips FastAPI's exception, exit-stack and routing layers and
    Starlette's request and streaming-response objects; the reply is written with plain
    ASGI messages. A client's hang-up cancels the request (before the first byte or
    mid-stream), so the worker sees it: on sluice's own server through its
    `ON_DISCONNECT` extension (protocol/edge.py), elsewhere by a watcher task that waits
    for `http.disconnect`. Everything else (models, metrics, admin, lifespan) continues
    into FastAPI.
    """

    def __init__(self, app: ASGIApp, state: Callable[[], RouterState] | None = None) -> None:
        self.app = app
        self.state = state  # None: the FastAPI app's, from the scope (inside it)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = ROUTED.get(scope.get("path", "")) if scope["type"] == "http" else None
        if kind is None or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        state: RouterState = self.state() if self.state else scope["app"].state.router
        try:
            body = await read_body(receive, state.config.max_body_bytes)
        except SluiceError as exc:
            return await send_error(send, exc, scope["path"], close=True)
        if body is None:
            return  # the client went away while sending
        task = asyncio.current_task()
        assert task is not None
        gone: list[bool] = []  # once the client hung up

        def hang_up() -> None:
            gone.append(True)
            task.cancel()

        stop = _watch(scope, receive, hang_up)
        try:
            read = (scope.get("extensions") or {}).get(READ_REQUEST)  # the gateway's, in front
            reply = await route(state, kind, scope["path"], body, list(scope["headers"]), read)
            await _send_reply(reply, send)
        except asyncio.CancelledError:
            if not gone:
                raise  # shutdown, not a hang-up
            task.uncancel()
        finally:
            stop()


def _watch(scope: Scope, receive: Receive, hang_up: Callable[[], None]) -> Callable[[], object]:
    """`hang_up` runs once the client goes away; returns what stops the watching. The
    server's `ON_DISCONNECT` where it offers it, else a task that waits on `receive`."""
    watch = on_disconnect(scope)
    if watch is not None:
        return watch(hang_up)
    return asyncio.create_task(_on_disconnect(receive, hang_up)).cancel


async def _on_disconnect(receive: Receive, hang_up: Callable[[], None]) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    hang_up()


async def _send_reply(reply: Relay | ErrorReply, send: Send) -> None:
    if isinstance(reply, ErrorReply):
        await send({"type": "http.response.start", "status": reply.status,
                    "headers": reply.headers})
        await send({"type": "http.response.body", "body": reply.body})
        return
    try:
        await send({"type": "http.response.start", "status": reply.status,
                    "headers": reply.headers})
        if reply.complete:
            await send({"type": "http.response.body", "body": reply.first})
            return
        await send({"type": "http.response.body", "body": reply.first, "more_body": True})
        try:
            while data := await reply.read():
                await send({"type": "http.response.body", "body": data, "more_body": True})
        except UpstreamError as exc:
            # ending without the last message makes the server drop the connection, so
            # the client sees a broken response rather than a short one
            log.warning("upstream %s failed mid-stream: %s", reply.ticket.endpoint.url, exc)
            return
        await send({"type": "http.response.body", "body": b""})
    finally:
        reply.close()


def _passthrough(path: str) -> Callable[[Request], Awaitable[Response]]:
    async def passthrough(request: Request) -> Response:
        state: RouterState = request.app.state.router
        raw = await request.body()
        body = load_json_object(raw, param="body")
        asked = body.get("model")
        model = state.aliases.model_of(asked) if isinstance(asked, str) else asked  # a
        # router-wide alias is its target's (as on /v1/chat/completions), not a 404
        pool, endpoint = state.any_worker(model if isinstance(model, str) else None)
        served = pool.tokenizer_model(model, endpoint) if isinstance(model, str) else model
        if served != asked:  # an alias (or adapter): the worker knows it by its own name
            raw = json.dumps({**body, "model": served}).encode()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP_STR}
        resp = await state.client.post(endpoint.url + path, content=raw, headers=headers)
        return Response(resp.content, status_code=resp.status_code,
                        media_type=resp.headers.get("content-type"))

    passthrough.__name__ = f"passthrough_{path.strip('/')}"
    return passthrough


async def models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": _model_entries(request.app.state.router)})


async def model(request: Request) -> Response:
    """`GET /v1/models/{id}`: one entry of the list, or 404 `model_not_found`."""
    model_id = request.path_params["model_id"]
    entry = next((m for m in _model_entries(request.app.state.router) if m["id"] == model_id),
                 None)
    if entry is None:
        raise NotFoundError(f"The model `{model_id}` does not exist.", param="model")
    return JSONResponse(entry)


def _model_entries(state: RouterState) -> list[dict[str, Any]]:
    now = int(time.time())
    ids = dict.fromkeys(name for pool in state.pools for name in pool.names())
    ids.update(dict.fromkeys(state.adapters.specs))  # registered, loaded anywhere or not
    entries: list[dict[str, Any]] = []
    for name in ids:
        entry: dict[str, Any] = {"id": name, "object": "model", "created": now,
                                 "owned_by": "sluice"}
        lineage = state.adapters.lineage(name)
        if lineage is not None:  # an adapter: vLLM's `parent` and `root` (once a worker
            entry["parent"], entry["root"] = lineage  # listed it, they were left out)
        entries.append(entry)
    entries += [{"id": name, "object": "model", "created": now, "owned_by": "sluice"}
                for name in state.aliases.names() if name not in ids]
    return entries


async def liveness(request: Request) -> Response:
    """200 while the router serves, whatever its workers' state (sglang-router's name):
    what an orchestrator probes, since a router with no ready worker still holds
    requests for the workers being started (`/health` then answers 503)."""
    return JSONResponse({"status": "alive"})


async def version(request: Request) -> Response:
    """vLLM's `GET /version`, for clients and probes that read it."""
    return JSONResponse({"version": __version__})


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
