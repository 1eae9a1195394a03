"""The HTTP edge's shared pieces: what every role that takes HTTP requests (worker,
router, gateway) does the same way, written once, below all of them.

    BodyLimit(app, max_bytes)          ASGI middleware: a body over the limit is a 413,
                                       by its Content-Length before a byte is read, else
                                       as soon as the bytes that cross it arrive
    read_body(receive, max_bytes)      the whole body (None: the client went away first)
    load_json_object(raw)              a JSON object, or a 400: bad JSON, nesting deeper
                                       than MAX_JSON_DEPTH, a lone UTF-16 surrogate
    error_json(exc, path)              OpenAI's `{error: {message, type, param, code}}`,
                                       Anthropic's error on /v1/messages
    send_error(send, exc, path)        the same as an ASGI response
    http_status_error(status, ...)     a framework's own HTTP error (no route, wrong
                                       method, unreadable body) as a SluiceError
    check_admin_key(expected, headers) admin routes: 403 when no key is configured (the
                                       default: admin is closed), 401 for a wrong key
    HOP_BY_HOP                         headers a proxy never forwards (RFC 9110 7.6.1)
    wait_disconnect(receive)           returns when the client has gone
    check_listen(host, port)           that a server can listen there, before it loads
                                       anything (`sluice serve`, `sluice worker`)

Why here: the router and the gateway both proxy, and the gateway sits above the router,
so helpers they share must live below both; `protocol/` is that level, next to the
error tree the bodies are made from.
"""

from __future__ import annotations

import hmac
import json
import socket
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any

from sluice.protocol import anthropic
from sluice.protocol.errors import (
    AuthenticationError,
    InvalidRequestError,
    NotFoundError,
    PayloadTooLargeError,
    PermissionDeniedError,
    SluiceError,
)

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[MutableMapping[str, Any], Receive, Send], Awaitable[None]]
Headers = Iterable[tuple[bytes, bytes]]

DEFAULT_MAX_BODY_BYTES = 2 * 1024 * 1024  # ~500k tokens of text: above any context here
MAX_JSON_DEPTH = 100
ANTHROPIC_PATHS = frozenset({"/v1/messages", "/v1/messages/count_tokens"})
HOP_BY_HOP = frozenset({
    b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
    b"trailer", b"trailers", b"transfer-encoding", b"upgrade", b"host", b"content-length",
})
HOP_BY_HOP_STR = frozenset(h.decode() for h in HOP_BY_HOP)


# -- bodies ----------------------------------------------------------------------------------


def too_large(max_bytes: int) -> PayloadTooLargeError:
    return PayloadTooLargeError(f"request body larger than {max_bytes} bytes", param="body")


def content_length(headers: Headers) -> int | None:
    """The request's Content-Length, or None if absent or unreadable."""
    for name, value in headers:
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def read_body(receive: Receive, max_bytes: int | None = None) -> bytes | None:
    """The request body; None if the client disconnected first. Raises 413 as soon as
    the bytes received pass `max_bytes` (the rest is never buffered)."""
    first = await receive()
    if first["type"] == "http.disconnect":
        return None
    body: bytes = first.get("body", b"")
    if not first.get("more_body", False):  # the common case: one message
        if max_bytes is not None and len(body) > max_bytes:
            raise too_large(max_bytes)
        return body
    parts, size = [body], len(body)
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if max_bytes is not None and size > max_bytes:
            raise too_large(max_bytes)
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)


# An ASGI extension of sluice's own server (router/server.py), which learns of a client's
# hang-up from its socket: `scope["extensions"][ON_DISCONNECT](callback)` has `callback`
# run once if the client goes away (at once if it has), until the function it returns
# is called. An app that would otherwise keep a task waiting on `receive` for
# `http.disconnect` through a whole request (the router's routed path) uses it instead;
# a layer between (the gateway) may wrap it, as it wraps `receive`.
ON_DISCONNECT = "sluice.on_disconnect"
OnDisconnect = Callable[[Callable[[], None]], Callable[[], None]]


def on_disconnect(scope: MutableMapping[str, Any]) -> OnDisconnect | None:
    """The server's `ON_DISCONNECT` extension, or None (uvicorn, a test's transport)."""
    extensions = scope.get("extensions")
    return extensions.get(ON_DISCONNECT) if extensions else None


async def wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class BodyLimit:
    """Pure ASGI middleware: refuse request bodies over `max_bytes` with 413.

    A declared Content-Length over the limit is answered before the app runs; a chunked
    body raises `PayloadTooLargeError` from `receive` once it passes the limit (the app's
    error handling answers it: FastAPI's SluiceError handler, or `read_body`'s caller).
    """

    def __init__(self, app: ASGIApp, max_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: MutableMapping[str, Any], receive: Receive,
                       send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = content_length(scope.get("headers") or ())
        if length is not None and length > self.max_bytes:
            return await send_error(send, too_large(self.max_bytes), scope.get("path", ""),
                                    close=True)
        if length is not None:  # the server enforces the declared length
            return await self.app(scope, receive, send)
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise too_large(self.max_bytes)
            return message

        await self.app(scope, limited, send)


# -- JSON ------------------------------------------------------------------------------------


def load_json_object(raw: bytes | str, *, param: str | None = None) -> dict[str, Any]:
    """Parse a request body that must be a JSON object; every failure is a 400.

    Deep nesting (`[[[[...]]]]`) would otherwise raise RecursionError here or in
    whatever walks the value later; a lone surrogate (`"\\ud800"`) is valid JSON but
    not valid Unicode, and fails later when the text is encoded (tokenizer, database).
    Both checks run only when a cheap scan says they could apply."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError
        detail = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise InvalidRequestError(f"the request body is not valid JSON: {detail}",
                                  param=param) from None
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object", param=param)
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    if data.count(b"[") + data.count(b"{") > MAX_JSON_DEPTH and _depth(body) > MAX_JSON_DEPTH:
        raise InvalidRequestError(f"the request body nests deeper than {MAX_JSON_DEPTH} levels",
                                  param=param)
    if (b"\\u" in data or b"\xed" in data) and _has_lone_surrogate(body):
        raise InvalidRequestError("the request body holds a lone UTF-16 surrogate "
                                  "(not valid Unicode)", param=param)
    return body


def refuse_kv_transfer_params(body: dict[str, Any]) -> None:
    """A client's `kv_transfer_params` is a 400 at the front doors (gateway, router): it
    names a host and port the worker dials to pull KV (an open relay to any address the
    worker can reach); only the router sets it, between prefill and decode workers."""
    if body.get("kv_transfer_params") is not None:
        raise InvalidRequestError("kv_transfer_params is set by the router between prefill "
                                  "and decode workers, not by clients",
                                  param="kv_transfer_params")


def _depth(value: Any) -> int:
    """Nesting depth of a parsed JSON value, without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > deepest:
            deepest = depth
            if deepest > MAX_JSON_DEPTH:
                return deepest
        children = item.values() if isinstance(item, dict) else item
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))
    return deepest


def _has_lone_surrogate(body: dict[str, Any]) -> bool:
    try:
        json.dumps(body, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return True
    return False


# -- errors ----------------------------------------------------------------------------------


def error_json(exc: SluiceError, path: str = "") -> bytes:
    """The error body a client of `path` expects: Anthropic's on the Messages API,
    OpenAI's everywhere else."""
    body = anthropic.error_body(exc) if path in ANTHROPIC_PATHS else exc.to_dict()
    return json.dumps(body).encode()


def error_event(exc: SluiceError, path: str = "") -> bytes:
    """A stream's error event for a client of `path`, the way its API streams one:
    Anthropic's `event: error` on the Messages API, OpenAI's `data: {"error": ...}`."""
    head = b"event: error\ndata: " if path in ANTHROPIC_PATHS else b"data: "
    return head + error_json(exc, path) + b"\n\n"


def error_headers(exc: SluiceError, body: bytes, *, close: bool = False
                  ) -> list[tuple[bytes, bytes]]:
    headers = [(b"content-type", b"application/json"),
               (b"content-length", b"%d" % len(body))]
    headers += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in exc.headers.items()]
    if close:
        headers.append((b"connection", b"close"))
    return headers


def http_status_error(status: int, detail: str, method: str, path: str) -> SluiceError:
    """Starlette's HTTPException (404 no route, 405 wrong method, 400 a body FastAPI
    could not parse) as one of sluice's errors, so it leaves in the API's error shape
    like every other refusal instead of `{"detail": ...}`."""
    if status == 404:
        return NotFoundError(f"no route {method} {path}", code="not_found")
    err = InvalidRequestError(detail)
    err.status_code = status
    return err


async def send_error(send: Send, exc: SluiceError, path: str = "", *,
                     close: bool = False) -> None:
    """Answer with `exc` as JSON; `close` asks the server to drop the connection after
    (the client may still be sending a body nobody will read)."""
    body = error_json(exc, path)
    await send({"type": "http.response.start", "status": exc.status_code,
                "headers": error_headers(exc, body, close=close)})
    await send({"type": "http.response.body", "body": body, "more_body": False})


# -- admin -----------------------------------------------------------------------------------


def admin_key_given(headers: Headers) -> str:
    """`Authorization: Bearer KEY`, else `x-admin-key` or `x-api-key`, else ""."""
    given = ""
    for name, value in headers:
        name = name.lower()
        if name == b"authorization" and value[:7].lower() == b"bearer ":
            return value[7:].strip().decode("latin-1")
        if name in (b"x-admin-key", b"x-api-key"):
            given = value.strip().decode("latin-1")
    return given


def check_admin_key(expected: str | None, headers: Headers, *, setting: str) -> None:
    """Admin is closed unless a key is configured (403 naming `setting`); a missing or
    wrong key is a 401. Compared in constant time."""
    if not expected:
        raise PermissionDeniedError(f"admin API disabled: set {setting}")
    if not hmac.compare_digest(admin_key_given(headers).encode(), expected.encode()):
        raise AuthenticationError("admin key missing or wrong")


def check_listen(host: str, port: int) -> None:
    """That this process can listen on `host`:`port` now, before any worker or database is
    started: a port in use was OSError's traceback once the workers had started (and a
    router at `--min-workers 2` had loaded two models first). Binds and closes at once
    (SO_REUSEADDR, as the servers bind); port 0 picks a free one later."""
    if not 0 <= port <= 65535:
        raise InvalidRequestError(f"--port must be in 0..65535, got {port}", param="port")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise InvalidRequestError(f"--host {host!r}: cannot resolve it ({exc.strerror})",
                                  param="host") from exc
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as exc:
            raise InvalidRequestError(f"cannot listen on {host}:{port}: {exc.strerror} (--port "
                                      f"{port}; another server there?)", param="port") from exc
