"""Regressions of the hostile test of 2026-12-01, against real worker, router and
`sluice serve` processes: each finding there was fixed; these prove it stays fixed.

- admin routes without the admin key: 401 (every route, read from the apps' route
  tables and the live /openapi.json, so a route added later is covered without editing
  this file);
- a 5 MB body: 413 as it arrives (declared or chunked), while /health stays fast;
- deeply nested JSON, lone UTF-16 surrogates: 400 naming `body`;
- a client that leaves before its first token: the request is aborted in the engine
  (the worker's running and waiting gauges return to 0).
"""

from __future__ import annotations

import re
import socket
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from sluice.gateway.config import GatewayConfig
from sluice.gateway.state import GatewayState
from sluice.gateway.store import SQLStore

from .checks import HealthWatch, address, error_shape, post_bytes, raw_exchange, read_response
from .conftest import ADMIN_KEY, MAX_NUM_SEQS, Process, Stack, metric

GENERATION = ["/v1/chat/completions", "/v1/completions", "/v1/messages"]


def app_routes(app: object) -> set[tuple[str, str]]:
    """(method, path) of every route in a Starlette/FastAPI app's route table."""
    out = set()
    for route in getattr(app, "routes", []):
        for method in getattr(route, "methods", None) or ():
            if method != "HEAD":
                out.add((method, route.path))
    return out


def live_routes(process: Process) -> set[tuple[str, str]]:
    doc = httpx.get(process.url + "/openapi.json", timeout=10).json()
    return {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops}


def in_process_routes(tmp_path: Path) -> dict[str, set[tuple[str, str]]]:
    """The route tables of the three apps, built here as their CLIs build them."""
    from sluice.gateway.admin import build_admin_app
    from sluice.router.app import build_app as router_app
    from sluice.router.config import PoolConfig, RouterConfig
    from sluice.worker.app import build_app as worker_app
    from sluice.worker.config import WorkerConfig

    store = SQLStore(f"sqlite:///{tmp_path / 'routes.db'}")
    try:
        gateway = build_admin_app(GatewayState.from_config(GatewayConfig(), store=store))
        return {"gateway": app_routes(gateway),
                "router": app_routes(router_app(RouterConfig(pools=(PoolConfig(),)),
                                                local_tokenizers={})),
                "worker": app_routes(worker_app(None, WorkerConfig()))}
    finally:
        store.close()


def is_admin(path: str) -> bool:
    return path.startswith("/admin")


def concrete(path: str) -> str:
    return re.sub(r"\{[^}]+\}", "x", path)


def test_every_admin_route_refuses_a_missing_or_wrong_key(stack: Stack, tmp_path: Path) -> None:
    tables = in_process_routes(tmp_path)
    router_admin = {r for r in tables["router"] | live_routes(stack.router) if is_admin(r[1])}
    gateway_admin = {r for r in tables["gateway"] if is_admin(r[1])}
    served_admin = {r for r in live_routes(stack.serve) if is_admin(r[1])}  # router's, planner
    worker_admin = {r for r in tables["worker"] | live_routes(stack.worker) if is_admin(r[1])}
    assert len(router_admin) >= 4 and len(gateway_admin) >= 9 and ("GET", "/admin/planner") \
        in served_admin, (router_admin, gateway_admin, served_admin)
    targets = ([(stack.router, r) for r in router_admin]
               + [(stack.serve, r) for r in gateway_admin | served_admin | router_admin]
               + [(stack.worker, r) for r in worker_admin])
    wrong_keys = [{}, {"authorization": "Bearer wrong"}, {"x-admin-key": "wrong"},
                  {"authorization": f"Bearer {stack.key}"}]  # a tenant's key is no admin key
    with httpx.Client(timeout=10) as client:
        for process, (method, path) in targets:
            for headers in wrong_keys:
                r = client.request(method, process.url + concrete(path), headers=headers,
                                   json={"url": "http://127.0.0.1:1", "name": "x"})
                assert r.status_code == 401, (process.name, method, path, headers, r.text)
                assert error_shape(path, r.status_code, r.content)["type"] == \
                    "authentication_error"
        r = client.get(stack.serve.url + "/admin/tenants",
                       headers={"authorization": f"Bearer {ADMIN_KEY}"})
        assert r.status_code == 200, r.text  # the key itself works: the check is not vacuous


def huge_body(size: int = 5 * 1024 * 1024) -> bytes:
    prefix = b'{"model": "m", "messages": [{"role": "user", "content": "'
    return prefix + b"x" * (size - len(prefix) - 4) + b'"}]}'


def chunked_upload(url: str, path: str, body: bytes, headers: dict[str, str]) -> int | None:
    """POST `body` with chunked framing, 64 KiB at a time; the status of the answer, which
    may come before the whole body was sent (None: closed without one)."""
    head = [f"POST {path} HTTP/1.1", "host: 127.0.0.1", "content-type: application/json",
            "transfer-encoding: chunked", *(f"{k}: {v}" for k, v in headers.items())]
    with socket.create_connection(address(url), timeout=15) as sock:
        sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
        try:
            for i in range(0, len(body), 65536):
                piece = body[i:i + 65536]
                sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
            sock.sendall(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed mid-upload: what we want
        response = read_response(sock, 15)
    return None if response is None else response.status


@pytest.mark.parametrize("target", ["worker", "router", "serve"])
def test_a_5mb_body_is_413_as_it_arrives_and_health_stays_fast(stack: Stack, target: str) -> None:
    process: Process = getattr(stack, target)
    headers = {"authorization": f"Bearer {stack.key}"} if target == "serve" else {}
    body = huge_body()
    with HealthWatch(process.url) as watch:
        for path in GENERATION:
            started = time.perf_counter()
            r = raw_exchange(process.url, post_bytes(path, body, headers), timeout=15)
            assert r is not None and r.status == 413, (path, r)
            assert error_shape(path, r.status, r.body)
            status = chunked_upload(process.url, path, body, headers)
            assert status == 413, (target, path, status)
            assert time.perf_counter() - started < 10
        time.sleep(0.2)
    assert len(watch.times) >= 3 and watch.worst < 1.0, watch.times
    assert process.healthy()


DEEP = b'{"model": "m", "messages": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
NESTED_CONTENT = (b'{"model": "m", "messages": [{"role": "user", "content": '
                  + b"[" * 300 + b"]" * 300 + b"}]}")
LONE = (b'{"model": "m", "max_tokens": 4, "messages": [{"role": "user", '
        b'"content": "hi \\ud800 there"}], "prompt": "a \\udfff b"}')
RAW_SURROGATE = LONE.replace(b"\\ud800", b"\xed\xa0\x80")


@pytest.mark.parametrize("target", ["worker", "router", "serve"])
def test_deep_nesting_and_lone_surrogates_are_400(stack: Stack, target: str) -> None:
    process: Process = getattr(stack, target)
    headers = {"authorization": f"Bearer {stack.key}"} if target == "serve" else {}
    for path in [*GENERATION, "/tokenize"]:
        for body in (DEEP, NESTED_CONTENT, LONE, RAW_SURROGATE):
            r = raw_exchange(process.url, post_bytes(path, body, headers))
            assert r is not None and r.status == 400, (target, path, body[:50], r)
            err = error_shape(path, r.status, r.body)
            assert err["type"] == "invalid_request_error", err
            if path != "/v1/messages":
                assert err["param"] == "body", err
    assert process.healthy()


def worker_load(stack: Stack) -> tuple[float, float]:
    text = httpx.get(stack.worker.url + "/metrics", timeout=5).text
    return metric(text, "vllm:num_requests_running"), metric(text, "vllm:num_requests_waiting")


def wait_for(predicate: Callable[[], bool], timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return bool(predicate())


STREAM = {"max_tokens": 480, "ignore_eos": True, "stream": True,
          "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("target", ["serve", "router"])
def test_a_client_leaving_before_its_first_token_is_aborted_in_the_engine(
        stack: Stack, target: str) -> None:
    """Both engine slots are held by long streams, so the third request can only wait
    (no token yet); its client hangs up; the worker's waiting gauge drops to 0 while the
    holders still run, then everything drains to 0 once they go too."""
    process: Process = getattr(stack, target)
    headers = {"authorization": f"Bearer {stack.key}"} if target == "serve" else {}
    body = {**STREAM, "model": stack.model}
    assert wait_for(lambda: worker_load(stack) == (0, 0)), worker_load(stack)
    with httpx.Client(base_url=process.url, headers=headers, timeout=30) as client:
        holders = [client.stream("POST", "/v1/chat/completions", json=body)
                   for _ in range(MAX_NUM_SEQS)]
        try:
            for holder in holders:
                response = holder.__enter__()
                assert response.status_code == 200
            assert wait_for(lambda: worker_load(stack)[0] == MAX_NUM_SEQS), worker_load(stack)
            waiter = socket.create_connection(address(process.url), timeout=10)
            waiter.sendall(post_bytes("/v1/chat/completions", httpx.Request(
                "POST", "http://x", json=body).read(), headers))
            assert wait_for(lambda: worker_load(stack)[1] == 1), worker_load(stack)
            waiter.close()  # before any token
            assert wait_for(lambda: worker_load(stack)[1] == 0, 10), worker_load(stack)
            assert worker_load(stack)[0] == MAX_NUM_SEQS  # the holders are still streaming
        finally:
            for holder in holders:
                holder.__exit__(None, None, None)  # mid-stream hang-ups
    assert wait_for(lambda: worker_load(stack) == (0, 0), 10), worker_load(stack)
    assert process.healthy() and stack.worker.healthy()
