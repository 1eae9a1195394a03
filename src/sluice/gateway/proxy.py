"""The inner app of `sluice gateway --upstream URL`: a streaming HTTP proxy.

An ASGI app that forwards every request to one upstream (a sluice router, a worker, a
vLLM server) with one injected `httpx.AsyncClient`, streaming the response back chunk
by chunk. It asks the upstream for an uncompressed body (`accept-encoding: identity`)
so the gateway can read usage off it. If the client hangs up, the upstream response
is closed at once, which aborts the request in the engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import httpx

from sluice.protocol.edge import send_error
from sluice.protocol.errors import SluiceError

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_HOP_BY_HOP = {b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization",
               b"te", b"trailers", b"transfer-encoding", b"upgrade", b"host",
               b"accept-encoding", b"content-length"}


class UpstreamProxy:
    """`UpstreamProxy(upstream_url, client=None)`: owns (or borrows) one AsyncClient."""

    def __init__(self, upstream: str, client: httpx.AsyncClient | None = None,
                 timeout_s: float = 600.0) -> None:
        self.upstream = upstream.rstrip("/")
        self.client = client or httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0))

    async def __call__(self, scope: MutableMapping[str, Any], receive: Receive,
                       send: Send) -> None:
        if scope["type"] == "lifespan":
            return await self._lifespan(receive, send)
        if scope["type"] != "http":
            return
        body = await _read_body(receive)
        stream = asyncio.create_task(self._forward(scope, body, send))
        hangup = asyncio.create_task(_wait_disconnect(receive))
        done, pending = await asyncio.wait({stream, hangup}, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        if stream in done:
            stream.result()

    def _request(self, scope: MutableMapping[str, Any], body: bytes) -> httpx.Request:
        query = scope.get("query_string", b"").decode("latin-1")
        url = self.upstream + scope["path"] + (f"?{query}" if query else "")
        headers = [(k, v) for k, v in scope.get("headers") or [] if k.lower() not in _HOP_BY_HOP]
        headers.append((b"accept-encoding", b"identity"))
        return self.client.build_request(scope["method"], url, headers=headers, content=body)

    async def _forward(self, scope: MutableMapping[str, Any], body: bytes, send: Send) -> None:
        try:
            response = await self.client.send(self._request(scope, body), stream=True)
        except httpx.HTTPError as exc:
            return await _bad_gateway(send, f"upstream {self.upstream} unreachable: {exc}",
                                      scope["path"])
        try:
            headers = [(k, v) for k, v in response.headers.raw if k.lower() not in _HOP_BY_HOP
                       or k.lower() == b"content-length"]
            await send({"type": "http.response.start", "status": response.status_code,
                        "headers": headers})
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await response.aclose()

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.client.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return


async def _read_body(receive: Receive) -> bytes:
    chunks, more = [], True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunks.append(message.get("body", b""))
        more = message.get("more_body", False)
    return b"".join(chunks)


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class UpstreamUnreachableError(SluiceError):
    """The upstream could not be reached: 502 `bad_gateway`."""

    status_code = 502
    error_type = "upstream_error"
    default_code = "bad_gateway"


async def _bad_gateway(send: Send, message: str, path: str) -> None:
    """In the error shape the client of `path` reads: Anthropic's on /v1/messages (it
    was OpenAI's on every path), OpenAI's elsewhere."""
    await send_error(send, UpstreamUnreachableError(message), path)
