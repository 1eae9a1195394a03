"""What every reliability test asserts about an answer, and a raw HTTP/1.1 client.

    error_shape(path, status, body)   OpenAI's `{error: {message, type, param, code}}`,
                                      Anthropic's `{type: "error", error: {type, message}}`
                                      on /v1/messages; returns the inner error object
    RawResponse / raw_exchange(...)   bytes in, one parsed response out, over a socket
                                      (for what httpx refuses to send: bad framing,
                                      lying Content-Length, headers without values)
    HealthWatch                       a thread timing GET /health while a test runs
"""

from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx

from sluice.protocol.edge import ANTHROPIC_PATHS

OPENAI_ERROR_FIELDS = {"message", "type", "param", "code"}


def error_shape(path: str, status: int, body: bytes) -> dict[str, Any]:
    """The error object of a 4xx/5xx answer, after checking its shape for `path`."""
    assert 400 <= status < 600, status
    doc = json.loads(body)
    if path.split("?")[0] in ANTHROPIC_PATHS:  # /v1/messages and its count_tokens
        assert doc.get("type") == "error", doc
        assert isinstance(doc["error"]["type"], str) and isinstance(doc["error"]["message"], str)
        return dict(doc["error"])
    assert set(doc) == {"error"}, doc
    assert set(doc["error"]) == OPENAI_ERROR_FIELDS, doc
    assert isinstance(doc["error"]["message"], str) and isinstance(doc["error"]["type"], str)
    return dict(doc["error"])


@dataclass
class RawResponse:
    status: int
    headers: dict[str, str]
    body: bytes


def address(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or 80


def read_response(sock: socket.socket, timeout: float) -> RawResponse | None:
    """One HTTP/1.1 response from `sock` (Content-Length or chunked framing, else to
    EOF); None if the server closed without answering."""
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = _recv(sock)
        if not chunk:
            return None if not data else _parse_head(data, b"")
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    response = _parse_head(head, b"")
    length = response.headers.get("content-length")
    if length is not None:
        while len(rest) < int(length):
            chunk = _recv(sock)
            if not chunk:
                break
            rest += chunk
        response.body = rest[:int(length)]
    elif response.headers.get("transfer-encoding") == "chunked":
        while not rest.endswith(b"0\r\n\r\n"):
            chunk = _recv(sock)
            if not chunk:
                break
            rest += chunk
        response.body = _unchunk(rest)
    else:
        while chunk := _recv(sock):
            rest += chunk
        response.body = rest
    return response


def _recv(sock: socket.socket) -> bytes:
    try:
        return sock.recv(65536)
    except ConnectionResetError:
        return b""


def _parse_head(head: bytes, body: bytes) -> RawResponse:
    lines = head.split(b"\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        headers[name.strip().lower().decode("latin-1")] = value.strip().decode("latin-1")
    return RawResponse(status, headers, body)


def _unchunk(data: bytes) -> bytes:
    out = b""
    while data:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0] or b"0", 16)
        if size == 0:
            break
        out, data = out + data[:size], data[size + 2:]
    return out


def raw_exchange(url: str, request: bytes, timeout: float = 10.0) -> RawResponse | None:
    """Send `request` as is on a fresh connection and read one response."""
    with socket.create_connection(address(url), timeout=timeout) as sock:
        try:
            sock.sendall(request)
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused while sending: the answer may still be readable
        return read_response(sock, timeout)


def post_bytes(path: str, body: bytes, headers: dict[str, str] | None = None) -> bytes:
    """A POST request with an exact Content-Length and `body` as given."""
    lines = [f"POST {path} HTTP/1.1", "host: 127.0.0.1", "content-type: application/json",
             f"content-length: {len(body)}"]
    lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


@dataclass
class HealthWatch:
    """Times GET /health every `interval` seconds on a thread until stopped; `worst` is
    the slowest answer (a failure counts as infinitely slow)."""

    url: str
    interval: float = 0.05
    times: list[float] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> HealthWatch:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join(10)

    def _run(self) -> None:
        with httpx.Client(timeout=10) as client:
            while not self._stop.is_set():
                started = time.perf_counter()
                try:
                    ok = client.get(self.url + "/health").status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.times.append(time.perf_counter() - started if ok else float("inf"))
                self._stop.wait(self.interval)

    @property
    def worst(self) -> float:
        return max(self.times, default=0.0)
