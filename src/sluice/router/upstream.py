"""Raw HTTP/1.1 keep-alive connections to the workers, for the proxied POSTs (the data path).

httpx builds a Request, a Headers model and a Response and runs its auth, redirect and
cookie steps for every call: about a third of the router's CPU per proxied request. The
data path needs none of it. The request head is a few pre-encoded lines, the body is the
client's bytes, and the response is passed back as it arrives. So each worker connection
is an asyncio Protocol with an httptools (llhttp) response parser:

    UpstreamPool.send(target, head, body)
      an idle connection to host:port (or a new one) -> head + body in one write
      await the status line and headers               -> the connection, as the response
    conn.read()      body bytes as they arrive, decoded from Content-Length, chunked or
                     until-close framing; b"" once the body is complete
    conn.release()   body fully read and keep-alive: back to the idle stack; otherwise
                     the socket is closed, which is how a worker learns that the client
                     went away (it aborts the generation)

Errors carry httpx's names, so retry reasons read the same in the metrics:

    UpstreamError
     ├── ConnectError, ConnectTimeout                      nothing was sent
     └── ReadError, ReadTimeout, RemoteProtocolError       sent; the response failed

A reused connection that the worker had already closed (no response byte at all) is
dialled again once. Reading from the worker pauses while more than 256 KiB of body
waits for a slow client, so the back-pressure reaches the worker.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from dataclasses import dataclass
from typing import cast
from urllib.parse import urlsplit

import httptools

PAUSE_ABOVE = 256 * 1024
RESUME_BELOW = 64 * 1024


class UpstreamError(Exception):
    """The exchange with a worker failed."""


class ConnectError(UpstreamError):
    pass


class ConnectTimeout(UpstreamError):
    pass


class ReadError(UpstreamError):
    pass


class ReadTimeout(UpstreamError):
    pass


class RemoteProtocolError(UpstreamError):
    pass


class _Stale(Exception):
    """A reused connection turned out closed by the worker before any response byte."""


@dataclass(frozen=True)
class Target:
    """Where one worker base URL points: the pool key, the Host line and the path prefix."""

    scheme: str
    host: str
    port: int
    host_line: bytes  # b"Host: h:p\r\n"
    prefix: bytes  # the base URL's path, e.g. b"" or b"/worker1"

    @classmethod
    def of(cls, url: str) -> Target:
        parts = urlsplit(url)
        tls = parts.scheme == "https"
        port = parts.port or (443 if tls else 80)
        host = parts.hostname or "127.0.0.1"
        return cls(parts.scheme, host, port, f"Host: {parts.netloc}\r\n".encode("latin-1"),
                   parts.path.rstrip("/").encode("latin-1"))

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.scheme, self.host, self.port)


class UpstreamConnection(asyncio.Protocol):
    """One keep-alive connection to a worker; during an exchange, also its response.

    Touched only on the event loop. Between exchanges it sits in the pool's idle stack;
    the worker closing it there just marks it closed.
    """

    def __init__(self, pool: UpstreamPool, key: tuple[str, str, int]) -> None:
        self.pool, self.key = pool, key
        self.loop = asyncio.get_running_loop()
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.reused = False
        self.paused = False
        self.last_bytes_at = 0.0  # loop time of the last bytes received (or of the send)
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []  # names lower-cased
        self.content_length: int | None = None
        self.chunked = False
        self.keep_alive = True
        self.complete = False
        self.error: UpstreamError | None = None
        self.got_bytes = False
        self.head_done = False
        self._informational = False
        self._head: asyncio.Future[None] | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._chunks: deque[bytes] = deque()
        self._buffered = 0

    # --- the exchange -------------------------------------------------------------------

    async def exchange(self, payload: bytes, read_timeout: float | None) -> UpstreamConnection:
        """Write the request and wait for the response head. Cancelled: the socket closes."""
        assert self.transport is not None
        self._reset()
        head = self._head = self.loop.create_future()
        self.last_bytes_at = self.loop.time()
        self.pool.busy.setdefault(self.key, set()).add(self)
        try:
            self.transport.write(payload)
        except (RuntimeError, OSError) as exc:  # closed under us between take and write
            self.close()
            if self.reused:
                raise _Stale() from exc
            raise ReadError(f"writing the request failed: {exc!r}") from exc
        timer = (self.loop.call_later(read_timeout, self._timed_out, "the response head")
                 if read_timeout else None)
        try:
            await head
        except BaseException:
            self.close()
            raise
        finally:
            if timer is not None:
                timer.cancel()
        return self

    async def read(self) -> bytes:
        """The body bytes that have arrived (waiting for some), b"" once it is complete."""
        read_timeout = self.pool.read_timeout
        while True:
            if self._chunks:
                data = (self._chunks.popleft() if len(self._chunks) == 1
                        else b"".join(self._chunks))
                self._chunks.clear()
                self._buffered = 0
                if self.paused and self.transport is not None:
                    self.paused = False
                    self.transport.resume_reading()
                return data
            if self.complete:
                return b""
            if self.error is not None:
                raise self.error
            waiter = self._waiter = self.loop.create_future()
            timer = (self.loop.call_later(read_timeout, self._timed_out, "the response body")
                     if read_timeout else None)
            try:
                await waiter
            finally:
                self._waiter = None
                if timer is not None:
                    timer.cancel()

    @property
    def finished(self) -> bool:
        """The whole body has arrived and been read."""
        return self.complete and not self._chunks

    def release(self) -> None:
        """Done with the response: keep the connection if it is reusable, else close it."""
        if self.complete and self.keep_alive and not self.closed and self.error is None:
            self._reset()
            self.pool.done(self)
            self.pool.give(self)
        else:
            self.close()

    def close(self) -> None:
        self.closed = True
        self.pool.done(self)
        if self.transport is not None:
            self.transport.close()

    def cut(self, reason: str) -> None:
        """Fail the exchange in progress with ReadError(reason) and close the socket: what
        a dead connection does, for one that is alive but silent (a frozen worker)."""
        self._fail(ReadError(reason))
        self.close()

    # --- asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        self.last_bytes_at = self.loop.time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(RemoteProtocolError(f"bad response from the worker: {exc}"))
            self.close()

    def eof_received(self) -> bool:
        return False  # close the transport: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._head is None and self._waiter is None and not self.head_done:
            return  # idle: the pool skips closed connections
        if self.head_done and not self.complete and self.content_length is None \
                and not self.chunked:
            self.complete = True  # the body ran until the worker closed
            self.keep_alive = False
            self._wake()
        elif not self.got_bytes and self.reused:
            self._fail(_Stale())
        elif not self.complete:
            self._fail(ReadError(f"the worker closed the connection: {exc!r}" if exc else
                                 "the worker closed the connection mid-response"))

    # --- httptools callbacks --------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200:  # informational (100 Continue): the real head follows
            self._informational = True
            self.headers = []
            return
        self.status = status
        self.keep_alive = self.parser.should_keep_alive()
        for name, value in self.headers:
            if name == b"content-length":
                self.content_length = int(value) if value.strip().isdigit() else None
            elif name == b"transfer-encoding":
                self.chunked = b"chunked" in value.lower()
        if self.chunked:
            self.content_length = None
        self.head_done = True
        if self._head is not None and not self._head.done():
            self._head.set_result(None)

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        self._buffered += len(body)
        if self._buffered > PAUSE_ABOVE and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self._informational:
            self._informational = False
            return
        self.complete = True
        self._wake()

    # --- internals --------------------------------------------------------------------------

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _fail(self, error: Exception) -> None:
        if self._head is not None and not self._head.done():
            self._head.set_exception(error)
            return
        if isinstance(error, UpstreamError):
            self.error = error
        else:
            self.error = ReadError(str(error))
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(self.error)

    def _timed_out(self, what: str) -> None:
        self._fail(ReadTimeout(f"timed out waiting for {what}"))
        self.close()


class UpstreamPool:
    """Idle keep-alive connections per worker (a stack: the warmest socket first)."""

    def __init__(self, connect_timeout: float | None = 5.0, read_timeout: float | None = 600.0,
                 max_idle_per_host: int = 512, ssl_context: ssl.SSLContext | None = None) -> None:
        """`ssl_context`: for https:// workers (default: the system's trusted CAs)."""
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.max_idle_per_host = max_idle_per_host
        self.idle: dict[tuple[str, str, int], list[UpstreamConnection]] = {}
        # connections with an exchange in progress (a request sent, its response not done)
        self.busy: dict[tuple[str, str, int], set[UpstreamConnection]] = {}
        self._ssl = ssl_context

    async def send(self, target: Target, payload: bytes) -> UpstreamConnection:
        """Send one request (head and body, already encoded); returns once its response
        head has arrived. Raises UpstreamError."""
        conn = self.take(target.key)
        if conn is not None:
            try:
                return await conn.exchange(payload, self.read_timeout)
            except _Stale:
                pass  # the worker closed an idle connection: dial once more
        conn = await self._dial(target)
        try:
            return await conn.exchange(payload, self.read_timeout)
        except _Stale as exc:  # cannot happen on a fresh connection; be explicit anyway
            raise ReadError("the worker closed the connection without a response") from exc

    def take(self, key: tuple[str, str, int]) -> UpstreamConnection | None:
        stack = self.idle.get(key)
        while stack:
            conn = stack.pop()
            if not conn.closed and conn.transport is not None and not conn.transport.is_closing():
                conn.reused = True
                return conn
        return None

    def give(self, conn: UpstreamConnection) -> None:
        stack = self.idle.setdefault(conn.key, [])
        if len(stack) < self.max_idle_per_host:
            stack.append(conn)
        else:
            conn.close()

    def done(self, conn: UpstreamConnection) -> None:
        """`conn`'s exchange ended (released or closed)."""
        busy = self.busy.get(conn.key)
        if busy is not None:
            busy.discard(conn)

    def cut_silent(self, key: tuple[str, str, int], silent_s: float, reason: str) -> int:
        """Fail every exchange with the worker at `key` that has received nothing for
        `silent_s` seconds (`UpstreamConnection.cut`); returns how many. One paused for a
        slow client is silent by our doing, and is left alone."""
        now = asyncio.get_running_loop().time()
        stalled = [c for c in self.busy.get(key, ())
                   if not c.paused and now - c.last_bytes_at >= silent_s]
        for conn in stalled:
            conn.cut(reason)
        return len(stalled)

    def forget(self, key: tuple[str, str, int]) -> None:
        """Close a removed worker's idle connections (a connection still in use comes
        back through `give` and is kept until the worker closes it)."""
        for conn in self.idle.pop(key, ()):
            conn.close()
        if not self.busy.get(key):
            self.busy.pop(key, None)

    async def _dial(self, target: Target) -> UpstreamConnection:
        loop = asyncio.get_running_loop()
        tls = None
        if target.scheme == "https":
            tls = self._ssl = self._ssl or ssl.create_default_context()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(
                    lambda: UpstreamConnection(self, target.key), target.host, target.port,
                    ssl=tls, server_hostname=target.host if tls else None)
        except TimeoutError as exc:
            raise ConnectTimeout(f"connecting to {target.host}:{target.port} timed out") from exc
        except OSError as exc:
            raise ConnectError(f"cannot connect to {target.host}:{target.port}: {exc}") from exc
        return conn

    def close(self) -> None:
        for stack in self.idle.values():
            for conn in stack:
                conn.close()
        self.idle.clear()
