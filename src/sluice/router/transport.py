"""A lean HTTP/1.1 keep-alive transport for the router's shared `httpx.AsyncClient`.

httpx's default transport (httpcore on anyio) costs milliseconds of CPU per request on a
busy machine: each request scans every pooled connection, probing each socket. The
router sends plain-HTTP requests to a few workers, so it needs much less: per host, a
stack of idle connections; a request takes one (or dials), writes head and body in one
go, reads the status line and headers, and hands httpx a body stream that reads on
demand. Fully read bodies give their connection back; a body closed early closes its
socket, which is exactly how a worker learns that the client went away.

    request ─► idle pool (host:port) ─► write "POST /path HTTP/1.1 ..." + body
                                     ◄─ read head ─► httpx.Response(stream=_Body)
    _Body:  Content-Length | chunked | until close  ─► done: back to the pool
                                                    ─► aclose early: socket closed

HTTPS (and anything else unusual) goes to httpx's own transport. Errors are httpx's:
ConnectError / ConnectTimeout before the request is written, ReadError /
RemoteProtocolError / ReadTimeout after, so callers keep one exception tree. A reused
connection that the server had already closed is retried once on a fresh one.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx

CHUNK = 65536
MAX_HEAD = 65536


class _Stale(Exception):
    """A reused connection turned out closed by the server before any response byte."""


@dataclass
class _Conn:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    key: tuple[str, int]
    reused: bool = False

    def close(self) -> None:
        self.writer.close()


@dataclass
class _Pool:
    idle: dict[tuple[str, int], list[_Conn]] = field(default_factory=dict)
    max_idle_per_host: int = 512

    def take(self, key: tuple[str, int]) -> _Conn | None:
        stack = self.idle.get(key)
        while stack:
            conn = stack.pop()
            if not conn.reader.at_eof() and not conn.writer.is_closing():
                conn.reused = True
                return conn
            conn.close()
        return None

    def give(self, conn: _Conn) -> None:
        stack = self.idle.setdefault(conn.key, [])
        if len(stack) < self.max_idle_per_host and not conn.writer.is_closing():
            stack.append(conn)
        else:
            conn.close()

    def close(self) -> None:
        for stack in self.idle.values():
            for conn in stack:
                conn.close()
        self.idle.clear()


class _Body(httpx.AsyncByteStream):
    """A response body read from the connection as the consumer asks for it."""

    def __init__(self, conn: _Conn, pool: _Pool, length: int | None, chunked: bool,
                 keep_alive: bool, read_timeout: float | None) -> None:
        self.conn, self.pool = conn, pool
        self.length, self.chunked = length, chunked
        self.keep_alive = keep_alive
        self.read_timeout = read_timeout
        self.done = False
        self.closed = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            parts = (self._chunked() if self.chunked else self._sized()
                     if self.length is not None else self._until_close())
            async for part in parts:
                yield part
        except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
            self._discard()
            raise httpx.ReadError(f"reading the response body failed: {exc!r}") from exc
        except TimeoutError as exc:
            self._discard()
            raise httpx.ReadTimeout("timed out reading the response body") from exc
        self.done = True
        self._release()

    async def _read(self, n: int) -> bytes:
        async with asyncio.timeout(self.read_timeout):
            return await self.conn.reader.read(n)

    async def _exact(self, n: int) -> bytes:
        async with asyncio.timeout(self.read_timeout):
            return await self.conn.reader.readexactly(n)

    async def _sized(self) -> AsyncIterator[bytes]:
        remaining = self.length or 0
        while remaining > 0:
            data = await self._read(min(CHUNK, remaining))
            if not data:
                raise asyncio.IncompleteReadError(b"", remaining)
            remaining -= len(data)
            yield data

    async def _chunked(self) -> AsyncIterator[bytes]:
        while True:
            async with asyncio.timeout(self.read_timeout):
                line = await self.conn.reader.readuntil(b"\r\n")
            size = int(line.split(b";", 1)[0].strip(), 16)
            if size == 0:
                async with asyncio.timeout(self.read_timeout):  # trailers end with a blank line
                    while (await self.conn.reader.readuntil(b"\r\n")) != b"\r\n":
                        pass
                return
            data = await self._exact(size + 2)
            yield data[:-2]

    async def _until_close(self) -> AsyncIterator[bytes]:
        self.keep_alive = False
        while data := await self._read(CHUNK):
            yield data

    def _release(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.done and self.keep_alive:
            self.pool.give(self.conn)
        else:
            self.conn.close()

    def _discard(self) -> None:
        self.keep_alive = False
        self._release()

    async def aclose(self) -> None:
        self._release()


def _head(request: httpx.Request, body: bytes) -> bytes:
    url = request.url
    target = url.raw_path.decode("ascii")
    lines = [f"{request.method} {target} HTTP/1.1"]
    for name, value in request.headers.raw:
        if name.lower() not in (b"content-length", b"transfer-encoding", b"connection"):
            lines.append(f"{name.decode('latin-1')}: {value.decode('latin-1')}")
    if body or request.method in ("POST", "PUT", "PATCH"):
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _parse_head(head: bytes) -> tuple[int, list[tuple[bytes, bytes]]]:
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
        raise httpx.RemoteProtocolError(f"bad status line {lines[0][:80]!r}")
    headers = []
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(b":")
            headers.append((name.strip(), value.strip()))
    return int(parts[1]), headers


class FastHTTPTransport(httpx.AsyncBaseTransport):
    """Keep-alive HTTP/1.1 over asyncio streams for `http://` URLs; others go to httpx."""

    def __init__(self, connect_timeout: float | None = 5.0, read_timeout: float | None = 600.0,
                 max_idle_per_host: int = 512) -> None:
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self._pool = _Pool(max_idle_per_host=max_idle_per_host)
        self._fallback = httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.scheme != "http":
            return await self._fallback.handle_async_request(request)
        body = await request.aread()
        payload = _head(request, body) + body
        key = (request.url.host, request.url.port or 80)
        conn = self._pool.take(key)
        if conn is not None:
            try:
                return await self._exchange(conn, payload, request)
            except _Stale:
                pass  # the server closed an idle connection: dial once more
        return await self._exchange(await self._dial(key), payload, request)

    async def _dial(self, key: tuple[str, int]) -> _Conn:
        try:
            async with asyncio.timeout(self.connect_timeout):
                reader, writer = await asyncio.open_connection(key[0], key[1], limit=MAX_HEAD)
        except TimeoutError as exc:
            raise httpx.ConnectTimeout(f"connecting to {key[0]}:{key[1]} timed out") from exc
        except OSError as exc:
            raise httpx.ConnectError(f"cannot connect to {key[0]}:{key[1]}: {exc}") from exc
        return _Conn(reader, writer, key)

    async def _exchange(self, conn: _Conn, payload: bytes, request: httpx.Request
                        ) -> httpx.Response:
        try:
            conn.writer.write(payload)
            async with asyncio.timeout(self.read_timeout):
                head = await conn.reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionResetError, BrokenPipeError) as exc:
            conn.close()
            partial = getattr(exc, "partial", b"")
            if conn.reused and not partial:
                raise _Stale() from exc
            raise httpx.RemoteProtocolError("server closed the connection without a response"
                                            ) from exc
        except (OSError, asyncio.LimitOverrunError, ValueError) as exc:
            conn.close()
            raise httpx.ReadError(f"reading the response head failed: {exc!r}") from exc
        except TimeoutError as exc:
            conn.close()
            raise httpx.ReadTimeout("timed out waiting for the response") from exc
        except BaseException:  # cancelled mid-exchange: the connection is in an unknown state
            conn.close()
            raise
        status, headers = _parse_head(head)
        return httpx.Response(status, headers=headers, request=request,
                              stream=self._body(conn, request, status, headers),
                              extensions={"http_version": b"HTTP/1.1"})

    def _body(self, conn: _Conn, request: httpx.Request, status: int,
              headers: list[tuple[bytes, bytes]]) -> _Body:
        fields = {name.lower(): value for name, value in headers}
        keep_alive = fields.get(b"connection", b"").lower() != b"close"
        no_body = request.method == "HEAD" or status in (204, 304) or 100 <= status < 200
        chunked = b"chunked" in fields.get(b"transfer-encoding", b"").lower()
        length = 0 if no_body else (None if chunked else _int(fields.get(b"content-length")))
        return _Body(conn, self._pool, length, chunked and not no_body, keep_alive,
                     self.read_timeout)

    async def aclose(self) -> None:
        self._pool.close()
        await self._fallback.aclose()


def _int(value: bytes | None) -> int | None:
    return int(value) if value is not None and value.strip().isdigit() else None
