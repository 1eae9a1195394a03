"""The router's one upstream client against a raw asyncio HTTP server: framing, reuse,
early close, errors. `UpstreamPool` carries the proxied POSTs; `UpstreamTransport` puts
httpx over the same pool for probes, scrapes and /tokenize."""

from __future__ import annotations

import asyncio
import shutil
import ssl
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
from router_stubs import free_port

from sluice.router.transport import UpstreamTransport
from sluice.router.upstream import (
    ConnectError,
    ReadError,
    ReadTimeout,
    Target,
    UpstreamConnection,
    UpstreamPool,
)

RESPONSES = {
    b"/sized": b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-A: 1\r\n\r\nhello",
    b"/chunked": (b"HTTP/1.1 201 Created\r\nTransfer-Encoding: chunked\r\n\r\n"
                  b"3\r\nabc\r\n4;ext=1\r\ndefg\r\n0\r\n\r\n"),
    b"/close": b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil-close",
    b"/empty": b"HTTP/1.1 204 No Content\r\n\r\n",
    b"/continue": (b"HTTP/1.1 100 Continue\r\n\r\n"
                   b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"),
    b"/short": b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc",
    b"/big": b"HTTP/1.1 200 OK\r\nContent-Length: 1048576\r\n\r\n" + b"x" * 1048576,
}


@asynccontextmanager
async def raw_server(close_idle_after_first: bool = False, tls: ssl.SSLContext | None = None
                     ) -> AsyncIterator[dict[str, int]]:
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
                if path == b"/silent":
                    await reader.read()  # never answers; returns when the client hangs up
                    break
                if path == b"/slow":
                    writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
                    while True:
                        writer.write(b"1\r\nx\r\n")
                        await writer.drain()
                        await asyncio.sleep(0.01)
                writer.write(RESPONSES[path])
                await writer.drain()
                if path in (b"/close", b"/short") or close_idle_after_first:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            stats["hangups"] += 1
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=tls)
    stats["port"] = server.sockets[0].getsockname()[1]
    async with server:
        yield stats


async def test_framing_and_keep_alive_reuse() -> None:
    async with raw_server() as s, httpx.AsyncClient(transport=UpstreamTransport()) as c:
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
    async with raw_server() as s, httpx.AsyncClient(transport=UpstreamTransport()) as c:
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
            httpx.AsyncClient(transport=UpstreamTransport()) as c:
        base = f"http://127.0.0.1:{s['port']}"
        assert (await c.get(base + "/sized")).text == "hello"
        await asyncio.sleep(0.05)  # the server has closed the idle connection
        assert (await c.get(base + "/sized")).text == "hello"
        assert s["connections"] == 2


async def test_connect_errors_are_httpx_errors() -> None:
    async with httpx.AsyncClient(transport=UpstreamTransport(UpstreamPool(connect_timeout=1))) as c:
        with pytest.raises(httpx.ConnectError):
            await c.get(f"http://127.0.0.1:{free_port()}/x")


def post(path: bytes, port: int, body: bytes = b'{"a": 1}') -> bytes:
    return (b"POST %s HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Length: %d\r\n\r\n%s"
            % (path, port, len(body), body))


async def read_all(conn: UpstreamConnection) -> bytes:
    parts = []
    while data := await conn.read():
        parts.append(data)
    conn.release()
    return b"".join(parts)


async def test_upstream_framing_keep_alive_and_informational_heads() -> None:
    pool = UpstreamPool()
    async with raw_server() as s:
        target = Target.of(f"http://127.0.0.1:{s['port']}")
        conn = await pool.send(target, post(b"/sized", s["port"]))
        assert (conn.status, conn.content_length, conn.headers[-1]) == (200, 5, (b"x-a", b"1"))
        assert await read_all(conn) == b"hello"
        conn = await pool.send(target, post(b"/chunked", s["port"]))
        assert (conn.status, conn.chunked, conn.content_length) == (201, True, None)
        assert await read_all(conn) == b"abcdefg"  # chunk extensions dropped, framing decoded
        conn = await pool.send(target, post(b"/empty", s["port"]))
        assert (conn.status, await read_all(conn)) == (204, b"")
        conn = await pool.send(target, post(b"/continue", s["port"]))
        assert (conn.status, await read_all(conn)) == (200, b"ok")  # the 100 is skipped
        assert s["connections"] == 1 and s["requests"] == 4  # one keep-alive connection
        conn = await pool.send(target, post(b"/close", s["port"]))
        assert await read_all(conn) == b"until-close"
        assert await read_all(await pool.send(target, post(b"/sized", s["port"]))) == b"hello"
        assert s["connections"] == 2  # "Connection: close" was honoured
        conn = await pool.send(target, post(b"/big", s["port"]))
        for _ in range(500):  # nobody reads: past 256 KiB buffered, the socket stops reading
            if conn.paused:
                break
            await asyncio.sleep(0.01)
        assert conn.paused
        assert len(await read_all(conn)) == 1048576 and not conn.paused
    pool.close()


async def test_upstream_release_before_the_end_hangs_up_and_stale_ones_are_redialled() -> None:
    pool = UpstreamPool()
    async with raw_server() as s:
        conn = await pool.send(Target.of(f"http://127.0.0.1:{s['port']}"), post(b"/slow", s["port"]))
        assert await conn.read()
        conn.release()  # the body is not finished: the socket closes
        for _ in range(100):
            if s["hangups"]:
                break
            await asyncio.sleep(0.01)
        assert s["hangups"] == 1 and conn.closed
    async with raw_server(close_idle_after_first=True) as s:
        target = Target.of(f"http://127.0.0.1:{s['port']}")
        assert await read_all(await pool.send(target, post(b"/sized", s["port"]))) == b"hello"
        for _ in range(100):  # the server closes the idle connection
            if all(c.closed for c in pool.idle[target.key]):
                break
            await asyncio.sleep(0.01)
        assert await read_all(await pool.send(target, post(b"/sized", s["port"]))) == b"hello"
        assert s["connections"] == 2
    pool.close()


async def test_upstream_errors_connect_read_and_timeout() -> None:
    pool = UpstreamPool(connect_timeout=1, read_timeout=0.2)
    port = free_port()
    with pytest.raises(ConnectError):
        await pool.send(Target.of(f"http://127.0.0.1:{port}"), post(b"/x", port))
    async with raw_server() as s:
        target = Target.of(f"http://127.0.0.1:{s['port']}")
        conn = await pool.send(target, post(b"/short", s["port"]))
        assert await conn.read() == b"abc"
        with pytest.raises(ReadError):  # 3 of 10 bytes, then the server closed
            await conn.read()
        conn.release()
        with pytest.raises(ReadTimeout):
            await pool.send(target, post(b"/silent", s["port"]))
    pool.close()


def test_target_of_a_base_url() -> None:
    t = Target.of("http://worker:8001/v1-prefix/")
    assert (t.key, t.host_line, t.prefix) == (("http", "worker", 8001), b"Host: worker:8001\r\n",
                                              b"/v1-prefix")
    assert Target.of("https://w").key == ("https", "w", 443)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
async def test_upstream_dials_https_workers_with_tls(tmp_path: Path) -> None:
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_tls.load_cert_chain(cert, key)
    pool = UpstreamPool(ssl_context=ssl.create_default_context(cafile=str(cert)))
    async with raw_server(tls=server_tls) as s:
        target = Target.of(f"https://127.0.0.1:{s['port']}")
        for _ in range(2):
            assert await read_all(await pool.send(target, post(b"/sized", s["port"]))) == b"hello"
        assert s["connections"] == 1
    pool.close()
