"""`sluice router`'s own HTTP/1.1 server: routed POSTs go straight to the proxy, the rest
into the router's ASGI app.

Under uvicorn most of a proxied request's CPU goes to the layers around the proxy: an
ASGI scope and message dicts, five middleware layers, a Starlette request, a streaming
response with its task group, a disconnect-watcher task. This server parses requests
with httptools (llhttp) in an asyncio Protocol and writes replies to the socket itself:

    data_received -> parser -> on_message_complete -> one task per request, in order
        POST /v1/chat/completions | /v1/completions | /v1/messages
            -> routed.route -> Relay -> head + first bytes in one write, then the rest
               (the worker's Content-Length kept, else chunked)
        anything else (models, health, metrics, admin, tokenize)
            -> the FastAPI app over ASGI (`_AsgiCall` below)
    connection_lost -> cancel the routed request's task: the proxy closes the worker
                       connection, so the worker aborts the generation; an ASGI request
                       gets `http.disconnect` instead, and the callbacks it registered
                       through the `ON_DISCONNECT` extension (protocol/edge.py) run

Requests on one connection are answered one at a time, in order (pipelined ones wait).
The app's ASGI lifespan runs around serving, so both paths share one `RouterState`.

With a gateway in front (`sluice serve`) this is still the server: the gateway is an
ASGI layer over the router's app (`direct=False`), and the routed POSTs reach
`routed.route` through it, from the app's `RoutedFastPath`; so the router's front end is
one and the same with or without a gateway, and uvicorn is on neither path.

    async with RouterServer(app, host, port) as server: ...   # tests, embedding
    run(app, host, port)                                      # the CLI; SIGINT/SIGTERM stop it
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import gc
import logging
import signal
import time
from collections import deque
from collections.abc import Callable, MutableMapping
from http import HTTPStatus
from typing import Any, cast
from urllib.parse import unquote

import httptools

from sluice.protocol.edge import (
    DEFAULT_MAX_BODY_BYTES,
    ON_DISCONNECT,
    content_length,
    error_headers,
    error_json,
    too_large,
)
from sluice.protocol.errors import InvalidRequestError, SluiceError
from sluice.router.proxy import Relay
from sluice.router.routed import ROUTED, ErrorReply, error_reply, route
from sluice.router.state import RouterState
from sluice.router.upstream import UpstreamError

log = logging.getLogger(__name__)

ASGIApp = Callable[..., Any]
MAX_HEAD = 64 * 1024  # request line and headers
MAX_PIPELINED = 16
KEEP_ALIVE_S = 30.0
_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}


class _Date:
    """The Date header line, formatted once a second."""

    def __init__(self) -> None:
        self.second = -1
        self.line = b""

    def get(self) -> bytes:
        now = int(time.time())
        if now != self.second:
            self.second = now
            self.line = b"date: " + email.utils.formatdate(now, usegmt=True).encode() + b"\r\n"
        return self.line


def _status_line(status: int) -> bytes:
    return b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b""))


_INTERNAL = error_reply(SluiceError("internal router error"))


def _status_error(status: int, message: str) -> SluiceError:
    exc = InvalidRequestError(message)
    exc.status_code = status
    return exc


def _header_lines(headers: list[tuple[bytes, bytes]]) -> bytes:
    return b"".join(name + b": " + value + b"\r\n" for name, value in headers)


class _Request:
    __slots__ = ("method", "target", "headers", "body", "keep_alive", "http11")

    def __init__(self, method: bytes, target: bytes, headers: list[tuple[bytes, bytes]],
                 body: bytes, keep_alive: bool, http11: bool) -> None:
        self.method, self.target, self.headers, self.body = method, target, headers, body
        self.keep_alive, self.http11 = keep_alive, http11


class _Connection(asyncio.Protocol):
    """One client connection: parses requests, runs them in order, writes their replies."""

    def __init__(self, server: RouterServer) -> None:
        self.server = server
        self.loop = server.loop
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.queue: deque[_Request] = deque()
        self.task: asyncio.Task[None] | None = None
        self.cancel_on_loss = False
        self.lost = False
        self.on_lost: asyncio.Future[None] | None = None  # an ASGI call's disconnect wait
        self.lost_callbacks: list[Callable[[], None]] = []  # ON_DISCONNECT's (protocol/edge)
        self.write_paused = False
        self.read_paused = False
        self.writable: asyncio.Future[None] | None = None
        self.idle_timer: asyncio.TimerHandle | None = None
        self.sockname: Any = None
        self.peername: Any = None
        self.rejected = False
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._body: list[bytes] = []
        self._size = 0

    # --- asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        self.sockname = transport.get_extra_info("sockname")
        self.peername = transport.get_extra_info("peername")
        self.server.connections.add(self)
        self._arm_idle()

    def data_received(self, data: bytes) -> None:
        if self.rejected:
            return
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            self._reject(InvalidRequestError(f"malformed HTTP request: {exc}"))

    def eof_received(self) -> bool:
        return False  # a client that half-closes is gone: close, cancel its request

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self.on_lost is not None and not self.on_lost.done():
            self.on_lost.set_result(None)
        self.server.connections.discard(self)
        if self.idle_timer is not None:
            self.idle_timer.cancel()
        if self.writable is not None and not self.writable.done():
            self.writable.set_result(None)
        if self.task is not None and self.cancel_on_loss:
            self.task.cancel()
        callbacks, self.lost_callbacks = self.lost_callbacks, []
        for callback in callbacks:
            callback()

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        if self.writable is not None and not self.writable.done():
            self.writable.set_result(None)

    # --- httptools callbacks --------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = []
        self._body = []
        self._size = 0
        if self.idle_timer is not None:
            self.idle_timer.cancel()
            self.idle_timer = None

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._size += len(url)
        if self._size > MAX_HEAD:
            self._reject(_status_error(414, "request target too long"))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.lower(), value))
        self._size += len(name) + len(value)
        if self._size > MAX_HEAD:
            self._reject(_status_error(431, "request headers too large"))

    def on_headers_complete(self) -> None:
        self._size = 0
        if self.rejected:
            return
        length = content_length(self._headers)
        if length is not None and length > self.server.max_body:
            self._reject(too_large(self.server.max_body))  # before a byte of it is read
            return
        if (b"expect", b"100-continue") in ((n, v.lower()) for n, v in self._headers) \
                and self.transport is not None:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self._size += len(body)
        if self.rejected:
            return
        if self._size > self.server.max_body:
            self._reject(too_large(self.server.max_body))
            return
        self._body.append(body)

    def on_message_complete(self) -> None:
        if self.rejected:
            return
        p = self.parser
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        self.queue.append(_Request(p.get_method(), self._url, self._headers, body,
                                   p.should_keep_alive(), p.get_http_version() == "1.1"))
        if len(self.queue) > MAX_PIPELINED and self.transport is not None:
            self.read_paused = True  # a client pipelining this deep waits for answers
            self.transport.pause_reading()
        if self.task is None:
            self._next()

    # --- running requests ---------------------------------------------------------------------

    def _next(self) -> None:
        if self.lost:
            return
        if not self.queue:
            self._arm_idle()
            return
        if self.read_paused and len(self.queue) <= MAX_PIPELINED // 2 \
                and self.transport is not None:
            self.read_paused = False
            self.transport.resume_reading()
        self.task = self.loop.create_task(self._serve(self.queue.popleft()))

    async def _serve(self, req: _Request) -> None:
        keep = False
        try:
            keep = await self.server.handle(self, req)
        except asyncio.CancelledError:
            if not self.lost:
                raise  # server shutdown
            current = asyncio.current_task()
            if current is not None:
                current.uncancel()
        except Exception:
            log.exception("error serving %s %s", req.method.decode(), req.target[:200])
            self.close()
        finally:
            self.task = None
            self.cancel_on_loss = False
        if self.lost:
            return
        if not (keep and req.keep_alive) or self.server.closing:
            self.close()
            return
        self._next()

    def write(self, data: bytes) -> None:
        if not self.lost and self.transport is not None:
            self.transport.write(data)

    async def drain(self) -> None:
        if self.write_paused and not self.lost:
            self.writable = self.loop.create_future()
            await self.writable

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def _arm_idle(self) -> None:
        if self.idle_timer is not None:
            self.idle_timer.cancel()
        self.idle_timer = self.loop.call_later(self.server.keep_alive_s, self.close)

    def _reject(self, exc: SluiceError) -> None:
        """Answer an unreadable request with an error, then stop sending; what the client
        still sends is discarded until it closes (or the idle timer does), so that closing
        with unread input does not reset the connection before the error is read. With
        earlier requests still unanswered the connection just closes."""
        if self.rejected:
            return
        self.rejected = True
        if self.task is not None or self.queue or self.transport is None \
                or not self.transport.can_write_eof():
            self.close()
            return
        path = self._url.partition(b"?")[0].decode("latin-1")
        body = error_json(exc, path)
        self.write(_status_line(exc.status_code)
                   + _header_lines(error_headers(exc, body, close=True)) + b"\r\n" + body)
        self.transport.write_eof()
        self._arm_idle()


class RouterServer:
    """Serves a router app (`build_app`) on host:port until `stop()` or signals (in `run`).

    The app's lifespan starts before the socket listens and stops after the last
    connection is closed (or `shutdown_timeout_s` passed; then open requests are
    cancelled). `direct=False` sends every request through `app` (a gateway layered over
    the router's app: `sluice serve`), the routed ones included; `state` then says where
    the router's state is.
    """

    def __init__(self, app: ASGIApp, host: str = "127.0.0.1", port: int = 8000, *,
                 keep_alive_s: float = KEEP_ALIVE_S, shutdown_timeout_s: float = 30.0,
                 state: Callable[[], RouterState] | None = None, direct: bool = True) -> None:
        self.app = app
        self.direct = direct
        self.host, self.port = host, port
        self.keep_alive_s = keep_alive_s
        self.shutdown_timeout_s = shutdown_timeout_s
        self._state_getter = state or (lambda: getattr(app, "state").router)  # noqa: B009
        self.connections: set[_Connection] = set()
        self.closing = False
        self.date = _Date()
        self.state: RouterState | None = None
        self.max_body = DEFAULT_MAX_BODY_BYTES  # the app's config's, once started
        self._lifespan: _Lifespan | None = None
        self._server: asyncio.Server | None = None
        self._stopped: asyncio.Event | None = None

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return asyncio.get_running_loop()

    async def start(self) -> None:
        self._stopped = asyncio.Event()
        self._lifespan = _Lifespan(self.app)
        await self._lifespan.startup()
        self.state = self._state_getter()
        self.max_body = self.state.config.max_body_bytes
        try:
            self._server = await self.loop.create_server(
                lambda: _Connection(self), self.host, self.port, backlog=2048,
                reuse_address=True)
        except BaseException:  # the address is taken: what the startup made ends here
            await self._lifespan.shutdown()
            raise
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        """Stop listening, let open requests finish (bounded), then run the lifespan's end."""
        self.closing = True
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            if conn.task is None:
                conn.close()
        deadline = time.monotonic() + self.shutdown_timeout_s
        while any(c.task is not None for c in self.connections) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for conn in list(self.connections):
            if conn.task is not None:
                conn.task.cancel()
            conn.close()
        if self._lifespan is not None:
            await self._lifespan.shutdown()
        if self._stopped is not None:
            self._stopped.set()

    async def __aenter__(self) -> RouterServer:
        await self.start()
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.stop()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # --- per request ----------------------------------------------------------------------

    async def handle(self, conn: _Connection, req: _Request) -> bool:
        """Answer one request; returns whether the connection may be kept."""
        path, _, _ = req.target.partition(b"?")
        kind = ROUTED.get(path.decode("latin-1")) if self.direct and req.method == b"POST" \
            else None
        if kind is None:
            return await _AsgiCall(self, conn, req).run()
        assert self.state is not None
        conn.cancel_on_loss = True
        try:
            reply = await route(self.state, kind, path.decode("latin-1"), req.body, req.headers)
        except Exception:
            log.exception("error routing %s", path[:200].decode("latin-1"))
            reply = _INTERNAL
        close = b"" if req.keep_alive else b"connection: close\r\n"
        if isinstance(reply, ErrorReply):
            conn.write(_status_line(reply.status) + self.date.get()
                       + _header_lines(reply.headers) + close + b"\r\n" + reply.body)
            return True
        return await self._relay(conn, req, reply, close)

    async def _relay(self, conn: _Connection, req: _Request, relay: Relay, close: bytes) -> bool:
        try:
            head = (_status_line(relay.status) + self.date.get() + _header_lines(relay.headers)
                    + close)
            if relay.length is not None or not req.http11:
                keep = relay.length is not None
                conn.write(head + (b"\r\n" if keep or close else b"connection: close\r\n\r\n")
                           + relay.first)
                while data := await relay.read():
                    conn.write(data)
                    await conn.drain()
                return keep
            conn.write(head + b"transfer-encoding: chunked\r\n\r\n"
                       + (b"%x\r\n%s\r\n" % (len(relay.first), relay.first) if relay.first else b""))
            while data := await relay.read():
                conn.write(b"%x\r\n%s\r\n" % (len(data), data))
                await conn.drain()
            conn.write(b"0\r\n\r\n")
            return True
        except UpstreamError as exc:
            # drop the client connection: it sees a broken response, not a short one
            log.warning("upstream %s failed mid-stream: %s", relay.ticket.endpoint.url, exc)
            return False
        finally:
            relay.close()


class _AsgiCall:
    """One request through the ASGI app: its scope, `receive`, and a `send` that frames
    the response as HTTP/1.1 (the app's Content-Length, else chunked; HTTP/1.0: close)."""

    def __init__(self, server: RouterServer, conn: _Connection, req: _Request) -> None:
        self.server, self.conn, self.req = server, conn, req
        self.head_only = req.method == b"HEAD"
        self.body_given = False
        self.done = False  # the response is complete (or the app returned)
        self.wake: asyncio.Future[None] | None = None  # a `receive` waiting for either
        self.head: tuple[int, list[tuple[bytes, bytes]]] | None = None
        self.started = self.complete = self.chunked = False
        self.keep = req.keep_alive

    def scope(self) -> dict[str, Any]:
        req, conn = self.req, self.conn
        raw_path, _, query = req.target.partition(b"?")
        lifespan = self.server._lifespan
        return {
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1" if req.http11 else "1.0", "method": req.method.decode(),
            "scheme": "http", "path": unquote(raw_path.decode("latin-1")), "raw_path": raw_path,
            "query_string": query, "root_path": "", "headers": req.headers,
            "client": conn.peername[:2] if conn.peername else None,
            "server": conn.sockname[:2] if conn.sockname else None,
            "state": dict(lifespan.state) if lifespan is not None else {},
            "extensions": {ON_DISCONNECT: self.on_disconnect},
        }

    def on_disconnect(self, callback: Callable[[], None]) -> Callable[[], None]:
        """`ON_DISCONNECT` (protocol/edge.py): `callback` runs once when the connection is
        lost, unless the function returned is called first."""
        conn = self.conn
        if conn.lost:
            conn.loop.call_soon(callback)
            return _nothing
        conn.lost_callbacks.append(callback)

        def stop() -> None:
            if callback in conn.lost_callbacks:
                conn.lost_callbacks.remove(callback)

        return stop

    async def run(self) -> bool:
        """Run the app; returns whether the connection may be kept."""
        try:
            await self.server.app(self.scope(), self.receive, self.send)
        except Exception:
            log.exception("error in the app serving %s", self.req.target[:200].decode("latin-1"))
            self.keep = False
        finally:
            self._finish()
        if not self.started:
            self.conn.write(_status_line(500) + self.server.date.get()
                            + _header_lines(_INTERNAL.headers) + b"\r\n" + _INTERNAL.body)
            return self.keep
        return self.complete and self.keep

    async def receive(self) -> MutableMapping[str, Any]:
        if not self.body_given:
            self.body_given = True
            return {"type": "http.request", "body": self.req.body, "more_body": False}
        if not self.conn.lost and not self.done:  # wait for either, on one future
            if self.wake is None:
                self.wake = self.conn.on_lost = self.conn.loop.create_future()
            await asyncio.shield(self.wake)  # a cancelled waiter leaves it to the others
        return {"type": "http.disconnect"}

    def _finish(self) -> None:
        self.done = True
        if self.wake is not None:
            if not self.wake.done():
                self.wake.set_result(None)
            if self.conn.on_lost is self.wake:
                self.conn.on_lost = None

    async def send(self, message: MutableMapping[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.head = (message["status"],
                         [(bytes(n), bytes(v)) for n, v in message.get("headers", [])])
            return
        if message["type"] != "http.response.body" or self.complete:
            return
        body: bytes = message.get("body", b"")
        more: bool = message.get("more_body", False)
        out = b"" if self.started else self._head_bytes(len(body), more)
        if body and not self.head_only:
            out += b"%x\r\n%s\r\n" % (len(body), body) if self.chunked else body
        if not more:
            self.complete = True
            if self.chunked and not self.head_only:
                out += b"0\r\n\r\n"
        self.conn.write(out)
        if not more:
            self._finish()
        await self.conn.drain()

    def _head_bytes(self, first_len: int, more: bool) -> bytes:
        assert self.head is not None, "http.response.body before http.response.start"
        self.started = True
        status, headers = self.head
        if not any(n.lower() == b"content-length" for n, _ in headers):
            if not more:
                headers.append((b"content-length", b"%d" % first_len))
            elif self.req.http11:
                self.chunked = True
                headers.append((b"transfer-encoding", b"chunked"))
            else:
                self.keep = False  # HTTP/1.0 without a length: the close ends the body
        if not self.keep:
            headers.append((b"connection", b"close"))
        return _status_line(status) + self.server.date.get() + _header_lines(headers) + b"\r\n"


def _nothing() -> None:
    pass


class _Lifespan:
    """Runs an ASGI app's lifespan protocol: startup before serving, shutdown after."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.state: dict[str, Any] = {}
        self.inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.events: dict[str, asyncio.Future[None]] = {}
        self.task: asyncio.Task[None] | None = None

    async def startup(self) -> None:
        loop = asyncio.get_running_loop()
        self.events = {"startup": loop.create_future(), "shutdown": loop.create_future()}
        self.task = asyncio.create_task(self._run())
        # a failed phase is raised by `_step` (the app's "failed" message, or the task's
        # own exception): marked retrieved here, so asyncio does not also log it as
        # "never retrieved" when the task is collected (it did, or not, by gc timing)
        self.task.add_done_callback(lambda t: t.cancelled() or t.exception())
        await self._step("startup")

    async def shutdown(self) -> None:
        if self.task is not None and not self.task.done():
            await self._step("shutdown")
            await asyncio.gather(self.task, return_exceptions=True)

    async def _step(self, phase: str) -> None:
        assert self.task is not None
        self.inbox.put_nowait({"type": f"lifespan.{phase}"})
        await asyncio.wait([self.events[phase], self.task], return_when=asyncio.FIRST_COMPLETED)
        if not self.events[phase].done():  # the app returned or raised without answering
            exc = self.task.exception() if not self.task.cancelled() else None
            raise RuntimeError(f"the app's lifespan {phase} did not complete") from exc
        self.events[phase].result()

    async def _run(self) -> None:
        scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"},
                 "state": self.state}

        async def send(message: MutableMapping[str, Any]) -> None:
            phase, _, outcome = message["type"].removeprefix("lifespan.").partition(".")
            future = self.events.get(phase)
            if future is None or future.done():
                return
            if outcome == "complete":
                future.set_result(None)
            else:
                future.set_exception(RuntimeError(f"lifespan {phase} failed: "
                                                  f"{message.get('message', '')}"))

        await self.app(scope, self.inbox.get, send)


def run(app: ASGIApp, host: str, port: int, *, state: Callable[[], RouterState] | None = None,
        direct: bool = True) -> None:
    """Serve until SIGINT or SIGTERM (then drain and stop). Uses uvloop when installed."""

    async def main() -> None:
        server = RouterServer(app, host, port, state=state, direct=direct)
        await server.start()
        gc.freeze()  # what startup made (modules, tokenizers, tables) lives as long as the
        # process: out of the collector's sight, full collections walk only what serving made
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        log.info("sluice router listening on http://%s:%d", host, server.port)
        await stop.wait()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)  # a second signal interrupts the drain
        await server.stop()

    try:
        import uvloop
    except ImportError:
        asyncio.run(main())
        return
    with contextlib.suppress(KeyboardInterrupt):
        uvloop.run(main())
