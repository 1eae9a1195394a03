"""Malformed HTTP over raw sockets against the worker (uvicorn), the router (its own
httptools server) and `sluice serve` (gateway over the router, same server).

Every case must end in a 4xx (or, for framing the server cannot read, a closed
connection), never a 5xx; a JSON error is in OpenAI's shape (Anthropic's on
/v1/messages); the process answers /health afterwards. Slowloris: many connections
that send half a request and stop must not keep the server from answering others.
"""

from __future__ import annotations

import json
import socket
import time

import pytest

from .checks import (
    HealthWatch,
    RawResponse,
    address,
    error_shape,
    post_bytes,
    raw_exchange,
    read_response,
)
from .conftest import Process, Stack

TARGETS = ["worker", "router", "serve"]


def target_of(stack: Stack, name: str) -> tuple[Process, dict[str, str]]:
    headers = {"authorization": f"Bearer {stack.key}"} if name == "serve" else {}
    return getattr(stack, name), headers


def chat(model: str, **fields: object) -> dict[str, object]:
    return {"model": model, "max_tokens": 2,
            "messages": [{"role": "user", "content": "hi"}], **fields}


def bad_bodies(model: str) -> dict[str, bytes]:
    """Bodies that are well framed but wrong: each must be a 400 (422 never).

    Not here, because they are accepted on purpose: `"temperature": 1e309` (Python's
    JSON reads it as infinity, a valid non-negative temperature: sampling becomes
    uniform) and `"stream": "yes"` (pydantic's lax booleans, as in vLLM)."""
    def enc(doc: object) -> bytes:
        return json.dumps(doc).encode()

    return {
        "truncated json": enc(chat(model))[:-7],
        "empty": b"",
        "not an object": b"[1, 2, 3]",
        "invalid utf-8": enc(chat(model)).replace(b'"hi"', b'"\xff\xfe\xc3("'),
        "huge float": enc(chat(model)).replace(b'"max_tokens": 2', b'"max_tokens": 1e400'),
        "huge int": enc(chat(model, max_tokens=10 ** 400)),
        "huge seed": enc(chat(model, seed=2 ** 200)),
        "nan": enc(chat(model)).replace(b'"max_tokens": 2', b'"temperature": NaN'),
        "messages a string": enc({"model": model, "max_tokens": 2, "messages": "hi"}),
        "message a number": enc({"model": model, "max_tokens": 2, "messages": [1]}),
        "model a number": enc(chat(model) | {"model": 5}),
        "stream a word": enc(chat(model, stream="maybe")),
        "content an object": enc({"model": model, "max_tokens": 2,
                                  "messages": [{"role": "user", "content": {"a": 1}}]}),
        "role unknown": enc({"model": model, "max_tokens": 2,
                             "messages": [{"role": "wizard", "content": "hi"}]}),
        "max_tokens negative": enc(chat(model, max_tokens=-1)),
        "nul bytes": enc(chat(model)).replace(b'"hi"', b'"\\u0000\\u0000"').replace(
            b'"max_tokens": 2', b'"max_tokens": "\\u0000"'),
        "duplicate keys": b'{"model": "%s", "model": 1, "messages": []}' % model.encode(),
    }


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_wrong_bodies_are_4xx_in_the_api_shape(stack: Stack, target: str, path: str) -> None:
    process, headers = target_of(stack, target)
    failures = []
    for name, body in bad_bodies(stack.model).items():
        r = raw_exchange(process.url, post_bytes(path, body, headers))
        if r is None or not 400 <= r.status < 500 or r.status == 422:
            failures.append((name, r and r.status, r and r.body[:300]))
            continue
        error_shape(path, r.status, r.body)
    assert not failures, (failures, [p.text()[-3000:] for p in stack.all()])
    assert process.healthy()


def framing_cases(path: str, headers: dict[str, str]) -> dict[str, bytes]:
    auth = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    head = f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\n{auth}content-type: application/json\r\n"
    body = b'{"model": "m", "messages": []}'
    return {
        "content-length not a number": (head + "content-length: abc\r\n\r\n").encode() + body,
        "content-length negative": (head + "content-length: -5\r\n\r\n").encode() + body,
        "content-length twice, different": (
            head + "content-length: 3\r\ncontent-length: 30\r\n\r\n").encode() + body,
        "content-length and chunked": (
            head + "content-length: 30\r\ntransfer-encoding: chunked\r\n\r\n").encode() + body,
        "chunk size not hex": (head + "transfer-encoding: chunked\r\n\r\nzz\r\n").encode()
        + body + b"\r\n0\r\n\r\n",
        "header without a value": (head + "x-empty:\r\nauthorization:\r\n"
                                   f"content-length: {len(body)}\r\n\r\n").encode() + body,
        "header line without a colon": (head + "garbage line\r\n"
                                        f"content-length: {len(body)}\r\n\r\n").encode() + body,
        "header name with a space": (head + "bad name: 1\r\n"
                                     f"content-length: {len(body)}\r\n\r\n").encode() + body,
        "non-latin header value": (head.encode() + "x-name: \u00e9\u4e2d\r\n".encode()
                                   + f"content-length: {len(body)}\r\n\r\n".encode() + body),
        "request line garbage": b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n",
        "http/0.9": f"GET {path}\r\n\r\n".encode(),
        "unknown method": f"BREW {path} HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n".encode(),
        "huge header": (head + "x-big: " + "a" * 200_000 + "\r\n\r\n").encode(),
        "url with a nul": f"POST {path}%00 HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n"
        .encode(),
    }


def check_framing_answer(path: str, r: RawResponse | None) -> None:
    if r is None:
        return  # closed without an answer: allowed for what cannot be parsed
    assert 400 <= r.status < 500, r
    if r.headers.get("content-type", "").startswith("application/json"):
        error_shape(path, r.status, r.body)


@pytest.mark.parametrize("target", TARGETS)
def test_bad_framing_is_refused_and_the_server_survives(stack: Stack, target: str) -> None:
    process, headers = target_of(stack, target)
    path = "/v1/chat/completions"
    answers = {}
    for name, request in framing_cases(path, headers).items():
        r = raw_exchange(process.url, request, timeout=10)
        answers[name] = None if r is None else r.status
        check_framing_answer(path, r)
        assert process.healthy(), (name, process.text())
    assert sum(s is not None for s in answers.values()) >= len(answers) // 2, answers


@pytest.mark.parametrize("target", TARGETS)
def test_a_body_shorter_than_declared_is_not_fatal(stack: Stack, target: str) -> None:
    """Content-Length 1000, 20 bytes sent: the server waits (bounded here), then the
    client half-closes or goes; either way the server keeps serving."""
    process, headers = target_of(stack, target)
    request = post_bytes("/v1/chat/completions", b"x" * 1000, headers)[:-980]
    with socket.create_connection(address(process.url), timeout=10) as sock:
        sock.sendall(request)
        assert process.healthy()  # while that request is stuck mid-body
        sock.shutdown(socket.SHUT_WR)
        check_framing_answer("/v1/chat/completions", read_response(sock, 10))
    with socket.create_connection(address(process.url), timeout=10) as sock:
        sock.sendall(request)
    assert process.healthy(), process.text()


@pytest.mark.parametrize("target", TARGETS)
def test_slowloris_does_not_starve_other_clients(stack: Stack, target: str) -> None:
    """100 connections each send part of a request head, then a byte every 0.2 s for
    2 s; /health stays fast throughout, and a real request is served."""
    process, headers = target_of(stack, target)
    socks = []
    try:
        with HealthWatch(process.url) as watch:
            for _ in range(100):
                s = socket.create_connection(address(process.url), timeout=5)
                s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-a: ")
                socks.append(s)
            for _ in range(10):
                for s in socks:
                    try:
                        s.sendall(b"a")
                    except OSError:
                        pass  # the server may drop them: also fine
                time.sleep(0.2)
            body = json.dumps(chat(stack.model)).encode()
            r = raw_exchange(process.url, post_bytes("/v1/chat/completions", body, headers))
            assert r is not None and r.status == 200, r
        assert len(watch.times) >= 10 and watch.worst < 1.0, watch.times
    finally:
        for s in socks:
            s.close()
    assert process.healthy()


@pytest.mark.parametrize("target", TARGETS)
def test_unknown_routes_and_methods_answer_in_the_api_shape(stack: Stack, target: str) -> None:
    process, headers = target_of(stack, target)
    for method, path in [("GET", "/v1/chat/completions"), ("GET", "/v1/nope"),
                         ("DELETE", "/v1/models"), ("GET", "/nope/" + "a" * 5000)]:
        request = f"{method} {path} HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n" + "".join(
            f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
        r = raw_exchange(process.url, request.encode())
        assert r is not None and 400 <= r.status < 500, (method, path, r)
        error_shape(path, r.status, r.body)
