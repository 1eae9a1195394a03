"""The gateway's front door against hostile input: admin closed without a key, bodies
over the limit refused as they arrive (413), deep nesting and lone surrogates 400, and
one large request never stalls the others."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import httpx
import pytest

from sluice.gateway.config import GatewayConfig
from sluice.gateway.middleware import GatewayMiddleware
from sluice.gateway.store import SQLStore

from .conftest import ADMIN_KEY, CHAT, client_for, make_state, new_key, serve
from .stub import StubUpstream

ADMIN_ROUTES = [("POST", "/admin/tenants"), ("GET", "/admin/tenants"),
                ("GET", "/admin/tenants/acme"), ("PATCH", "/admin/tenants/acme"),
                ("DELETE", "/admin/tenants/acme"),
                ("POST", "/admin/keys"), ("GET", "/admin/keys"), ("GET", "/admin/keys/k1"),
                ("DELETE", "/admin/keys/k1"),
                ("POST", "/admin/keys/k1/revoke"), ("GET", "/admin/usage"),
                ("POST", "/admin/purge")]


@pytest.mark.parametrize(("method", "path"), ADMIN_ROUTES)
async def test_every_admin_route_needs_the_admin_key(
        sqlite_store: SQLStore, stub: StubUpstream, method: str, path: str) -> None:
    state = make_state(sqlite_store)
    state.config = GatewayConfig(admin_key=None)
    closed = GatewayMiddleware(stub, state)
    async with client_for(closed) as c:
        r = await c.request(method, path, json={}, headers={"authorization": "Bearer x"})
        assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
    guarded = GatewayMiddleware(stub, make_state(sqlite_store))
    user_key = new_key(sqlite_store)
    async with client_for(guarded) as c:
        for headers in ({}, {"authorization": "Bearer wrong"},
                        {"authorization": f"Bearer {user_key}"}):
            r = await c.request(method, path, json={}, headers=headers)
            assert r.status_code == 401, (headers, r.text)
            assert r.json()["error"]["type"] == "authentication_error"
        r = await c.request(method, path, headers={"authorization": f"Bearer {ADMIN_KEY}"})
        assert r.status_code not in (401, 403)


@pytest.mark.parametrize("path", ["/v1/pd_role", "/v1/load_lora_adapter",
                                  "/v1/unload_lora_adapter"])
async def test_a_tenant_key_cannot_reach_a_workers_control_routes(
        sqlite_store: SQLStore, stub: StubUpstream, path: str) -> None:
    """Found by a new-user pass: any API key could POST /v1/pd_role through the gateway
    (switching the worker's role, bumping its epoch, draining it)."""
    body = {"role": "prefill", "expected_epoch": 0, "lora_name": "x", "lora_path": "/x"}
    state = make_state(sqlite_store)
    state.config = GatewayConfig(admin_key=None)
    user_key = new_key(sqlite_store)
    async with client_for(GatewayMiddleware(stub, state)) as c:
        r = await c.post(path, json=body, headers={"authorization": f"Bearer {user_key}"})
        assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
    async with client_for(GatewayMiddleware(stub, make_state(sqlite_store))) as c:
        for method in ("GET", "POST"):
            r = await c.request(method, path, json=body,
                                headers={"authorization": f"Bearer {user_key}"})
            assert r.status_code == 401, r.text
        r = await c.post(path, json=body, headers={"authorization": f"Bearer {ADMIN_KEY}"})
        assert r.status_code == 404  # the admin's request reached the upstream (no such route)
    assert stub.received == []  # no tenant request was forwarded


def small_gateway(store: SQLStore, stub: StubUpstream, max_body_bytes: int) -> GatewayMiddleware:
    state = make_state(store)
    state.config = GatewayConfig(admin_key=ADMIN_KEY, max_body_bytes=max_body_bytes)
    return GatewayMiddleware(stub, state)


async def _chunks(data: bytes, size: int = 1000) -> AsyncIterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i:i + size]


async def test_bodies_over_the_limit_are_413_declared_or_streamed(
        sqlite_store: SQLStore, stub: StubUpstream) -> None:
    key = new_key(sqlite_store)
    gw = small_gateway(sqlite_store, stub, 4000)
    big = b'{"model": "stub-model", "messages": [{"role": "user", "content": "%s"}]}' % (
        b"x" * 5000)
    async with client_for(gw, key) as c:
        r = await c.post("/v1/chat/completions", content=big)  # Content-Length declared
        assert r.status_code == 413, r.text
        err = r.json()["error"]
        assert (err["type"], err["code"], err["param"]) == (
            "invalid_request_error", "request_too_large", "body")
        r = await c.post("/v1/chat/completions", content=_chunks(big))  # chunked
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        r = await c.post("/v1/messages", content=big)
        assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
        assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200
    assert len(stub.received) == 1  # nothing over the limit went upstream


async def test_a_huge_body_is_refused_at_once_over_a_real_socket(
        sqlite_store: SQLStore, stub: StubUpstream) -> None:
    """The hostile test: 5 MB through the gateway, while /health and a small chat are
    answered in their usual time."""
    key = new_key(sqlite_store)
    gw = GatewayMiddleware(stub, make_state(sqlite_store))  # the default limit
    body = b'{"model": "stub-model", "messages": [{"role": "user", "content": "%s"}]}' % (
        b"word " * 1_000_000)
    async with serve(gw) as url, httpx.AsyncClient(base_url=url, timeout=10) as c:
        headers = {"authorization": f"Bearer {key}"}
        started = time.perf_counter()
        big = asyncio.create_task(c.post("/v1/chat/completions", content=body, headers=headers))
        small = await c.post("/v1/chat/completions", json=CHAT, headers=headers)
        assert small.status_code == 200
        try:
            r = await big
            assert r.status_code == 413
        except httpx.HTTPError:
            pass  # the server may close before the client finished sending: also a refusal
        assert time.perf_counter() - started < 5


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
async def test_deep_nesting_and_lone_surrogates_are_400(
        gateway: GatewayMiddleware, sqlite_store: SQLStore, path: str) -> None:
    key = new_key(sqlite_store)
    deep = b'{"model": "stub-model", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    nested = b'{"model": "stub-model", "messages": [{"role": "user", "content": ' + (
        b"[" * 500) + b"]" * 500 + b"}]}"
    lone = b'{"model": "stub-model", "max_tokens": 4, "messages": [{"role": "user", ' \
           b'"content": "hi \\ud800 there"}]}'
    raw_surrogate = lone.replace(b"\\ud800", b"\xed\xa0\x80")
    async with client_for(gateway, key) as c:
        for body in (deep, nested, lone, raw_surrogate):
            r = await c.post(path, content=body)
            assert r.status_code == 400, (body[:60], r.text)
            if path == "/v1/messages":
                assert r.json()["error"]["type"] == "invalid_request_error"
            else:
                assert r.json()["error"]["param"] == "body"
