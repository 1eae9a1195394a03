"""FastHTTPTransport against a raw asyncio HTTP server: framing, reuse, early close, errors."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import pytest
from router_stubs import free_port

from sluice.router.transport import FastHTTPTransport

RESPONSES = {
    b"/sized": b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-A: 1\r\n\r\nhello",
    b"/chunked": (b"HTTP/1.1 201 Created\r\nTransfer-Encoding: chunked\r\n\r\n"
                  b"3\r\nabc\r\n4;ext=1\r\ndefg\r\n0\r\n\r\n"),
    b"/close": b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil-close",
    b"/empty": b"HTTP/1.1 204 No Content\r\n\r\n",
}


@asynccontextmanager
async def raw_server(close_idle_after_first: bool = False) -> AsyncIterator[dict[str, int]]:
    """Answers canned responses by path; counts connections and requests; a request to
    /slow sends a head and a never-ending chunked body until the client hangs up."""
    stats = {"connections": 0, "requests": 0, "hangups": 0}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        stats["connections"] += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                await reader.readexactly(length)
                stats["requests"] += 1
                path = head.split(b" ")[1]
                if path == b"/slow":
                    writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
                    while True:
                        writer.write(b"1\r\nx\r\n")
                        await writer.drain()
                        await asyncio.sleep(0.01)
                writer.write(RESPONSES[path])
                await writer.drain()
                if path == b"/close" or close_idle_after_first:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            stats["hangups"] += 1
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    stats["port"] = server.sockets[0].getsockname()[1]
    async with server:
        yield stats


async def test_framing_and_keep_alive_reuse() -> None:
    async with raw_server() as s, httpx.AsyncClient(transport=FastHTTPTransport()) as c:
        base = f"http://127.0.0.1:{s['port']}"
        r = await c.post(base + "/sized", content=b'{"a": 1}')
        assert (r.status_code, r.text, r.headers["x-a"]) == (200, "hello", "1")
        r = await c.get(base + "/chunked")
        assert (r.status_code, r.text) == (201, "abcdefg")
        r = await c.get(base + "/empty")
        assert (r.status_code, r.content) == (204, b"")
        assert s["connections"] == 1 and s["requests"] == 3  # one keep-alive connection
        r = await c.get(base + "/close")
        assert r.text == "until-close"
        await c.get(base + "/sized")
        assert s["connections"] == 2  # "Connection: close" was honoured


async def test_early_close_hangs_up_and_stale_connections_are_redialled() -> None:
    async with raw_server() as s, httpx.AsyncClient(transport=FastHTTPTransport()) as c:
        base = f"http://127.0.0.1:{s['port']}"
        async with c.stream("GET", base + "/slow") as r:
            async for _ in r.aiter_raw():
                break
        for _ in range(100):
            if s["hangups"]:
                break
            await asyncio.sleep(0.01)
        assert s["hangups"] == 1  # the server saw the client go away
    async with raw_server(close_idle_after_first=True) as s, \
            httpx.AsyncClient(transport=FastHTTPTransport()) as c:
        base = f"http://127.0.0.1:{s['port']}"
        assert (await c.get(base + "/sized")).text == "hello"
        await asyncio.sleep(0.05)  # the server has closed the idle connection
        assert (await c.get(base + "/sized")).text == "hello"
        assert s["connections"] == 2


async def test_connect_errors_are_httpx_errors() -> None:
    async with httpx.AsyncClient(transport=FastHTTPTransport(connect_timeout=1)) as c:
        with pytest.raises(httpx.ConnectError):
            await c.get(f"http://127.0.0.1:{free_port()}/x")
