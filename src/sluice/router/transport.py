"""The router's one upstream client, seen through httpx: probes, scrapes and `/tokenize`
go over the same `UpstreamPool` connections as the proxied POSTs.

The data path talks to `UpstreamPool` directly (raw head + body, the response relayed as
it arrives). The control traffic is easier to write against httpx (`client.get(url)`,
`.json()`), so `UpstreamTransport` adapts one to the other instead of keeping a second
HTTP/1.1 client: one connection pool per worker, one framing and error code path.

    httpx.Request ─► head + body ─► UpstreamPool.send ─► httpx.Response(stream=_Body)
    _Body: conn.read() until b"" ─► release (keep-alive)  | aclose early ─► socket closed

Errors become httpx's (`ConnectError`, `ConnectTimeout`, `ReadError`, `ReadTimeout`,
`RemoteProtocolError`), so callers keep one exception tree. HEAD requests (a body-less
response the raw parser would wait for) go to httpx's own transport.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx

from sluice.router import upstream
from sluice.router.upstream import Target, UpstreamConnection, UpstreamError, UpstreamPool

_ERRORS: dict[type[UpstreamError], type[httpx.TransportError]] = {
    upstream.ConnectError: httpx.ConnectError, upstream.ConnectTimeout: httpx.ConnectTimeout,
    upstream.ReadError: httpx.ReadError, upstream.ReadTimeout: httpx.ReadTimeout,
    upstream.RemoteProtocolError: httpx.RemoteProtocolError,
}


def as_httpx(exc: UpstreamError) -> httpx.TransportError:
    return _ERRORS.get(type(exc), httpx.TransportError)(str(exc))


class _Body(httpx.AsyncByteStream):
    def __init__(self, conn: UpstreamConnection) -> None:
        self.conn = conn
        self.done = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            while data := await self.conn.read():
                yield data
        except UpstreamError as exc:
            self._finish()
            raise as_httpx(exc) from exc
        self._finish()

    def _finish(self) -> None:
        if not self.done:
            self.done = True
            self.conn.release()  # kept only if the body was read to its end

    async def aclose(self) -> None:
        self._finish()


def _head(request: httpx.Request, body: bytes, target: Target) -> bytes:
    path = request.url.raw_path or b"/"
    lines = [b"%s %s HTTP/1.1\r\n" % (request.method.encode(), path)]
    names = set()
    for name, value in request.headers.raw:
        names.add(name.lower())
        lines.append(name + b": " + value + b"\r\n")
    if b"host" not in names:
        lines.append(target.host_line)
    if body and b"content-length" not in names:
        lines.append(b"content-length: %d\r\n" % len(body))
    return b"".join(lines) + b"\r\n"


class UpstreamTransport(httpx.AsyncBaseTransport):
    """An httpx transport over an `UpstreamPool` (shared with the proxy, or its own)."""

    def __init__(self, pool: UpstreamPool | None = None) -> None:
        self.pool = pool or UpstreamPool()
        self._fallback: httpx.AsyncHTTPTransport | None = None

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.method == "HEAD":
            self._fallback = self._fallback or httpx.AsyncHTTPTransport()
            return await self._fallback.handle_async_request(request)
        target = Target.of(f"{request.url.scheme}://{request.url.netloc.decode('ascii')}")
        body = await request.aread()
        timeouts = request.extensions.get("timeout") or {}
        limit = timeouts.get("read")  # the caller's (a probe's 2 s), else the pool's own
        try:
            async with asyncio.timeout(limit):
                conn = await self.pool.send(target, _head(request, body, target) + body)
        except UpstreamError as exc:
            raise as_httpx(exc) from exc
        except TimeoutError as exc:  # the exchange closed its socket when cancelled
            raise httpx.ReadTimeout(f"no response head within {limit} s") from exc
        return httpx.Response(conn.status, headers=conn.headers, request=request,
                              stream=_Body(conn), extensions={"http_version": b"HTTP/1.1"})

    async def aclose(self) -> None:
        if self._fallback is not None:
            await self._fallback.aclose()
