"""Pure ASGI layers that put a process's HTTP edge into the request's trace.

    GatewaySpan(gateway(AdmittedMark(app)))   sluice serve with a gateway:
        GatewaySpan   the gateway's SERVER span, from arrival to the last byte; the
                      scope's `traceparent` is rewritten to name it
        AdmittedMark  between the gateway and the app it protects: the request got
                      through authentication and limits; the gateway's headers
                      (x-sluice-tenant / -key-id / -priority) become span attributes
    TraceContext(worker app)                   the worker: the incoming `traceparent`
                      becomes the request's trace parent (a context variable) while
                      it runs, so the worker's generation span (`WorkerSpan`) is its child

They are installed only when tracing is on; none of them exists otherwise.

    StatusRoutes(app)  `/status` and `/status.json` where no router serves them
                       (`sluice serve --workers 1`: the gateway over one worker app)
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from sluice.observe.status import StatusBoard, page_html
from sluice.observe.tracing import REQUEST_PARENT, Tracing, replace_trace_headers, set_error
from sluice.protocol.edge import admin_key_given

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

SPAN_KEY = "sluice.gateway_span"
_ADMITTED_HEADERS = {b"x-sluice-tenant": "sluice.tenant", b"x-sluice-key-id": "sluice.key_id",
                     b"x-sluice-priority": "sluice.priority"}


class GatewaySpan:
    """The gateway's span around every `/v1/` request (other paths pass untraced)."""

    def __init__(self, app: ASGIApp, tracing: Tracing) -> None:
        self.app, self.tracing = app, tracing

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if not path.startswith("/v1/"):
            return await self.app(scope, receive, send)
        headers = scope.get("headers") or []
        span = self.tracing.start(f"{scope['method']} {path}", self.tracing.extract(headers),
                                  "SERVER", {"http.request.method": scope["method"],
                                             "url.path": path, "sluice.component": "gateway"})
        scope = {**scope, "headers": replace_trace_headers(headers, self.tracing, span),
                 "state": {**scope.get("state", {}), SPAN_KEY: span}}

        async def traced_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                set_error(span, int(message["status"]))
            await send(message)

        try:
            await self.app(scope, receive, traced_send)
        except BaseException as exc:
            span.record_exception(exc)
            raise
        finally:
            span.end()


class AdmittedMark:
    """Marks the gateway span `admitted` and copies the gateway's tenant headers onto it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        span = scope.get("state", {}).get(SPAN_KEY) if scope["type"] == "http" else None
        if span is not None:
            for name, value in scope.get("headers") or []:
                key = _ADMITTED_HEADERS.get(name)
                if key is not None:
                    span.set_attribute(key, value.decode("latin-1"))
            span.add_event("admitted")
        await self.app(scope, receive, send)


def traced_gateway(wrap: Callable[[ASGIApp], ASGIApp],
                   tracing: Tracing) -> Callable[[ASGIApp], ASGIApp]:
    """`wrap` (app -> gateway(app)) with the gateway's span around it and the admission
    mark inside it."""
    return lambda app: GatewaySpan(wrap(AdmittedMark(app)), tracing)


class TraceContext:
    """The incoming `traceparent` as the request's trace parent (`REQUEST_PARENT`)."""

    def __init__(self, app: ASGIApp, tracing: Tracing) -> None:
        self.app, self.tracing = app, tracing

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        token = REQUEST_PARENT.set(self.tracing.extract(scope.get("headers") or []))
        try:
            await self.app(scope, receive, send)
        finally:
            REQUEST_PARENT.reset(token)


class StatusRoutes:
    """Serves `GET /status` and `/status.json` from a `StatusBoard` in front of `app`
    (`sluice serve --workers 1`, where no router serves them); the rest passes through.
    Tenants are shown only for a caller with `admin_key`."""

    def __init__(self, app: ASGIApp, board: StatusBoard, admin_key: str | None) -> None:
        self.app, self.board, self.admin_key = app, board, admin_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path") if scope["type"] == "http" and scope["method"] == "GET" else None
        if path == "/status":
            return await _send(send, page_html().encode(), b"text/html; charset=utf-8")
        if path == "/status.json":
            admin = bool(self.admin_key) and hmac.compare_digest(
                admin_key_given(scope.get("headers") or []).encode(),
                (self.admin_key or "").encode())
            body = json.dumps(await self.board.snapshot(admin=admin)).encode()
            return await _send(send, body, b"application/json")
        await self.app(scope, receive, send)


async def _send(send: Send, body: bytes, content_type: bytes) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [
        (b"content-type", content_type), (b"content-length", str(len(body)).encode()),
        (b"cache-control", b"no-store")]})
    await send({"type": "http.response.body", "body": body})
